"""Capture on agent harnesses built from ``create_agent`` (the shapes deepagents uses: file tools over
graph state read through a ``ToolRuntime``, a ``task``-style tool that runs a named sub-agent), its
middleware (tool retries) and LangGraph's node cache. Real graphs, fake chat models that emit real tool
calls; each dependency graph D written by hand.

deepagents itself does not resolve beside the project's pins (see the capture report); these apps
rebuild its two mechanisms with LangChain's public API: ``Command(update=...)`` from a tool writing a
state key, a tool reading it through ``ToolRuntime.state``, and a compiled ``create_agent(name=...)``
invoked inside a tool."""

from __future__ import annotations

from typing import Annotated

import pytest
import tool_apps as ta
from langchain.agents import AgentState, create_agent
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.prebuilt import InjectedState
from langgraph.types import Command
from test_capture_tools import labels

import marft_bridge as mb
from marft_bridge.capture import recording

ToolRuntime = pytest.importorskip("langchain.tools").ToolRuntime


def graph(store, episode_id) -> dict[str, list[str]]:
    store.flush()
    ep = store.get_episode(episode_id)
    names = labels(ep)
    return {names[a.id]: sorted(names[d] for d in a.depends_on) for a in ep.actions}


# -- 1. a tool handed graph state inside create_agent ---------------------------------------------------


class Files(AgentState):
    notes: str


@tool
def write_note(text: str, runtime: ToolRuntime) -> Command:
    """Write the team's note (a state key, as deepagents' write_file writes ``files``)."""
    return Command(update={"notes": text, "messages": [ToolMessage("written", tool_call_id=runtime.tool_call_id)]})


@tool
def read_runtime(topic: str, runtime: ToolRuntime) -> str:
    """Read the note through the tool's runtime."""
    return f"{topic}: {runtime.state.get('notes')}"


@tool
def read_injected(topic: str, notes: Annotated[str, InjectedState("notes")]) -> str:
    """Read the note handed as an injected state argument."""
    return f"{topic}: {notes}"


def notes_agent(reader):
    def policy(msgs):
        n = len(ta.tool_results(msgs))
        if n == 0:
            return AIMessage("", tool_calls=[ta.call("write_note", {"text": "NOTE-7"}, msgs)])
        if n == 1:
            return AIMessage("", tool_calls=[ta.call(reader.name, {"topic": "t"}, msgs)])
        return AIMessage("done " + msgs[-1].content)

    return create_agent(ta.ToolCallingModel(policy=policy), [write_note, reader], state_schema=Files)


@pytest.mark.parametrize("reader", [read_runtime, read_injected], ids=["ToolRuntime", "InjectedState"])
def test_a_tool_reading_graph_state_in_create_agent_depends_on_the_writers_of_that_state(sqlite_store, reader):
    app = mb.instrument(notes_agent(reader), store=sqlite_store)
    out = app.invoke(ta.ask())
    assert out["messages"][-1].content == "done t: NOTE-7"
    step = f"model:tool:{reader.name}#0"
    assert graph(sqlite_store, app.last_episode_id) == {
        "model:llm#0": [],
        "model:tool:write_note#0": ["model:llm#0"],
        "model:llm#1": ["model:llm#0", "model:tool:write_note#0"],
        # the call that asked, and the state the tool node hands it: the note write_note wrote, and
        # the messages (both model calls' replies; write_note's ToolMessage)
        step: ["model:llm#0", "model:llm#1", "model:tool:write_note#0"],
        "model:llm#2": sorted(["model:llm#0", "model:llm#1", "model:tool:write_note#0", step]),
    }


# -- 2 and 3. named agents run inside tools ----------------------------------------------------------------


def _researcher_policy(msgs):
    if not ta.tool_results(msgs):
        return AIMessage("", tool_calls=[ta.call("add", {"a": 2, "b": 3}, msgs)])
    return AIMessage("sum " + msgs[-1].content)


def lead_app(names: tuple[str | None, str | None] = ("researcher", "writer")):
    """A lead agent whose ``research`` and ``write`` tools each run a compiled sub-agent (deepagents' ``task``)."""
    researcher = create_agent(ta.ToolCallingModel(policy=_researcher_policy), [ta.add], name=names[0])
    writer = create_agent(ta.ToolCallingModel(policy=lambda m: AIMessage("written")), [], name=names[1])

    @tool
    def research(q: str) -> str:
        """Delegate to the researcher."""
        return researcher.invoke({"messages": [HumanMessage(q)]})["messages"][-1].content

    @tool
    def write(q: str, runtime: ToolRuntime) -> Command:
        """Delegate to the writer (answers with a Command, as deepagents' task tool does)."""
        answer = writer.invoke({"messages": [HumanMessage(q)]})["messages"][-1].content
        return Command(update={"messages": [ToolMessage(answer, tool_call_id=runtime.tool_call_id)]})

    def policy(msgs):
        if not ta.tool_results(msgs):
            return AIMessage("", tool_calls=[ta.call("research", {"q": "2+3"}, msgs, 0),
                                             ta.call("write", {"q": "w"}, msgs, 1)])
        return AIMessage("done " + " | ".join(m.content for m in ta.tool_results(msgs)))

    return create_agent(ta.ToolCallingModel(policy=policy), [research, write], name="lead")


def test_an_agent_run_inside_a_tool_is_a_source_of_that_tool_step_and_named_by_its_own_name(sqlite_store):
    recording.reset_capture_stats()
    app = mb.instrument(lead_app(), store=sqlite_store)
    out = app.invoke(ta.ask())
    assert out["messages"][-1].content == "done sum 5 | written"
    asked = "lead/model:llm#0"
    assert graph(sqlite_store, app.last_episode_id) == {
        asked: [],
        # each sub-agent's first call: the call that asked for the tool running it
        "researcher/model:llm#0": [asked],
        "researcher/model:tool:add#0": ["researcher/model:llm#0"],
        "researcher/model:llm#1": [asked, "researcher/model:llm#0", "researcher/model:tool:add#0"],
        "writer/model:llm#0": [asked],
        # the tool step: the call that asked, and the sub-agent's answer it returned
        "lead/model:tool:research#0": [asked, "researcher/model:llm#1"],
        "lead/model:tool:write#0": [asked, "writer/model:llm#0"],
        # the lead's next call reads the ToolMessages: each tool step and the answer in it
        "lead/model:llm#1": [asked, "lead/model:tool:research#0", "lead/model:tool:write#0",
                             "researcher/model:llm#1", "writer/model:llm#0"],
    }
    assert recording.capture_stats()["errors"] == 0


def test_unnamed_agents_run_inside_tools_keep_the_path_of_the_tool_node_that_ran_them(sqlite_store):
    """The naming rule: a graph without a name of its own is named by where it ran (``lead/tools/...``),
    never merged with the lead's own ``lead/model``."""
    app = mb.instrument(lead_app(names=(None, None)), store=sqlite_store)
    app.invoke(ta.ask())
    sqlite_store.flush()
    agents = {a.agent for a in sqlite_store.get_episode(app.last_episode_id).actions}
    assert agents == {"lead/model", "lead/tools/model"}


# -- 4. ToolRetryMiddleware ---------------------------------------------------------------------------------


def test_a_failed_tool_attempt_a_retry_replaced_hands_nothing_on(sqlite_store):
    from langchain.agents.middleware import ToolRetryMiddleware

    attempts = []

    @tool
    def flaky(x: int) -> str:
        """Fails on its first attempt."""
        attempts.append(x)
        if len(attempts) == 1:
            raise ConnectionError("try again")
        return f"ok {x}"

    def policy(msgs):
        if not ta.tool_results(msgs):
            return AIMessage("", tool_calls=[ta.call("flaky", {"x": 1}, msgs)])
        return AIMessage("done " + msgs[-1].content)

    retry = ToolRetryMiddleware(max_retries=2, initial_delay=0, jitter=False, retry_on=(ConnectionError,))
    app = mb.instrument(create_agent(ta.ToolCallingModel(policy=policy), [flaky], middleware=[retry]),
                        store=sqlite_store)
    assert app.invoke(ta.ask())["messages"][-1].content == "done ok 1"
    assert graph(sqlite_store, app.last_episode_id) == {
        "model:llm#0": [],
        "model:tool:flaky#0": ["model:llm#0"],  # the failed attempt: recorded, with its error
        "model:tool:flaky#1": ["model:llm#0"],  # the retry starts from the same call, not from the failure
        "model:llm#1": ["model:llm#0", "model:tool:flaky#1"],  # only the retry's result reached the model
    }
    ep = sqlite_store.get_episode(app.last_episode_id)
    assert [a.error for a in ep.actions if a.kind == "tool"] == ["ConnectionError: try again", None]


# -- 5. node cache -----------------------------------------------------------------------------------------


def test_a_node_cache_hit_carries_what_the_run_that_filled_it_recorded(sqlite_store):
    from typing import TypedDict

    from langgraph.cache.memory import InMemoryCache
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import CachePolicy

    class S(TypedDict, total=False):
        q: str
        facts: str
        answer: str

    facts, answers = FakeListChatModel(responses=["F1", "F2"]), FakeListChatModel(responses=["A1", "A2"])
    g = StateGraph(S)
    g.add_node("research", lambda s: {"facts": facts.invoke(s["q"]).content}, cache_policy=CachePolicy())
    g.add_node("answer", lambda s: {"answer": answers.invoke(s["facts"]).content})
    g.add_edge(START, "research")
    g.add_edge("research", "answer")
    g.add_edge("answer", END)
    app = mb.instrument(g.compile(cache=InMemoryCache()), store=sqlite_store)
    with mb.episode(store=sqlite_store, task="twice") as ep:
        first, second = app.invoke({"q": "x"}), app.invoke({"q": "x"})
    assert (first["facts"], second["facts"], second["answer"]) == ("F1", "F1", "A2")  # the second run hit the cache
    assert graph(sqlite_store, ep.id) == {
        "research:llm#0": [],
        "answer:llm#0": ["research:llm#0"],
        # no research step in the second run: the cached facts are the first run's model call's
        "answer:llm#1": ["research:llm#0"],
    }
