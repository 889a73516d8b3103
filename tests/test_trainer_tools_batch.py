"""Tool-calling episodes -> samples, token-exact under a Hermes-style chat template (the tiny model's):
tool calls in the action tokens, tools / earlier calls / results in the observation, an unstable
template prefix counted instead of trained on, and path-named agents training the adapters that served them."""

from __future__ import annotations

import json

import pytest

from marft_bridge.schema import Action, Episode, Message, Observation, Output, Policy, Reward
from marft_bridge.demo.tinymodel import build_tokenizer
from marft_bridge.trainers.batch import build_batch

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                        "b": {"type": "integer"}}}}}
TRANSFER = {"type": "function", "function": {"name": "transfer_to_math_expert", "description": "Hand off.",
                                             "parameters": {"type": "object", "properties": {}}}}
TOOLS_BLOCK = (
    "<|im_start|>system\nYou add.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + json.dumps(ADD)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def react_episode() -> Episode:
    """A ReAct agent: a tool-calling model call, the tool step, the model call that reads the result."""
    sys_user = [Message(role="system", content="You add."), Message(role="user", content="2+3?")]
    call = Action(id="m1", agent="agent", step=0, observation=Observation(messages=sys_user, tools=[ADD]),
                  output=Output(text="", tool_calls=[CALL], finish_reason="tool_calls"))
    tool = Action(id="t1", agent="agent", step=1, kind="tool", depends_on=["m1"],
                  output=Output(text="5"), metadata={"tool_call_id": "call_1", "name": "add"})
    seen = sys_user + [Message(role="assistant", content=None, tool_calls=[CALL]),
                       Message(role="tool", content="5", tool_call_id="call_1", name="add")]
    answer = Action(id="m2", agent="agent", step=2, depends_on=["t1"], observation=Observation(messages=seen, tools=[ADD]),
                    output=Output(text="The sum is 5.", finish_reason="stop"))
    return Episode(id="react", actions=[call, tool, answer], rewards=[Reward(value=1.0)])


def test_every_model_call_of_a_tool_calling_agent_is_a_sample_token_exact(tok):
    b = build_batch([react_episode()], tok, {"agent"}, len(tok), 4096, 1.0)
    assert [s.action_id for s in b.samples] == ["m1", "m2"] and not b.skipped
    first, second = b.samples
    prompt = TOOLS_BLOCK + "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert first.obs_ids == ids(tok, prompt)
    # The tool call is the action, up to the turn's EOS (the model stopped to call the tool).
    assert first.act_ids == ids(tok, '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>')
    assert first.act_ids[-1] == tok.eos_token_id
    # The answer sees the tools, its earlier call and the tool's result.
    assert second.obs_ids == ids(tok, prompt + '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
                                 "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>"
                                 "<|im_end|>\n<|im_start|>assistant\n")
    assert second.act_ids == ids(tok, "The sum is 5.<|im_end|>")
    # The sampled sequence the server would have produced is exactly obs + act: no shift anywhere.
    assert first.obs_ids + first.act_ids == second.obs_ids[:len(first.obs_ids) + len(first.act_ids)]
    assert second.parents == [0] and first.parents == []  # D through the tool step
    assert b.flagged == {"retokenized": 2, "no_behaviour_logprobs": 2}


def test_an_unfinished_turn_has_no_eos_and_text_with_calls_keeps_both(tok):
    ep = react_episode()
    ep.actions[2].output = Output(text="The sum is", finish_reason="length")
    ep.actions[0].output = Output(text="Let me add.", tool_calls=[CALL])  # no finish reason recorded
    b = build_batch([ep], tok, {"agent"}, len(tok), 4096, 1.0)
    assert b.samples[0].act_ids == ids(tok, 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
                                       "</tool_call><|im_end|>")
    assert b.samples[1].act_ids == ids(tok, "The sum is")


def test_recorded_ids_are_preferred_and_the_ids_of_calls_reach_the_template(tok):
    # A template that renders call ids and tool_call_id / name shows they are passed to it.
    t = build_tokenizer()
    t.chat_template = (
        "{% if tools %}tools={{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n{% endif %}"
        "{% for m in messages %}[{{ m['role'] }}"
        "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %} {{ c['id'] }}:{{ c['function']['name'] }}"
        "({{ c['function']['arguments']['a'] }}){% endfor %}{% endif %}"
        "{% if m['tool_call_id'] %} {{ m['tool_call_id'] }}/{{ m['name'] }}{% endif %}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    ep = react_episode()
    ep.actions[0].output = Output(tool_calls=[CALL], token_ids=[7, 8, 9], logprobs=[-0.1, -0.2, -0.3])
    b = build_batch([ep], t, {"agent"}, len(t), 4096, 1.0)
    first, second = b.samples
    assert first.act_ids == [7, 8, 9] and first.beh_logp == [-0.1, -0.2, -0.3]
    assert second.obs_ids == ids(t, "tools=add\n[system] You add.\n[user] 2+3?\n[assistant call_1:add(2)] \n"
                                    "[tool call_1/add] 5\n[assistant]")
    assert second.act_ids == ids(t, " The sum is 5.\n")  # no EOS in this template: the whole turn


def test_a_template_that_rewrites_earlier_turns_is_counted_not_trained(tok):
    # Like templates that strip reasoning from history: the last assistant turn renders differently
    # from the generation prompt, so obs is not a prefix of obs + action.
    t = build_tokenizer()
    t.chat_template = (
        "{% for m in messages %}{% if loop.last and m['role'] == 'assistant' %}<|im_start|>assistant:\n"
        "{% else %}<|im_start|>{{ m['role'] }}\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    ep = react_episode()
    ep.actions[2].output = Output(text="5", token_ids=ids(t, "5<|im_end|>"))  # sampled ids: no template needed
    b = build_batch([ep], t, {"agent"}, len(t), 4096, 1.0)
    assert [s.action_id for s in b.samples] == ["m2"]
    assert b.skipped == {"template_prefix_unstable": 1}
    assert b.samples[0].reward == 1.0 and b.samples[0].parents == []


def supervisor_episode() -> Episode:
    """langgraph-supervisor's shape: subgraph-path agents; each call names the model (adapter) it used
    and, as our server reports it, that adapter's version."""
    q = [Message(role="user", content="2+3?")]
    route = Action(id="s1", agent="supervisor/agent", step=0, policy=Policy(name="supervisor", version=3),
                   observation=Observation(messages=q, tools=[TRANSFER]),
                   output=Output(tool_calls=[{"id": "call_h", "type": "function",
                                              "function": {"name": "transfer_to_math_expert", "arguments": "{}"}}],
                                 finish_reason="tool_calls"))
    handoff = Action(id="h1", agent="supervisor/tools", step=1, kind="tool", depends_on=["s1"],
                     output=Output(text="Successfully transferred to math_expert"))
    seen = q + [Message(role="assistant", tool_calls=route.output.tool_calls),
                Message(role="tool", content="Successfully transferred to math_expert", tool_call_id="call_h",
                        name="transfer_to_math_expert")]
    work = Action(id="w1", agent="math_expert/agent", step=2, depends_on=["h1"], policy=Policy(name="math_expert", version=1),
                  observation=Observation(messages=seen, tools=[ADD]),
                  output=Output(tool_calls=[CALL], finish_reason="tool_calls"))
    add = Action(id="t1", agent="math_expert/tools", step=3, kind="tool", depends_on=["w1"], output=Output(text="5"))
    done = Action(id="w2", agent="math_expert/agent", step=4, depends_on=["t1"], policy=Policy(name="math_expert", version=1),
                  observation=Observation(messages=seen + [Message(role="assistant", tool_calls=[CALL]),
                                                           Message(role="tool", content="5", tool_call_id="call_1")],
                                          tools=[ADD]),
                  output=Output(text="5", finish_reason="stop"))
    # A worker whose call named the base model (no adapter): trained as its agent path's safe form.
    check = Action(id="r1", agent="checker/agent", step=5, depends_on=["w2"], policy=Policy(name="Qwen/Qwen2.5-0.5B"),
                   observation=Observation(messages=[Message(role="user", content="5?")]),
                   output=Output(text="ok", finish_reason="stop"))
    final = Action(id="s2", agent="supervisor/agent", step=6, depends_on=["r1"], policy=Policy(name="supervisor", version=3),
                   observation=Observation(messages=[Message(role="user", content="done?")]),
                   output=Output(text="5", finish_reason="stop"))
    return Episode(id="sup", actions=[route, handoff, work, add, done, check, final],
                   rewards=[Reward(value=1.0), Reward(value=0.5, agent="math_expert/agent")])


def test_a_supervisor_episode_trains_the_adapters_its_calls_used(tok):
    b = build_batch([supervisor_episode()], tok, {"supervisor", "math_expert", "checker.agent"}, len(tok), 4096, 1.0)
    assert [(s.action_id, s.agent) for s in b.samples] == [
        ("s1", "supervisor"), ("w1", "math_expert"), ("w2", "math_expert"), ("r1", "checker.agent"), ("s2", "supervisor")]
    assert not b.skipped  # every model call, routing and handoff decisions included, is a sample
    # The routing decision's tokens are the handoff tool call.
    assert b.samples[0].act_ids == ids(tok, '<tool_call>\n{"name": "transfer_to_math_expert", "arguments": {}}\n'
                                       "</tool_call><|im_end|>")
    # D through the handoff and tool steps: the worker depends on the supervisor's call.
    assert [s.parents for s in b.samples] == [[], [0], [1], [2], [3]]
    # The agent reward of math_expert/agent lands on its last call; the team reward on the last sample.
    assert [s.reward for s in b.samples] == [0.0, 0.0, 0.5, 0.0, 1.0]


def test_trainers_named_by_agent_path_or_node_still_match(tok):
    # A trainer whose agents are the recorded names (the demo's node names) keeps training them.
    b = build_batch([supervisor_episode()], tok, {"supervisor/agent", "checker.agent"}, len(tok), 4096, 1.0)
    assert b.skipped == {"agent_without_adapter": 2, "reward_for_untrained_agent": 1}
    assert [(s.action_id, s.agent) for s in b.samples] == [
        ("s1", "supervisor/agent"), ("r1", "checker.agent"), ("s2", "supervisor/agent")]


def test_a_captured_langgraph_supervisor_trains_the_adapters_its_models_name(sqlite_store, tok):
    """A real langgraph-supervisor app whose chat models send model="supervisor" / "math_expert": every
    model call is a sample of that adapter, the routing call's tokens are its handoff tool call, and the
    worker's observation holds its bound tools and the handoff's tool result."""
    pytest.importorskip("langgraph_supervisor")
    import tool_apps as ta

    import marft_bridge as mb

    app = ta.supervisor_app(supervisor_model="supervisor", expert_model="math_expert")
    app = mb.instrument(app, store=sqlite_store, reward_fn=lambda i, o: 1.0)
    app.invoke(ta.ask())
    sqlite_store.flush()
    (ep,) = sqlite_store.episodes()
    llm = [a for a in ep.actions if a.kind == "llm"]
    b = build_batch([ep], tok, {"supervisor", "math_expert"}, len(tok), 16384, 1.0)
    assert [(s.action_id, s.agent) for s in b.samples] == [(a.id, a.agent.split("/")[0]) for a in llm]
    assert [s.agent for s in b.samples] == ["supervisor", "math_expert", "math_expert", "supervisor"]
    assert not b.skipped
    route, work = b.samples[0], b.samples[1]
    assert route.act_ids == ids(tok, '<tool_call>\n{"name": "transfer_to_math_expert", "arguments": {}}\n'
                                     "</tool_call><|im_end|>")
    assert work.act_ids == ids(tok, '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>')
    seen = tok.decode(work.obs_ids)
    add_tool = next(t for t in llm[1].observation.tools if t["function"]["name"] == "add")
    assert "<tools>\n" + json.dumps(add_tool) + "\n</tools>" in seen
    assert '<tool_call>\n{"name": "transfer_to_math_expert", "arguments": {}}\n</tool_call>' in seen
    assert "<tool_response>\nSuccessfully transferred to math_expert\n</tool_response>" in seen
    assert seen.endswith("<|im_start|>assistant\n")
    assert b.samples[1].parents == [0]  # through the handoff's tool step
