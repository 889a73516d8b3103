"""Schema versions 2 (Observation.tools / tool_choice) and 3 (Episode.group / release): version-1
episodes still load, everywhere they are read (parse, JSONL import, stored rows), and a newer version
is still refused with a clear message."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from marft_bridge.errors import RecordError
from marft_bridge.schema import SCHEMA_VERSION, Action, Episode, Message, Observation, Output, parse_episode

ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "a + b",
                                             "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}

# An episode exactly as marft_bridge wrote it with schema version 1 (no tools fields).
V1 = {
    "schema_version": 1, "id": "old", "source": "langgraph", "task": {"q": "2+3"}, "agents": ["solver"],
    "actions": [{"id": "a0", "agent": "solver", "step": 0, "kind": "llm",
                 "observation": {"messages": [{"role": "user", "content": "2+3?", "name": None, "tool_calls": None,
                                               "tool_call_id": None}], "prompt": None, "prompt_token_ids": None},
                 "output": {"text": "5", "token_ids": None, "logprobs": None, "tool_calls": None,
                            "finish_reason": "stop"},
                 "sampling": None, "policy": None, "depends_on": [], "token_source": "retokenize", "error": None,
                 "started_at": None, "ended_at": None, "metadata": {}}],
    "rewards": [{"id": "r0", "value": 1.0, "agent": None, "action_id": None, "source": "checker",
                 "created_at": "2026-01-01T00:00:00Z", "metadata": {}}],
    "status": "completed", "started_at": "2026-01-01T00:00:00Z", "ended_at": None, "metadata": {},
}


def test_version_is_3_and_a_version_1_episode_loads_as_version_3():
    assert SCHEMA_VERSION == 3
    ep = parse_episode(json.dumps(V1))
    assert ep.schema_version == 3
    obs = ep.actions[0].observation
    assert (obs.tools, obs.tool_choice, obs.messages[0].content) == (None, None, "2+3?")
    again = Episode.model_validate_json(ep.to_json())  # the fast path (store reads) upgrades the same way
    assert again == ep and json.loads(ep.to_json())["schema_version"] == 3
    expected = {**V1, "schema_version": 3, "group": None, "release": None}
    expected["actions"][0]["observation"] = {**V1["actions"][0]["observation"], "tools": None, "tool_choice": None}
    assert json.loads(ep.to_json()) == json.loads(json.dumps(expected))


def test_a_newer_version_is_refused_clearly():
    with pytest.raises(RecordError) as e:
        parse_episode({**V1, "schema_version": 4})
    assert e.value.field == "schema_version"
    assert "unknown schema version 4; this marft_bridge reads versions 1, 2, 3" in e.value.reason
    assert "upgrade marft_bridge" in e.value.reason


def test_tools_and_tool_choice_round_trip():
    obs = Observation(messages=[Message(role="user", content="2+3?")], tools=[ADD_TOOL],
                      tool_choice={"type": "function", "function": {"name": "add"}})
    ep = Episode(actions=[Action(agent="solver", observation=obs,
                                 output=Output(tool_calls=[{"id": "call_1", "type": "function",
                                                            "function": {"name": "add", "arguments": '{"a": 2}'}}]))])
    back = parse_episode(ep.to_json())
    assert back == ep and back.actions[0].observation.tools == [ADD_TOOL]
    assert Observation(tool_choice="required").tool_choice == "required"


@pytest.mark.parametrize("tool, field, reason", [
    ({"type": "web_search"}, "actions.0.observation.tools.1.type", "a tool must have type 'function', not 'web_search'"),
    ({"type": "function", "function": {"description": "x"}}, "actions.0.observation.tools.1.function.name",
     "a function tool needs a name (function.name)"),
    ({"type": "function", "name": "add"}, "actions.0.observation.tools.1.function.name",
     "a function tool needs a name (function.name)"),
])
def test_a_tool_that_is_not_a_function_tool_is_refused_naming_the_field(tool, field, reason):
    raw = json.loads(json.dumps(V1))
    raw["actions"][0]["observation"]["tools"] = [ADD_TOOL, tool]
    with pytest.raises(RecordError) as e:
        parse_episode(raw)
    assert (e.value.field, e.value.reason) == (field, reason)


def test_jsonl_import_upgrades_version_1(store, tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(V1) + "\n")
    report = store.import_(path)
    assert (report.added, report.refused) == (1, 0)
    assert store.get_episode("old") == parse_episode(V1)
    assert store.get_episode("old").schema_version == 3


def test_a_version_1_row_in_the_store_reads_and_merges(store):
    store.add_episode(parse_episode(V1))
    # Rewrite the stored head as marft_bridge with schema version 1 wrote it.
    with store._engine.begin() as conn:  # test-only: plant an old row
        table = sa.Table("marft_episodes", sa.MetaData(), autoload_with=conn)
        body = json.loads(conn.execute(sa.select(table.c.body)).scalar_one())
        assert body["schema_version"] == 3
        body["schema_version"] = 1
        conn.execute(table.update().values(body=json.dumps(body)))
    ep = store.get_episode("old")
    assert ep.schema_version == 3 and ep == parse_episode(V1)
    assert [e.id for e in store.episodes()] == ["old"]
    # A second half, sent as version 1 too, merges into the old row.
    half = {"schema_version": 1, "id": "old", "actions": [
        {"id": "a1", "agent": "critic", "step": 1, "depends_on": ["a0"], "output": {"text": "ok"}}]}
    store.add_episode(half)
    merged = store.get_episode("old")
    assert [a.id for a in merged.actions] == ["a0", "a1"] and merged.schema_version == 3
