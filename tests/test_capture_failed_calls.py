"""A model call that raised hands nothing on: fallbacks, retries and a node that answers for a failed
model depend on what they read, not on the failed call. A tool that raised stays a source: its error
text is what the tool node hands the model."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Annotated, TypedDict

import pytest

from langchain_core.language_models.fake_chat_models import FakeListChatModel, FakeMessagesListChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import RetryPolicy

import marft_bridge as mb


class S(TypedDict, total=False):
    q: str
    a: str
    b: str


class Down(FakeListChatModel):
    def _call(self, *args, **kwargs):
        raise ConnectionError("primary is down")


class Flaky(FakeListChatModel):
    fails_left: int = 1

    def _call(self, *args, **kwargs):
        if self.fails_left > 0:
            self.fails_left -= 1
            raise ValueError("503 from the provider")
        return super()._call(*args, **kwargs)


def fake(*responses: str) -> FakeListChatModel:
    return FakeListChatModel(responses=list(responses) * 20)


def episode(store, app):
    store.flush()
    return store.get_episode(app.last_episode_id)


def edges(ep, key) -> dict[str, tuple[str, int, list[str]]]:
    names = {a.id: key(a) for a in ep.actions}
    assert len(set(names.values())) == len(names)
    return {names[a.id]: (a.kind, a.step, sorted(names[d] for d in a.depends_on)) for a in ep.actions}


def two_nodes(first_node, **node_kw):
    reader = fake("read it")
    g = StateGraph(S)
    g.add_node("writer", first_node, **node_kw)
    g.add_node("reader", lambda s: {"b": reader.invoke([HumanMessage(s["a"])]).content})
    g.add_edge(START, "writer")
    g.add_edge("writer", "reader")
    g.add_edge("reader", END)
    return g.compile()


def test_a_fallback_model_and_the_next_agent_do_not_depend_on_the_primary_that_raised(sqlite_store):
    model = Down(responses=["never"]).with_fallbacks([FakeListChatModel(responses=["backup answer"] * 5)])
    app = mb.instrument(two_nodes(lambda s: {"a": model.invoke([HumanMessage(s["q"])]).content}), store=sqlite_store)
    assert app.invoke({"q": "2 + 2"})["b"] == "read it"
    ep = episode(sqlite_store, app)
    assert [a.error is not None for a in ep.actions] == [True, False, False]
    assert ep.actions[0].error == "ConnectionError: primary is down"
    assert edges(ep, lambda a: f"{a.agent}:{'error' if a.error else a.output.text}") == {
        "writer:error": ("llm", 1, []),
        "writer:backup answer": ("llm", 1, []),  # it read the question only
        "reader:read it": ("llm", 2, ["writer:backup answer"]),  # the answer came from the backup
    }


def test_a_retried_node_does_not_depend_on_its_failed_attempt(sqlite_store):
    model = Flaky(responses=["ok"] * 5)
    policy = RetryPolicy(max_attempts=2, initial_interval=0.0, jitter=False, retry_on=ValueError)
    app = mb.instrument(two_nodes(lambda s: {"a": model.invoke(s["q"]).content}, retry_policy=policy),
                        store=sqlite_store)
    assert app.invoke({"q": "hi"}) == {"q": "hi", "a": "ok", "b": "read it"}
    ep = episode(sqlite_store, app)
    assert edges(ep, lambda a: f"{a.agent}:{'error' if a.error else a.output.text}") == {
        "writer:error": ("llm", 1, []),
        "writer:ok": ("llm", 1, []),
        "reader:read it": ("llm", 2, ["writer:ok"]),
    }


def test_a_node_that_answers_for_its_failed_model_hands_on_its_inputs(sqlite_store):
    asker = fake("what is 2 + 2?")

    def ask(s):
        return {"q": asker.invoke(s["q"]).content}

    down = Down(responses=["never"])

    def writer(s):
        try:
            return {"a": down.invoke(s["q"]).content}
        except ConnectionError:
            return {"a": f"no answer to: {s['q']}"}  # made from its input, not from the failed call

    reader = fake("read it")
    g = StateGraph(S)
    g.add_node("asker", ask)
    g.add_node("writer", writer)
    g.add_node("reader", lambda s: {"b": reader.invoke(s["a"]).content})
    g.add_edge(START, "asker")
    g.add_edge("asker", "writer")
    g.add_edge("writer", "reader")
    g.add_edge("reader", END)
    app = mb.instrument(g.compile(), store=sqlite_store)
    assert app.invoke({"q": "start"})["a"] == "no answer to: what is 2 + 2?"
    ep = episode(sqlite_store, app)
    assert edges(ep, lambda a: f"{a.agent}:{'error' if a.error else a.output.text}") == {
        "asker:what is 2 + 2?": ("llm", 1, []),
        "writer:error": ("llm", 2, ["asker:what is 2 + 2?"]),
        "reader:read it": ("llm", 3, ["asker:what is 2 + 2?"]),  # the writer's inputs, passed on
    }


class M(TypedDict):
    messages: Annotated[list, add_messages]


@tool
def lookup(city: str) -> str:
    """Weather of a city."""
    raise RuntimeError(f"no station in {city}")


def test_a_tool_that_raised_is_a_source_of_the_model_call_that_reads_its_error(sqlite_store):
    model = FakeMessagesListChatModel(responses=[
        AIMessage("", tool_calls=[{"name": "lookup", "args": {"city": "Oslo"}, "id": "call_1", "type": "tool_call"}]),
        AIMessage("I could not find the weather."),
    ])

    def agent(s):
        return {"messages": [model.invoke(s["messages"])]}

    g = StateGraph(M)
    g.add_node("agent", agent)
    g.add_node("tools", ToolNode([lookup], handle_tool_errors=True))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    app = mb.instrument(g.compile(), store=sqlite_store)
    out = app.invoke({"messages": [HumanMessage("weather in Oslo?")]})
    assert "no station in Oslo" in out["messages"][2].content
    ep = episode(sqlite_store, app)
    tool_step = next(a for a in ep.actions if a.kind == "tool")
    assert tool_step.error and "no station in Oslo" in tool_step.error
    assert edges(ep, lambda a: f"{a.kind}:{a.output.text if a.kind == 'llm' else 'lookup'}") == {
        "llm:": ("llm", 1, []),
        "tool:lookup": ("tool", 2, ["llm:"]),
        "llm:I could not find the weather.": ("llm", 3, ["llm:", "tool:lookup"]),
    }


class Flaky2(FakeListChatModel):
    """Answers its first call, then raises once (the node's first attempt fails on its second call)."""

    calls: int = 0

    def _call(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 2:
            raise ValueError("rate limited")
        return super()._call(*args, **kwargs)


def _says_node_attempt() -> bool:
    try:
        from langgraph.runtime import ExecutionInfo
    except ImportError:
        return False
    return "node_attempt" in {f.name for f in dataclasses.fields(ExecutionInfo)}


@pytest.mark.skipif(not _says_node_attempt(), reason="LangGraph < 1.1.3 does not say which attempt a node is in")
@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_retried_node_starts_again_from_its_inputs(sqlite_store, asynchronous):
    model = Flaky2(responses=["outline", "outline again", "draft"])
    policy = RetryPolicy(max_attempts=2, initial_interval=0.0, jitter=False, retry_on=ValueError)

    def write(s):
        outline = model.invoke(s["q"]).content
        return {"a": model.invoke(outline).content}

    async def awrite(s):
        outline = (await model.ainvoke(s["q"])).content
        return {"a": (await model.ainvoke(outline)).content}

    app = mb.instrument(two_nodes(awrite if asynchronous else write, retry_policy=policy), store=sqlite_store)
    out = asyncio.run(app.ainvoke({"q": "essay"})) if asynchronous else app.invoke({"q": "essay"})
    assert out["a"] == "draft" and out["b"] == "read it"
    ep = episode(sqlite_store, app)
    assert edges(ep, lambda a: f"{a.agent}:{'error' if a.error else a.output.text}") == {
        "writer:outline": ("llm", 1, []),
        "writer:error": ("llm", 1, ["writer:outline"]),  # attempt 1's second call raised
        "writer:outline again": ("llm", 1, []),  # attempt 2 read the question, not attempt 1
        "writer:draft": ("llm", 1, ["writer:outline again"]),
        "reader:read it": ("llm", 2, ["writer:draft", "writer:outline again"]),  # attempt 2's, not attempt 1's
    }
