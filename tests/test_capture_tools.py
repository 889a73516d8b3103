"""Tool steps and handoffs in real LangGraph tool-calling apps (fake models that emit real tool calls)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
import tool_apps as ta
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode

import marft_bridge as mb
from marft_bridge.capture import recording


def stored(store, app):
    store.flush()
    return store.get_episode(app.last_episode_id)


def labels(ep) -> dict[str, str]:
    """``agent:kind[:tool]#n`` (n counts repeats in recording order): stable under parallel tool steps."""
    seen: Counter = Counter()
    out = {}
    for a in ep.actions:
        base = f"{a.agent}:{a.kind}" + (f":{a.metadata['tool.name']}" if a.kind == "tool" else "")
        out[a.id] = f"{base}#{seen[base]}"
        seen[base] += 1
    return out


def graph(ep) -> dict[str, tuple[int, list[str]]]:
    names = labels(ep)
    return {names[a.id]: (a.step, sorted(names[d] for d in a.depends_on)) for a in ep.actions}


def tool_steps(ep) -> dict[str, tuple]:
    return {a.metadata["tool.name"]: (a.agent, a.metadata["tool.arguments"], a.output.text, a.error,
                                      a.metadata["tool_call_id"])
            for a in ep.actions if a.kind == "tool"}


def run(app, asynchronous: bool):
    return asyncio.run(app.ainvoke(ta.ask())) if asynchronous else app.invoke(ta.ask())


REACT = {
    "agent:llm#0": (1, []),
    "agent:tool:add#0": (2, ["agent:llm#0"]),
    "agent:tool:multiply#0": (2, ["agent:llm#0"]),
    "agent:llm#1": (3, ["agent:llm#0", "agent:tool:add#0", "agent:tool:multiply#0"]),
}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_react_agent_parallel_tool_calls_are_tool_steps(sqlite_store, asynchronous):
    plain = run(ta.react_app(), asynchronous)
    recording.reset_capture_stats()
    app = mb.instrument(ta.react_app(), store=sqlite_store)
    out = run(app, asynchronous)
    assert [m.content for m in out["messages"]] == [m.content for m in plain["messages"]]
    ep = stored(sqlite_store, app)
    assert graph(ep) == REACT
    first = next(a for a in ep.actions if a.kind == "llm")
    ids = [c["id"] for c in first.output.tool_calls]
    assert tool_steps(ep) == {"add": ("agent", {"a": 2, "b": 3}, "5", None, ids[0]),
                              "multiply": ("agent", {"a": 4, "b": 5}, "20", None, ids[1])}
    assert [t["function"]["name"] for t in first.observation.tools] == ["add", "multiply"]
    assert first.observation.tools[0]["function"]["parameters"]["properties"] == {
        "a": {"type": "integer"}, "b": {"type": "integer"}}
    add = next(a for a in ep.actions if a.kind == "tool" and a.metadata["tool.name"] == "add")
    call = add.observation.messages[0].tool_calls[0]
    assert (call["id"], call["function"]["name"], json.loads(call["function"]["arguments"])) == (ids[0], "add",
                                                                                               {"a": 2, "b": 3})
    assert add.metadata["latency_s"] >= 0 and not add.error
    # The next model call saw the calls and their answers, ids and names kept.
    last = [a for a in ep.actions if a.kind == "llm"][-1]
    msgs = last.observation.messages
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in msgs[1].tool_calls] == ids
    assert [(m.tool_call_id, m.name, m.content) for m in msgs[2:]] == [(ids[0], "add", "5"), (ids[1], "multiply", "20")]
    assert recording.capture_stats()["errors"] == 0


def test_create_agent_tool_node_is_captured_the_same_way(sqlite_store):
    app = mb.instrument(ta.create_agent_app(), store=sqlite_store)
    app.invoke(ta.ask())
    ep = stored(sqlite_store, app)
    assert graph(ep) == {k.replace("agent:", "model:"): (s, [d.replace("agent:", "model:") for d in deps])
                         for k, (s, deps) in REACT.items()}
    assert {k: v[2] for k, v in tool_steps(ep).items()} == {"add": "5", "multiply": "20"}


SUPERVISOR = {
    "supervisor/agent:llm#0": (1, []),
    "supervisor/agent:tool:transfer_to_math_expert#0": (1, ["supervisor/agent:llm#0"]),
    # The expert's first model call depends on the handoff: its ToolMessage is in its input.
    "math_expert/agent:llm#0": (2, ["supervisor/agent:llm#0", "supervisor/agent:tool:transfer_to_math_expert#0"]),
    "math_expert/agent:tool:add#0": (2, ["math_expert/agent:llm#0"]),
    "math_expert/agent:llm#1": (2, ["math_expert/agent:llm#0", "math_expert/agent:tool:add#0",
                                    "supervisor/agent:llm#0", "supervisor/agent:tool:transfer_to_math_expert#0"]),
    "supervisor/agent:llm#1": (3, ["math_expert/agent:llm#0", "math_expert/agent:llm#1", "math_expert/agent:tool:add#0",
                                   "supervisor/agent:llm#0", "supervisor/agent:tool:transfer_to_math_expert#0"]),
}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_supervisor_handoff_is_a_tool_step_the_worker_depends_on(sqlite_store, asynchronous):
    plain = run(ta.supervisor_app(), asynchronous)
    recording.reset_capture_stats()
    app = mb.instrument(ta.supervisor_app(), store=sqlite_store)
    out = run(app, asynchronous)
    assert [m.content for m in out["messages"]] == [m.content for m in plain["messages"]]
    ep = stored(sqlite_store, app)
    assert graph(ep) == SUPERVISOR
    handoff = next(a for a in ep.actions if a.kind == "tool" and a.metadata["tool.name"] == "transfer_to_math_expert")
    assert handoff.output.text == "Successfully transferred to math_expert"
    assert (handoff.metadata["handoff.goto"], handoff.metadata["handoff.graph"]) == ("math_expert", "parent")
    assert tool_steps(ep)["add"][:3] == ("math_expert/agent", {"a": 2, "b": 3}, "5")
    assert recording.capture_stats()["errors"] == 0


@pytest.mark.parametrize("asynchronous", [False, True])
def test_swarm_handoff_is_a_tool_step_the_next_agent_depends_on(sqlite_store, asynchronous):
    app = mb.instrument(ta.swarm_app(), store=sqlite_store)
    out = run(app, asynchronous)
    assert out["messages"][-1].content == "the sum is 5" and out["active_agent"] == "bob"
    ep = stored(sqlite_store, app)
    assert graph(ep) == {
        "alice/agent:llm#0": (1, []),
        "alice/agent:tool:transfer_to_bob#0": (1, ["alice/agent:llm#0"]),
        "bob/agent:llm#0": (2, ["alice/agent:llm#0", "alice/agent:tool:transfer_to_bob#0"]),
        "bob/agent:tool:add#0": (2, ["bob/agent:llm#0"]),
        "bob/agent:llm#1": (2, ["alice/agent:llm#0", "alice/agent:tool:transfer_to_bob#0", "bob/agent:llm#0",
                                "bob/agent:tool:add#0"]),
    }
    handoff = tool_steps(ep)["transfer_to_bob"]
    assert handoff[2] == "Successfully transferred to bob"


def test_hand_built_graph_tool_node_command_router_and_tool_invoke(sqlite_store):
    plain = ta.handbuilt_app().invoke(ta.ask())
    recording.reset_capture_stats()
    app = mb.instrument(ta.handbuilt_app(), store=sqlite_store)
    out = app.invoke(ta.ask())
    assert [m.content for m in out["messages"]] == [m.content for m in plain["messages"]]
    assert out["looked_up"] == plain["looked_up"]
    ep = stored(sqlite_store, app)
    assert graph(ep) == {
        "planner:llm#0": (1, []),
        "router:env#0": (2, ["planner:llm#0"]),  # calls neither a model nor a tool; routes with Command(goto=)
        # the ToolNode reads the whole message list; each tool step depends on the call that asked for it
        "planner:tool:lookup#0": (3, ["planner:llm#0"]),
        "planner:tool:broken#0": (3, ["planner:llm#0"]),
        "planner:llm#1": (4, ["planner:llm#0", "planner:tool:broken#0", "planner:tool:lookup#0"]),
        "router:env#1": (5, ["planner:llm#0", "planner:llm#1", "planner:tool:broken#0", "planner:tool:lookup#0"]),
        # tool.invoke by hand in a node: the node's own tool step
        "by_hand:tool:lookup#0": (6, ["planner:llm#0", "planner:llm#1", "planner:tool:broken#0",
                                      "planner:tool:lookup#0", "router:env#1"]),
    }
    steps = {(a.agent, a.metadata["tool.name"]): a for a in ep.actions if a.kind == "tool"}
    looked = steps[("planner", "lookup")]
    assert json.loads(looked.output.text) == {"key": "abc", "value": 3}  # a dict result, as JSON
    failed = steps[("planner", "broken")]
    assert failed.error == "ValueError: broken tool got 1" and failed.output.text == ""
    by_hand = steps[("by_hand", "lookup")]
    assert by_hand.metadata["tool_call_id"] is None and json.loads(by_hand.output.text) == {"key": "xy", "value": 2}
    assert by_hand.observation.messages[0].tool_calls[0]["function"]["arguments"] == '{"key": "xy"}'
    assert recording.capture_stats()["errors"] == 0


def _raising_app():
    model = ta.ToolCallingModel(policy=lambda msgs: AIMessage("", tool_calls=[ta.call("broken", {"x": 7}, msgs)]))

    def plan(s):
        return {"messages": [model.bind_tools([ta.broken]).invoke(s["messages"])]}

    g = StateGraph(ta.Chat)
    g.add_node("planner", plan)
    g.add_node("tools", ToolNode([ta.broken], handle_tool_errors=False))
    g.add_edge(START, "planner")
    g.add_edge("planner", "tools")
    g.add_edge("tools", END)
    return g.compile()


def test_a_tool_that_raises_reaches_the_app_unchanged_and_is_a_failed_tool_step(sqlite_store):
    with pytest.raises(ValueError) as plain:
        _raising_app().invoke({"messages": [HumanMessage("x")]})
    app = mb.instrument(_raising_app(), store=sqlite_store)
    with pytest.raises(ValueError) as captured:
        app.invoke({"messages": [HumanMessage("x")]})
    assert str(captured.value) == str(plain.value) == "broken tool got 7"
    ep = stored(sqlite_store, app)
    assert ep.status == "failed"
    assert graph(ep) == {"planner:llm#0": (1, []), "planner:tool:broken#0": (2, ["planner:llm#0"])}
    assert ep.actions[1].error == "ValueError: broken tool got 7"


def test_tool_steps_are_not_trained_but_every_model_call_is(sqlite_store):
    """Each captured supervisor/swarm episode through ``build_batch`` with a Hermes-style template
    keeps every model call as a sample (tool calls included)."""
    pytest.importorskip("tokenizers")  # not in CI's small lowest-LangGraph environment
    from marft_bridge.demo.tinymodel import build_tokenizer
    from marft_bridge.trainers.batch import build_batch

    tok = build_tokenizer()
    for make in (ta.supervisor_app, ta.swarm_app, ta.react_app):
        app = mb.instrument(make(), store=sqlite_store, reward_fn=lambda i, o: 1.0)
        app.invoke(ta.ask())
        ep = stored(sqlite_store, app)
        llm = [a for a in ep.actions if a.kind == "llm"]
        batch = build_batch([ep], tok, {a.agent for a in llm}, len(tok), max_context=16384, default_temperature=1.0)
        assert len(batch.samples) == len(llm), (make.__name__, dict(batch.skipped))
        assert not batch.skipped


def _parent_command_from_a_node_app(fake_model):
    from typing import TypedDict

    from langgraph.types import Command

    class S(TypedDict, total=False):
        q: str
        draft: str
        final: str

    writer, finisher = fake_model("a draft"), fake_model("the final text")

    def write(s):
        return {"draft": writer.invoke([HumanMessage(s["q"])]).content}

    def hand_off(s):  # a node (no model, no tool) that hands control to the parent graph
        return Command(graph=Command.PARENT, goto="finisher", update={"draft": s["draft"] + "!"})

    sub = StateGraph(S)
    sub.add_node("writer", write)
    sub.add_node("hand_off", hand_off)
    sub.add_edge(START, "writer")
    sub.add_edge("writer", "hand_off")
    g = StateGraph(S)
    g.add_node("team", sub.compile(), destinations=("finisher",))
    g.add_node("finisher", lambda s: {"final": finisher.invoke([HumanMessage(s["draft"])]).content})
    g.add_edge(START, "team")
    g.add_edge("finisher", END)
    return g.compile()


def test_a_nodes_parent_command_carries_what_it_read_to_the_parent(sqlite_store):
    from test_capture_langgraph import fake

    app = mb.instrument(_parent_command_from_a_node_app(fake), store=sqlite_store)
    assert app.invoke({"q": "go"})["final"] == "the final text"
    ep = stored(sqlite_store, app)
    assert graph(ep) == {"team/writer:llm#0": (1, []), "finisher:llm#0": (2, ["team/writer:llm#0"])}
