"""LangGraph's long-term store as a data path: a memory one run saves (``runtime.store.put``) and a
later run of the episode reads (``search`` / ``get``, on another thread and graph) links the reader
to the model call whose answer was saved; a key nobody saved, or one saved by a task that had made
nothing yet, links as the rules say. Real graphs, a real ``InMemoryStore``, SQLite traces."""

from __future__ import annotations

import asyncio
from typing import TypedDict

from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from langgraph.store.memory import InMemoryStore

import marft_bridge as mb
from marft_bridge.capture import recording


class S(TypedDict, total=False):
    question: str
    status: str
    answer: str
    other: str


def one_node(name, fn):
    g = StateGraph(S)
    g.add_node(name, fn)
    g.add_edge(START, name)
    g.add_edge(name, END)
    return g


def apps(memories: InMemoryStore):
    rememberer = FakeListChatModel(responses=["user likes tea"] * 10)
    answerer, other = FakeListChatModel(responses=["make tea"] * 10), FakeListChatModel(responses=["hi"] * 10)

    def remember(s: S, runtime: Runtime):
        fact = rememberer.invoke(s["question"]).content
        runtime.store.put(("memories", "u1"), "fact", {"text": fact})
        return {"status": "saved"}

    async def answer(s: S, runtime: Runtime):
        mems = [m.value["text"] for m in await runtime.store.asearch(("memories", "u1"))]
        return {"answer": (await answerer.ainvoke(f"memories: {mems}; q: {s['question']}")).content}

    def greet(s: S, runtime: Runtime):
        assert runtime.store.get(("memories", "u2"), "fact") is None  # nobody saved this one
        return {"other": other.invoke("say hi").content}

    saver = one_node("remember", remember).compile(store=memories)
    g = StateGraph(S)
    g.add_node("answer", answer)
    g.add_node("greet", greet)
    g.add_edge(START, "answer")
    g.add_edge(START, "greet")
    g.add_edge("answer", END)
    g.add_edge("greet", END)
    return saver, g.compile(store=memories)


def test_a_memory_saved_in_one_run_links_the_run_that_reads_it(sqlite_store):
    recording.reset_capture_stats()
    saver, reader = (mb.instrument(a, store=sqlite_store) for a in apps(InMemoryStore()))
    with mb.episode(store=sqlite_store) as ep:
        saver.invoke({"question": "drink?"}, {"configurable": {"thread_id": "a"}})
        out = asyncio.run(reader.ainvoke({"question": "what to make?"}, {"configurable": {"thread_id": "b"}}))
    assert out["answer"] == "make tea"
    sqlite_store.flush()
    acts = {a.agent: a for a in sqlite_store.get_episode(ep.id).actions}
    assert sorted(acts) == ["answer", "greet", "remember"]
    assert acts["answer"].observation.messages[0].content == "memories: ['user likes tea']; q: what to make?"
    assert acts["answer"].depends_on == [acts["remember"].id]  # through the store, not a channel
    assert acts["greet"].depends_on == []  # read a key nobody saved
    assert recording.capture_stats()["errors"] == 0

