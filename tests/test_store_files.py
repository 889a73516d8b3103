"""Export/import: lossless JSONL and Parquet round trips, Parquet loadable with pandas, and
imports that refuse bad records (named by file and line) while the valid ones land."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_schema import episodes
from test_store import T0, make_episode

from marft_bridge.errors import MarftError
from marft_bridge.schema import Episode
from marft_bridge.store import TraceStore


def _fill(store) -> list[Episode]:
    store.add_episode(make_episode(0, source="langgraph"))
    store.add_episode(make_episode(1, source="mcp", agents=("solo",), n=2))
    store.add_episode(Episode(id="empty", source="a2a", started_at=T0 + timedelta(minutes=5),
                              metadata={"note": "no actions"}, task=None))
    store.add_reward("ep0", 0.75, agent="coder")
    store.add_reward("ep1", 1.0, action_id="1-a1", source="judge")
    return list(store.episodes())


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_import_round_trip_is_lossless(store, tmp_path, fmt):
    original = _fill(store)
    path = tmp_path / f"out.{fmt}"
    assert store.export(path) == 3
    with TraceStore.open(tmp_path / "copy.db") as copy:
        report = copy.import_(path)
        assert (report.added, report.refused) == (3, 0)
        assert list(copy.episodes()) == original
        # Importing the same file again merges identical records: nothing is duplicated.
        assert copy.import_(path).added == 3
        assert list(copy.episodes()) == original


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(eps=st.lists(episodes(max_actions=4), min_size=1, max_size=3, unique_by=lambda e: e.id),
       fmt=st.sampled_from(["jsonl", "parquet"]))
def test_any_episodes_round_trip_through_files(tmp_path_factory, eps, fmt):
    d = tmp_path_factory.mktemp("rt")
    with TraceStore.open(d / "a.db") as a, TraceStore.open(d / "b.db") as b:
        for ep in eps:
            a.add_episode(ep)
        a.export(d / f"x.{fmt}")
        assert b.import_(d / f"x.{fmt}").added == len(eps)
        assert {e.id: e for e in b.episodes()} == {e.id: e for e in eps}


def test_export_applies_filters(store, tmp_path):
    _fill(store)
    assert store.export(tmp_path / "mcp.jsonl", source="mcp") == 1
    assert store.export(tmp_path / "rewarded.jsonl", has_reward=True) == 2
    lines = (tmp_path / "rewarded.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["ep0", "ep1"]
    assert store.export(tmp_path / "none.parquet", agent="nobody") == 0
    assert len(pd.read_parquet(tmp_path / "none.parquet")) == 0


def test_parquet_is_flat_enough_for_pandas(store, tmp_path):
    _fill(store)
    store.export(tmp_path / "t.parquet")
    df = pd.read_parquet(tmp_path / "t.parquet")
    assert len(df) == 3 + 2 + 1  # one row per action; the episode without actions keeps one row
    ep0 = df[df.episode_id == "ep0"].sort_values("action_index")
    assert ep0.agent.tolist() == ["planner", "coder", "planner"]
    assert ep0.step.tolist() == [0, 1, 2]
    assert [list(x) for x in ep0.token_ids] == [[0, 1], [1, 2], [2, 3]]
    assert [list(x) for x in ep0.logprobs] == [[-0.5, 0.0], [-0.5, -0.25], [-0.5, -0.5]]
    assert [list(x) for x in ep0.depends_on] == [[], ["0-a0"], ["0-a1"]]
    assert ep0.started_at.iloc[0] == pd.Timestamp(T0)
    assert ep0.team_reward.isna().all() and (ep0.n_rewards == 1).all()
    assert ep0.tools_json.isna().all() and ep0.tool_calls_json.isna().all()
    empty = df[df.episode_id == "empty"]
    assert empty.action_id.isna().all() and empty.source.tolist() == ["a2a"]
    assert json.loads(empty.episode_json.iloc[0])["metadata"] == {"note": "no actions"}


def test_parquet_has_tools_and_tool_calls_as_json(store, tmp_path):
    from marft_bridge.schema import Action, Observation, Output

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]
    ep = Episode(id="tools", actions=[Action(id="m", agent="agent", observation=Observation(tools=tools, tool_choice="auto"),
                                             output=Output(tool_calls=calls, finish_reason="tool_calls"))])
    store.add_episode(ep)
    store.export(tmp_path / "t.parquet")
    row = pd.read_parquet(tmp_path / "t.parquet").iloc[0]
    assert (json.loads(row.tools_json), json.loads(row.tool_calls_json)) == (tools, calls)
    with TraceStore.open(tmp_path / "copy.db") as copy:
        copy.import_(tmp_path / "t.parquet")
        assert copy.get_episode("tools") == ep


def test_import_refuses_bad_lines_and_keeps_the_rest(store, tmp_path):
    good = [make_episode(i) for i in range(3)]
    cycle = make_episode(7).model_dump(mode="json")
    cycle["actions"][0]["depends_on"] = ["7-a2"]
    lines = [
        good[0].model_dump_json(),
        "{broken json",
        json.dumps(cycle),
        "",
        good[1].model_dump_json(),
        json.dumps({**good[2].model_dump(mode="json"), "schema_version": 4}),
        json.dumps(["not", "an", "object"]),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b"\xff\xfe{bad bytes}\n")
    report = store.import_(path)
    assert (report.added, report.refused) == (2, 5)
    records = [r.record for r in report.refusals]
    assert records == ["mixed.jsonl line 2", "mixed.jsonl line 3, episode ep7", "mixed.jsonl line 6, episode ep2",
                       "mixed.jsonl line 7", "mixed.jsonl line 8"]
    assert "dependency cycle" in report.refusals[1].reason
    assert "unknown schema version 4" in report.refusals[2].reason
    assert [e.id for e in store.episodes()] == ["ep0", "ep1"]
    letters = store.dead_letters()
    assert len(letters) == 5 and letters[-1].raw == "{broken json\n"


def test_import_of_missing_or_foreign_files_is_one_clear_error(store, tmp_path):
    with pytest.raises(MarftError, match="no such file"):
        store.import_(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(MarftError, match="cannot tell the format"):
        store.import_(tmp_path / "x.csv")
    pd.DataFrame({"a": [1]}).to_parquet(tmp_path / "other.parquet")
    with pytest.raises(MarftError, match="lacks the column"):
        store.import_(tmp_path / "other.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(MarftError, match="not a readable Parquet file"):
        store.import_(tmp_path / "junk.parquet")
    assert store.count() == 0


def test_broken_parquet_episode_is_refused_alone(store, tmp_path):
    _fill(store)
    store.export(tmp_path / "t.parquet")
    df = pd.read_parquet(tmp_path / "t.parquet")
    df.loc[df.episode_id == "ep1", "action_json"] = "{cut"
    df.to_parquet(tmp_path / "broken.parquet")
    with TraceStore.open(tmp_path / "copy.db") as copy:
        report = copy.import_(tmp_path / "broken.parquet")
        assert (report.added, report.refused) == (2, 1)
        assert report.refusals[0].record == "broken.parquet rows 3-4"
        assert [e.id for e in copy.episodes()] == ["ep0", "empty"]
        assert copy.stats()["dead_letters"] == 1


def test_export_keeps_time_zones(store, tmp_path):
    tz = timezone(timedelta(hours=9))
    ep = Episode(id="tz", started_at=datetime(2025, 6, 1, 9, 0, tzinfo=tz))
    store.add_episode(ep)
    store.export(tmp_path / "tz.parquet")
    with TraceStore.open(tmp_path / "copy.db") as copy:
        copy.import_(tmp_path / "tz.parquet")
        assert copy.get_episode("tz").started_at.utcoffset() == timedelta(hours=9)
    assert pd.read_parquet(tmp_path / "tz.parquet").started_at.iloc[0] == pd.Timestamp("2025-06-01T00:00Z")
