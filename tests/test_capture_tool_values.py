"""What a tool node writes, value by value: a channel written from one tool's ``Command(update=...)``
carries that tool step only, the messages carry the steps whose ToolMessages they are, and a model
call made inside a tool is a source of that tool's step and of what it returned. A tool handed
graph state (``InjectedState``, ``ToolRuntime``) depends on what its node read."""

from __future__ import annotations

from typing import Annotated, TypedDict

import langgraph.prebuilt
import pytest
import tool_apps as ta
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import InjectedState, ToolNode, tools_condition
from langgraph.types import Command

from test_capture_tools import labels

import marft_bridge as mb

INNER = FakeListChatModel(responses=["whales sing"] * 20)


@tool
def save_name(name: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
    """Remember the user's name."""
    return Command(update={"user_name": name, "messages": [ToolMessage(f"saved {name}", tool_call_id=tool_call_id)]})


@tool
def weather(city: str) -> str:
    """Weather in a city."""
    return f"sunny in {city}"


@tool
def research(topic: str) -> str:
    """Research a topic (asks a model)."""
    return INNER.invoke(f"summarise {topic}").content


class St(TypedDict, total=False):
    messages: Annotated[list, add_messages]
    user_name: str
    greeting: str
    audit: str


class NameIn(TypedDict):
    user_name: str


class MessagesIn(TypedDict):
    messages: Annotated[list, add_messages]


def policy(messages):
    if not ta.tool_results(messages):
        return AIMessage("", tool_calls=[ta.call("save_name", {"name": "Ada"}, messages, 0),
                                         ta.call("weather", {"city": "Oslo"}, messages, 1),
                                         ta.call("research", {"topic": "whales"}, messages, 2)])
    return AIMessage("done")


def app():
    tools = [save_name, weather, research]
    model = ta.ToolCallingModel(policy=policy).bind_tools(tools)
    greeter, auditor = FakeListChatModel(responses=["Hello Ada!"] * 5), FakeListChatModel(responses=["ok"] * 5)
    g = StateGraph(St)
    g.add_node("assistant", lambda s: {"messages": [model.invoke(s["messages"])]})
    g.add_node("tools", ToolNode(tools))
    # reads only the name one tool wrote; triggered by the assistant's routing
    g.add_node("greeter", lambda s: {"greeting": greeter.invoke("greet " + s["user_name"]).content},
               input_schema=NameIn)
    # reads only the messages; triggered by the greeter, not by the tool node
    g.add_node("auditor", lambda s: {"audit": auditor.invoke(s["messages"]).content}, input_schema=MessagesIn)
    g.add_edge(START, "assistant")
    g.add_conditional_edges("assistant", tools_condition, {"tools": "tools", "__end__": "greeter"})
    g.add_edge("tools", "assistant")
    g.add_edge("greeter", "auditor")
    g.add_edge("auditor", END)
    return g.compile()


def graph(store, captured) -> dict[str, list[str]]:
    store.flush()
    ep = store.get_episode(captured.last_episode_id)
    names = labels(ep)
    return {names[a.id]: sorted(names[d] for d in a.depends_on) for a in ep.actions}


def test_each_value_a_tool_node_writes_carries_the_tool_step_that_returned_it(sqlite_store):
    plain = app().invoke({"messages": [HumanMessage("I'm Ada. Weather in Oslo? And whales?")]})
    captured = mb.instrument(app(), store=sqlite_store)
    out = captured.invoke({"messages": [HumanMessage("I'm Ada. Weather in Oslo? And whales?")]})
    assert out["user_name"] == plain["user_name"] == "Ada" and out["audit"] == "ok"
    asked = "assistant:llm#0"
    tool_steps = ["assistant:tool:research#0", "assistant:tool:save_name#0", "assistant:tool:weather#0"]
    assert graph(sqlite_store, captured) == {
        asked: [],
        "tools:llm#0": [asked],  # the model research asked, inside the tool
        "assistant:tool:save_name#0": [asked],
        "assistant:tool:weather#0": [asked],
        "assistant:tool:research#0": [asked, "tools:llm#0"],  # its result came from that model
        "assistant:llm#1": sorted([asked, *tool_steps, "tools:llm#0"]),
        # the name came from save_name's Command only (weather's and research's results did not reach it)
        "greeter:llm#0": ["assistant:llm#1", "assistant:tool:save_name#0"],
        # the messages: every ToolMessage with what made it, research's inner model call included
        "auditor:llm#0": sorted(["greeter:llm#0", asked, *tool_steps, "tools:llm#0", "assistant:llm#1"]),
    }


@tool
def read_notes(topic: str, notes: Annotated[str, InjectedState("notes")]) -> str:
    """Read the team's notes on a topic."""
    return f"{topic}: {notes}"


@tool
def stamp(label: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
    """Stamp a label (handed the call's id only)."""
    return f"{label}/{tool_call_id}"


class Notes(TypedDict, total=False):
    messages: Annotated[list, add_messages]
    notes: str


def notes_app(tools):
    """A planner writes ``notes`` beside the assistant's first call; the assistant never reads them,
    but a tool it calls is handed them by the tool node."""
    def ask(messages):
        if ta.tool_results(messages):
            return AIMessage("got " + " | ".join(m.content for m in messages if m.type == "tool"))
        return AIMessage("", tool_calls=[ta.call(t.name, {next(iter(t.tool_call_schema.model_fields)): "x"},
                                                 messages, i) for i, t in enumerate(tools)])

    model = ta.ToolCallingModel(policy=ask).bind_tools(tools)
    planner = FakeListChatModel(responses=["NOTE-XYZ"] * 5)
    g = StateGraph(Notes)
    g.add_node("plan", lambda s: {"notes": planner.invoke("plan").content})
    g.add_node("assistant", lambda s: {"messages": [model.invoke(s["messages"])]}, input_schema=MessagesIn)
    g.add_node("tools", ToolNode(tools))
    g.add_edge(START, "plan")
    g.add_edge(START, "assistant")
    g.add_edge("plan", END)
    g.add_conditional_edges("assistant", tools_condition)
    g.add_edge("tools", "assistant")
    return g.compile()


def test_a_tool_handed_graph_state_depends_on_what_its_node_read(sqlite_store):
    captured = mb.instrument(notes_app([read_notes, stamp]), store=sqlite_store)
    out = captured.invoke({"messages": [HumanMessage("what do the notes say?")]})
    assert "x: NOTE-XYZ" in out["messages"][-1].content  # the planner's notes reached the answer
    steps = ["assistant:tool:read_notes#0", "assistant:tool:stamp#0"]
    assert graph(sqlite_store, captured) == {
        "assistant:llm#0": [],
        "plan:llm#0": [],
        # handed the notes (InjectedState): what the tool node read, the planner's call with it
        "assistant:tool:read_notes#0": ["assistant:llm#0", "plan:llm#0"],
        # handed its call's id only: the call that asked for it, as any tool
        "assistant:tool:stamp#0": ["assistant:llm#0"],
        "assistant:llm#1": ["assistant:llm#0", *steps],
    }


ToolRuntime = getattr(langgraph.prebuilt, "ToolRuntime", None)  # not in every langgraph-prebuilt 1.x


def read_runtime(topic: str, runtime: ToolRuntime) -> str:
    """Read the notes from the tool's runtime."""
    return f"{topic}: {runtime.state['notes']}"


@pytest.mark.skipif(ToolRuntime is None, reason="this langgraph-prebuilt has no ToolRuntime")
def test_a_tool_handed_a_tool_runtime_reads_the_state_too(sqlite_store):
    captured = mb.instrument(notes_app([tool(read_runtime)]), store=sqlite_store)
    out = captured.invoke({"messages": [HumanMessage("what do the notes say?")]})
    assert "x: NOTE-XYZ" in out["messages"][-1].content
    assert graph(sqlite_store, captured)["assistant:tool:read_runtime#0"] == ["assistant:llm#0", "plan:llm#0"]
