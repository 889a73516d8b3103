"""Flex-POMDP records: property tests for round trips and the DAG checks, and the refusal messages
for every kind of bad input (they name the record and the field)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marft_bridge.errors import RecordError
from marft_bridge.schema import (
    MAX_TEXT_CHARS,
    Action,
    Episode,
    Message,
    Observation,
    Output,
    Policy,
    Reward,
    SamplingParams,
    parse_episode,
    validate_episode,
)

# -- strategies ----------------------------------------------------------------------------------

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-", min_size=1, max_size=12)
finite = st.floats(allow_nan=False, allow_infinity=False)
zones = st.sampled_from([timezone.utc, timezone(timedelta(hours=2)), timezone(timedelta(hours=-5, minutes=-30))])
times = st.builds(
    lambda dt, tz: dt.replace(tzinfo=tz),
    st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)),
    zones,
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | finite | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
metadata = st.dictionaries(st.text(max_size=8), json_values, max_size=3)


@st.composite
def outputs(draw):
    n = draw(st.integers(0, 6))
    with_tokens = draw(st.booleans())
    return Output(
        text=draw(st.text(max_size=40)),
        token_ids=draw(st.lists(st.integers(0, 2**31), min_size=n, max_size=n)) if with_tokens else None,
        logprobs=draw(st.lists(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False), min_size=n, max_size=n))
        if with_tokens else None,
        finish_reason=draw(st.none() | st.sampled_from(["stop", "length"])),
    )


@st.composite
def episodes(draw, max_actions: int = 8):
    """Valid episodes: a random DAG where each action depends on some earlier actions of no later step."""
    agents = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    n = draw(st.integers(0, max_actions))
    actions: list[Action] = []
    step = 0
    for k in range(n):
        step += draw(st.integers(0, 1))
        deps = sorted(draw(st.sets(st.integers(0, k - 1), max_size=3))) if k else []
        actions.append(
            Action(
                id=draw(st.uuids()).hex,
                agent=draw(st.sampled_from(agents)),
                step=step,
                kind=draw(st.sampled_from(["llm", "tool", "message", "env"])),
                observation=Observation(
                    messages=[Message(role="user", content=draw(st.text(max_size=30)))],
                    prompt_token_ids=draw(st.none() | st.lists(st.integers(0, 50000), max_size=5)),
                ),
                output=draw(outputs()),
                sampling=draw(st.none() | st.builds(SamplingParams, temperature=st.floats(0, 2), top_p=st.floats(0.01, 1))),
                policy=draw(st.none() | st.builds(Policy, name=names, version=st.integers(0, 99))),
                depends_on=[actions[d].id for d in deps],
                started_at=draw(st.none() | times),
                metadata=draw(metadata),
            )
        )
    rewards = [
        Reward(
            id=draw(st.uuids()).hex,
            value=draw(finite),
            agent=draw(st.none() | st.sampled_from(agents)),
            action_id=draw(st.none() | st.sampled_from([a.id for a in actions])) if actions else None,
            source=draw(st.sampled_from(["checker", "judge", "user"])),
            created_at=draw(times),
        )
        for _ in range(draw(st.integers(0, 3)))
    ]
    return Episode(
        id=draw(st.uuids()).hex,
        source=draw(st.sampled_from(["langgraph", "mcp", "a2a", "manual"])),
        task=draw(json_values),
        agents=agents,
        actions=actions,
        rewards=rewards,
        status=draw(st.sampled_from(["running", "completed", "failed"])),
        started_at=draw(times),
        ended_at=draw(st.none() | times),
        metadata=draw(metadata),
    )


def chain(n: int = 3) -> Episode:
    acts: list[Action] = []
    for k in range(n):
        acts.append(Action(id=f"a{k}", agent=f"agent{k % 2}", step=k, depends_on=[acts[-1].id] if acts else []))
    return Episode(id="ep", actions=acts)


# -- round trips ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(episodes())
def test_json_round_trip_is_exact(ep):
    text = ep.model_dump_json()
    assert Episode.model_validate_json(text) == ep
    assert parse_episode(text) == ep
    assert parse_episode(json.loads(text)) == ep
    assert validate_episode(ep) == ep


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(episodes())
def test_topological_order_respects_every_dependency(ep):
    order = ep.topological_order()
    assert sorted(a.id for a in order) == sorted(a.id for a in ep.actions)
    pos = {a.id: i for i, a in enumerate(order)}
    for a in ep.actions:
        assert all(pos[d] < pos[a.id] for d in a.depends_on)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(episodes(), st.data())
def test_dependency_on_a_later_action_is_refused(ep, data):
    if len(ep.actions) < 2:
        return
    k = data.draw(st.integers(0, len(ep.actions) - 2))
    later = data.draw(st.integers(k + 1, len(ep.actions) - 1))
    raw = ep.model_dump(mode="json")
    raw["actions"][k]["depends_on"].append(raw["actions"][later]["id"])
    with pytest.raises(RecordError) as e:
        parse_episode(raw)
    # Either reported as a cycle (the later action already reaches k) or as a forward reference.
    if e.value.field == "actions.depends_on":
        assert e.value.reason.startswith("dependency cycle ")
    else:
        assert e.value.field == f"actions.{k}.depends_on"
        assert e.value.reason == f"depends on later action {raw['actions'][later]['id']!r} (recorded at {later})"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(episodes(), st.data())
def test_dependency_on_a_missing_action_is_refused(ep, data):
    if not ep.actions:
        return
    k = data.draw(st.integers(0, len(ep.actions) - 1))
    raw = ep.model_dump(mode="json")
    raw["actions"][k]["depends_on"].append("no-such-action")
    with pytest.raises(RecordError) as e:
        parse_episode(raw)
    assert e.value.field == f"actions.{k}.depends_on"
    assert e.value.reason == "unknown action id 'no-such-action'"
    assert e.value.record == f"episode {ep.id}"


def test_dependency_matrix_of_a_chain():
    ep = chain(3)
    assert ep.agents == ["agent0", "agent1"]
    assert ep.dependency_matrix(0) == (["agent0", "agent1"], [[0, 0], [0, 0]])
    assert ep.dependency_matrix(1) == (["agent0", "agent1"], [[0, 1], [0, 0]])
    assert ep.dependency_matrix(2) == (["agent0", "agent1"], [[0, 0], [1, 0]])


# -- bad input: one message naming record and field ----------------------------------------------


def _raw() -> dict:
    return chain(3).model_dump(mode="json")


def test_cycle_is_refused():
    raw = _raw()
    raw["actions"][0]["depends_on"] = ["a2"]
    with pytest.raises(RecordError) as e:
        parse_episode(raw, record="f.jsonl line 3")
    assert e.value.record == "f.jsonl line 3, episode ep"
    assert e.value.field == "actions.depends_on"
    assert e.value.reason == "dependency cycle a0 -> a2 -> a1 -> a0"


def test_self_dependency_is_refused():
    raw = _raw()
    raw["actions"][1]["depends_on"] = ["a1"]
    with pytest.raises(RecordError, match=r"actions\.1\.depends_on: an action cannot depend on itself"):
        parse_episode(raw)


def test_token_ids_and_logprobs_of_different_lengths_are_refused():
    raw = _raw()
    raw["actions"][2]["output"] = {"text": "x", "token_ids": [1, 2, 3], "logprobs": [-0.1, -0.2]}
    with pytest.raises(RecordError) as e:
        parse_episode(raw)
    assert e.value.field == "actions.2.output.logprobs"
    assert e.value.reason == "2 log-probs for 3 token ids"


def test_wrong_types_are_refused_with_the_field():
    raw = _raw()
    raw["actions"][1]["step"] = "three"
    with pytest.raises(RecordError) as e:
        parse_episode(raw)
    assert e.value.field == "actions.1.step"
    raw = _raw()
    raw["rewards"] = [{"value": "a lot"}]
    with pytest.raises(RecordError) as e:
        parse_episode(raw)
    assert e.value.field == "rewards.0.value"


def test_unknown_schema_version_is_refused():
    raw = _raw()
    raw["schema_version"] = 99
    with pytest.raises(RecordError) as e:
        parse_episode(raw)
    assert e.value.field == "schema_version"
    assert "unknown schema version 99" in e.value.reason


def test_oversized_field_is_refused():
    raw = _raw()
    raw["actions"][0]["output"] = {"text": "x" * (MAX_TEXT_CHARS + 1)}
    with pytest.raises(RecordError) as e:
        parse_episode(raw)
    assert e.value.field == "actions.0.output.text"


def nested(depth: int) -> dict:
    """``{"k": {"k": ... {}}}``: ``depth`` levels, built without recursion."""
    root = cur = {}
    for _ in range(depth - 1):
        cur["k"] = {}
        cur = cur["k"]
    return root


@pytest.mark.parametrize("path, field", [
    (("task",), "task"), (("metadata", "x"), "metadata"),
    (("actions", 0, "metadata", "x"), "actions.0.metadata"),
    (("actions", 0, "output", "tool_calls"), "actions.0.output.tool_calls"),
    (("actions", 0, "observation", "tools"), "actions.0.observation.tools"),
    (("actions", 0, "observation", "tool_choice"), "actions.0.observation.tool_choice"),
    (("rewards", 0, "metadata", "x"), "rewards.0.metadata"),
])
@pytest.mark.parametrize("depth", [65, 300, 3000])
def test_free_form_json_past_the_depth_limit_is_refused_with_its_field(path, field, depth):
    raw = {**_raw(), "rewards": [{"value": 1.0}]}
    deep = nested(depth)
    if field.endswith(("tool_calls", "tools")):
        deep = [{"type": "function", "function": {"name": "f", "arguments": deep}}]
    elif field.endswith("tool_choice"):
        deep = {"type": "function", "function": deep}
    target = raw
    for key in path[:-1]:
        target = target.setdefault(key, {}) if isinstance(key, str) else target[key]
    target[path[-1]] = deep
    with pytest.raises(RecordError) as e:
        parse_episode(raw, record="f line 1")
    assert (e.value.record, e.value.field) == ("f line 1, episode ep", field)
    assert e.value.reason == "JSON nested more than 64 levels deep, over the limit (max_depth)"
    with pytest.raises(ValueError, match="max_depth"):  # built directly, the record model refuses it too
        Episode.model_validate(raw)


def test_message_tool_calls_and_sizes_past_the_limits_are_refused():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": nested(100)}}
    raw = _raw()
    raw["actions"][0]["observation"] = {"messages": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "tool_calls": [call]}]}
    with pytest.raises(RecordError) as e:
        parse_episode(raw)
    assert e.value.field == "actions.0.observation.messages.1.tool_calls"
    at_limit = {**_raw(), "task": nested(64), "metadata": {"blob": "x" * 1_999_000}}
    assert parse_episode(at_limit).task == nested(64)
    with pytest.raises(RecordError, match="task: .* over the 2,000,000-byte limit .max_field_bytes."):
        parse_episode({**_raw(), "task": ["x" * 1_000_000, "y" * 1_000_000]})
    with pytest.raises(RecordError, match="over the 4,096-byte limit of one record .max_record_bytes."):
        from marft_bridge.limits import RecordLimits

        parse_episode(json.dumps({**_raw(), "task": "x" * 5000}), limits=RecordLimits(max_record_bytes=4096))


def test_json_too_deep_for_the_parser_is_a_record_error_not_a_crash():
    text = '{"id": "e", "task": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(RecordError, match="^f line 9: JSON nested too deep to read"):
        parse_episode(text, record="f line 9")


def test_tool_arguments_too_deep_to_decode_are_rendered_as_recorded():
    from marft_bridge.chat_template import template_tool_call

    args = "[" * 100_000 + "]" * 100_000
    call = template_tool_call({"id": "c", "type": "function", "function": {"name": "f", "arguments": args}})
    assert call["function"]["arguments"] == args


def test_malformed_json_and_non_objects_are_refused():
    with pytest.raises(RecordError, match=r"^f line 2: malformed JSON"):
        parse_episode('{"id": "x", "actions": [', record="f line 2")
    with pytest.raises(RecordError, match="must be a JSON object, not list"):
        parse_episode("[1, 2]")


def test_non_finite_values_are_refused():
    raw = _raw()
    raw["actions"][0]["output"] = {"token_ids": [1], "logprobs": [float("nan")]}
    with pytest.raises(RecordError, match=r"actions\.0\.output\.logprobs"):
        parse_episode(raw)
    with pytest.raises(RecordError, match="rewards must be finite"):
        parse_episode({**_raw(), "rewards": [{"value": float("inf")}]})


def test_each_bad_log_prob_is_named():
    def parse(logprobs):
        raw = _raw()
        raw["actions"][0]["output"] = {"token_ids": list(range(len(logprobs))), "logprobs": logprobs}
        return parse_episode(raw)

    # Their sum overflows to -inf, yet every one is a finite log-prob.
    assert parse([-1e308, -1e308, 0.0]).actions[0].output.logprobs == [-1e308, -1e308, 0.0]
    for logprobs, reason in (
        ([-0.5, float("-inf")], "log-prob 1 is -inf; log-probs must be finite"),
        ([float("nan"), -0.1], "log-prob 0 is nan; log-probs must be finite"),
        ([-0.1, float("inf")], "log-prob 1 is inf; log-probs must be finite"),
        ([-0.1, 0.5, float("nan")], "log-prob 1 is 0.5 > 0; a log-probability is at most 0"),
    ):
        with pytest.raises(RecordError) as e:
            parse(logprobs)
        assert (e.value.field, e.value.reason) == ("actions.0.output.logprobs", "Value error, " + reason)


def test_reward_for_unknown_agent_or_action_is_refused():
    with pytest.raises(RecordError, match=r"rewards\.0\.agent: unknown agent 'ghost'"):
        parse_episode({**_raw(), "rewards": [{"value": 1.0, "agent": "ghost"}]})
    with pytest.raises(RecordError, match=r"rewards\.0\.action_id: unknown action id 'zz'"):
        parse_episode({**_raw(), "rewards": [{"value": 1.0, "action_id": "zz"}]})


def test_unknown_fields_are_refused_not_dropped():
    with pytest.raises(RecordError, match="rewrds"):
        parse_episode({**_raw(), "rewrds": []})


def test_a_name_with_a_final_newline_is_not_an_adapter_name():
    from marft_bridge.schema import ADAPTER_NAME, adapter_name

    assert ADAPTER_NAME.match("planner") and not ADAPTER_NAME.match("planner\n")
    assert adapter_name(Action(agent="coder", policy=Policy(name="planner\n"))) == "coder"
