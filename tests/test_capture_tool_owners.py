"""Who a LangGraph task depends on when the data does not come from where the graph suggests:
a tool interrupted by ``interrupt()`` and resumed in a later run of the episode, a ``Send`` into a
compiled subgraph whose input schema keeps only part of the sent state, and a hand-built
``ToolNode`` reading the whole message list. Exact agents, kinds, steps and ``depends_on``."""

from __future__ import annotations

from typing import Annotated, TypedDict

import pytest
import tool_apps as ta
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command, Send, interrupt
from test_capture_langgraph import fake
from test_capture_tools import graph, stored

import marft_bridge as mb
from marft_bridge.capture import recording


@pytest.fixture(autouse=True)
def no_capture_errors():
    recording.reset_capture_stats()
    yield
    assert recording.capture_stats()["errors"] == 0, recording.capture_stats()


# -- interrupt() inside a tool, resumed with Command(resume=...) ------------------------------------


@tool
def approve(amount: int) -> str:
    """Ask a human to approve a payment."""
    return f"approved {amount}: {interrupt({'amount': amount})}"


def _payer(messages):
    if not ta.tool_results(messages):
        return AIMessage("", tool_calls=[ta.call("approve", {"amount": 5}, messages)])
    return AIMessage("paid")


@pytest.mark.parametrize("maker", ["react", "create_agent"])
def test_a_tool_resumed_after_an_interrupt_stays_the_asking_agents(sqlite_store, maker):
    model = ta.ToolCallingModel(policy=_payer)
    if maker == "react":
        app, agent = ta.create_react_agent(model, [approve], checkpointer=InMemorySaver()), "agent"
    else:
        from langchain.agents import create_agent

        app, agent = create_agent(model, [approve], checkpointer=InMemorySaver()), "model"
    app = mb.instrument(app, store=sqlite_store)
    cfg = {"configurable": {"thread_id": "t"}}
    with mb.episode(store=sqlite_store) as ep:
        first = app.invoke(ta.ask(), cfg)
        assert "__interrupt__" in first
        out = app.invoke(Command(resume="yes"), cfg)
    assert out["messages"][-1].content == "paid"
    sqlite_store.flush()
    e = sqlite_store.get_episode(ep.id)
    g = graph(e)
    assert [k for k in g] == [f"{agent}:llm#0", f"{agent}:tool:approve#0", f"{agent}:llm#1"]
    assert g[f"{agent}:tool:approve#0"][1] == [f"{agent}:llm#0"]
    assert g[f"{agent}:llm#1"][1] == [f"{agent}:llm#0", f"{agent}:tool:approve#0"]
    step = next(a for a in e.actions if a.kind == "tool")
    assert (step.output.text, step.metadata["tool_call_id"]) == ("approved 5: yes", e.actions[0].output.tool_calls[0]["id"])


@pytest.mark.skipif(tuple(int(x) for x in __import__("importlib.metadata").metadata.version("langchain-core").split(".")[:2])
                    < (1, 1), reason="LangChain before 1.1 does not pass tool_call_id to on_tool_start")
def test_tools_resumed_in_an_episode_of_their_own_do_not_depend_on_each_other(sqlite_store):
    """One reply asks ``approve`` (which interrupts) and ``add``; resumed with the default of one
    episode per invoke, the asking call is in the first episode: the second's two tool steps depend
    on nothing of it and not on each other (``add`` ran after ``approve`` ended: timing, not data)."""
    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    def pay_and_add(messages):
        if not ta.tool_results(messages):
            return AIMessage("", tool_calls=[ta.call("approve", {"amount": 5}, messages, 0),
                                             ta.call("add", {"a": 2, "b": 3}, messages, 1)])
        return AIMessage("done")

    model = ta.ToolCallingModel(policy=pay_and_add).bind_tools([approve, add])
    g = StateGraph(ta.Chat)
    g.add_node("agent", lambda s: {"messages": [model.invoke(s["messages"])]})
    g.add_node("tools", ToolNode([approve, add]))  # one task runs both calls
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    app = mb.instrument(g.compile(checkpointer=InMemorySaver()), store=sqlite_store)
    cfg = {"configurable": {"thread_id": "t"}}
    app.invoke(ta.ask(), cfg)
    app.invoke(Command(resume="yes"), cfg)
    g = graph(stored(sqlite_store, app))
    assert {k: v[1] for k, v in g.items()} == {
        "tools:tool:approve#0": [], "tools:tool:add#0": [],
        "agent:llm#0": ["tools:tool:add#0", "tools:tool:approve#0"]}


# -- Send into a compiled subgraph whose input schema keeps part of the state -----------------------


class EditorIn(TypedDict):
    section: str


class EditorState(TypedDict, total=False):
    section: str
    draft: str
    text: str


class EditorOut(TypedDict):
    text: str


class Doc(TypedDict, total=False):
    topic: str
    plan: str
    sections: list
    text: Annotated[list, lambda a, b: a + [b]]


class OneSection(Doc, total=False):
    section: str


def editor_subgraph():
    drafter, polisher = fake("a draft"), fake("polished")
    sub = StateGraph(EditorState, input_schema=EditorIn, output_schema=EditorOut)
    sub.add_node("draft", lambda s: {"draft": drafter.invoke(s["section"]).content})
    sub.add_node("polish", lambda s: {"text": polisher.invoke(s["draft"]).content})
    sub.add_edge(START, "draft")
    sub.add_edge("draft", "polish")
    sub.add_edge("polish", END)
    return sub.compile()


def doc_app(planner_writes_sections: bool):
    """planner -> one Send per section, carrying the whole state, into the ``editor`` subgraph."""
    planner = fake("plan: a, b")

    def plan(s: Doc):
        out = {"plan": planner.invoke(s["topic"]).content}
        if planner_writes_sections:
            out["sections"] = [p.strip() for p in out["plan"].removeprefix("plan:").split(",")]
        return out

    g = StateGraph(Doc)
    g.add_node("planner", plan)
    g.add_node("editor", editor_subgraph())
    g.add_edge(START, "planner")
    g.add_conditional_edges("planner", lambda s: [Send("editor", {**s, "section": x}) for x in s["sections"]],
                            ["editor"])
    g.add_edge("editor", END)
    return g.compile()


def fan_out_graph(ep) -> list[tuple[str, int, list[str]]]:
    """``graph`` with the parallel branches' repeat numbers left out (which branch records first is
    thread timing), after checking that each polish depends on a draft of its own."""
    g = graph(ep)
    drafts = [d for k, (_, deps) in g.items() if k.startswith("editor/polish") for d in deps if d.startswith("editor/draft")]
    assert sorted(drafts) == ["editor/draft:llm#0", "editor/draft:llm#1"]
    return sorted((k.split("#")[0], step, sorted(d.split("#")[0] for d in deps)) for k, (step, deps) in g.items())


def test_a_subgraph_after_send_depends_only_on_the_channels_its_input_schema_keeps(sqlite_store):
    """The sections come from the task input; the planner wrote only ``plan``, which the editor's
    input schema drops: the editor's tasks do not depend on the planner."""
    app = mb.instrument(doc_app(planner_writes_sections=False), store=sqlite_store)
    out = app.invoke({"topic": "t", "sections": ["a", "b"]})
    assert out["text"] == ["polished", "polished"]
    assert fan_out_graph(stored(sqlite_store, app)) == [
        ("editor/draft:llm", 2, []), ("editor/draft:llm", 2, []),
        ("editor/polish:llm", 2, ["editor/draft:llm"]), ("editor/polish:llm", 2, ["editor/draft:llm"]),
        ("planner:llm", 1, []),
    ]


def test_a_subgraph_after_send_depends_on_the_planner_that_wrote_what_it_keeps(sqlite_store):
    app = mb.instrument(doc_app(planner_writes_sections=True), store=sqlite_store)
    assert app.invoke({"topic": "t"})["text"] == ["polished", "polished"]
    assert fan_out_graph(stored(sqlite_store, app)) == [
        ("editor/draft:llm", 2, ["planner:llm"]), ("editor/draft:llm", 2, ["planner:llm"]),
        ("editor/polish:llm", 2, ["editor/draft:llm", "planner:llm"]),
        ("editor/polish:llm", 2, ["editor/draft:llm", "planner:llm"]),
        ("planner:llm", 1, []),
    ]


def test_a_subgraph_node_after_an_edge_depends_on_the_channels_its_input_schema_keeps(sqlite_store):
    """A plain edge planner -> editor (no Send): the editor is triggered by the planner but its
    input schema keeps ``section``, which came from the task input."""
    planner = fake("plan")
    g = StateGraph(OneSection)
    g.add_node("planner", lambda s: {"plan": planner.invoke(s["topic"]).content})
    g.add_node("editor", editor_subgraph())
    g.add_edge(START, "planner")
    g.add_edge("planner", "editor")
    g.add_edge("editor", END)
    app = mb.instrument(g.compile(), store=sqlite_store)
    app.invoke({"topic": "t", "section": "a"})
    assert graph(stored(sqlite_store, app)) == {
        "planner:llm#0": (1, []),
        "editor/draft:llm#0": (2, []),
        "editor/polish:llm#0": (2, ["editor/draft:llm#0"]),
    }


# -- a hand-built ToolNode reading state["messages"], shared by two agents ----------------------


def _researcher(messages):
    if not ta.tool_results(messages):
        return AIMessage("", tool_calls=[ta.call("lookup", {"key": "abc"}, messages)])
    return AIMessage("found it")


def _writer(messages):
    if len(ta.tool_results(messages)) < 2:
        return AIMessage("", tool_calls=[ta.call("add", {"a": 2, "b": 3}, messages)])
    return AIMessage("the answer is 5")


def shared_tool_node_app():
    researcher = ta.ToolCallingModel(policy=_researcher).bind_tools([ta.lookup])
    writer = ta.ToolCallingModel(policy=_writer).bind_tools([ta.add])

    def route_back(s):
        return "writer" if len(ta.tool_results(s["messages"])) > 1 else "researcher"

    g = StateGraph(ta.Chat)
    g.add_node("researcher", lambda s: {"messages": [researcher.invoke(s["messages"])]})
    g.add_node("writer", lambda s: {"messages": [writer.invoke(s["messages"])]})
    g.add_node("tools", ToolNode([ta.lookup, ta.add]))
    g.add_edge(START, "researcher")
    g.add_conditional_edges("researcher", tools_condition, {"tools": "tools", END: "writer"})
    g.add_conditional_edges("writer", tools_condition, {"tools": "tools", END: END})
    g.add_conditional_edges("tools", route_back, ["researcher", "writer"])
    return g.compile()


def test_a_hand_built_tool_node_step_depends_on_the_asking_call_only(sqlite_store):
    app = mb.instrument(shared_tool_node_app(), store=sqlite_store)
    out = app.invoke(ta.ask())
    assert out["messages"][-1].content == "the answer is 5"
    assert graph(stored(sqlite_store, app)) == {
        "researcher:llm#0": (1, []),
        "researcher:tool:lookup#0": (2, ["researcher:llm#0"]),
        "researcher:llm#1": (3, ["researcher:llm#0", "researcher:tool:lookup#0"]),
        "writer:llm#0": (4, ["researcher:llm#0", "researcher:llm#1", "researcher:tool:lookup#0"]),
        # the ToolNode was handed every message (the researcher's calls and results): the tool step
        # reads only the writer's call
        "writer:tool:add#0": (5, ["writer:llm#0"]),
        "writer:llm#1": (6, ["researcher:llm#0", "researcher:llm#1", "researcher:tool:lookup#0", "writer:llm#0",
                             "writer:tool:add#0"]),
    }


def test_a_tool_call_a_human_edited_records_what_ran_and_the_edit(sqlite_store):
    """``create_agent`` with ``HumanInTheLoopMiddleware``: one reply asks add, multiply and lookup;
    the human approves add, edits multiply to (6, 7) and rejects lookup. The multiply step records
    the arguments it ran with (the model's in ``tool.asked_arguments``) and depends on the review
    step the edit came through as well as the asking call; the approved add only on the call."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import HumanInTheLoopMiddleware
    from langchain_core.messages import HumanMessage

    def policy(messages):
        if not ta.tool_results(messages):
            return AIMessage("", tool_calls=[ta.call("add", {"a": 2, "b": 3}, messages, 0),
                                             ta.call("multiply", {"a": 4, "b": 5}, messages, 1),
                                             ta.call("lookup", {"key": "abc"}, messages, 2)])
        return AIMessage("got: " + " | ".join(str(m.content) for m in ta.tool_results(messages)))

    review = HumanInTheLoopMiddleware(interrupt_on={"add": True, "multiply": True, "lookup": True})
    app = mb.instrument(create_agent(ta.ToolCallingModel(policy=policy), [ta.add, ta.multiply, ta.lookup],
                                     middleware=[review], checkpointer=InMemorySaver()), store=sqlite_store)
    cfg = {"configurable": {"thread_id": "t1"}}
    with mb.episode(store=sqlite_store) as ep:
        app.invoke({"messages": [HumanMessage("compute")]}, cfg)
        app.invoke(Command(resume={"decisions": [
            {"type": "approve"}, {"type": "edit", "edited_action": {"name": "multiply", "args": {"a": 6, "b": 7}}},
            {"type": "reject", "message": "no lookups today"}]}), cfg)
    sqlite_store.flush()
    got = sqlite_store.get_episode(ep.id)
    steps = {a.metadata["tool.name"]: a for a in got.actions if a.kind == "tool"}
    assert sorted(steps) == ["add", "multiply"]  # the rejected call never ran
    mult, add = steps["multiply"], steps["add"]
    assert (mult.output.text, mult.metadata["tool.arguments"], mult.metadata["tool.asked_arguments"]) == (
        "42", {"a": 6, "b": 7}, {"a": 4, "b": 5})
    assert mult.observation.messages[0].tool_calls[0]["function"]["arguments"] == '{"a": 6, "b": 7}'
    assert "tool.asked_arguments" not in add.metadata and add.metadata["tool.arguments"] == {"a": 2, "b": 3}
    g = graph(got)
    ask, reviewed = "model:llm#0", "HumanInTheLoopMiddleware.after_model:env#0"
    assert g["model:tool:add#0"][1] == [ask]
    assert g["model:tool:multiply#0"][1] == sorted([ask, reviewed])
