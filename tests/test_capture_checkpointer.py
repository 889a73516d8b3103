"""LangGraph capture across runs of one checkpointed thread: a later run reads channels that an
earlier run's nodes wrote, so inside one episode it depends on them exactly as if it were one run;
with one episode per run there are no edges across episodes."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Annotated, TypedDict

import pytest
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Command, interrupt
from test_capture_langgraph import edges, fake
from test_capture_tools import labels

import marft_bridge as mb
from marft_bridge.capture import recording
from marft_bridge.integrations import langgraph as lg


def cfg(thread: str) -> dict:
    return {"configurable": {"thread_id": thread}}


def stored_episode(store, episode_id: str):
    store.flush()
    ep = store.get_episode(episode_id)
    assert ep is not None and ep.status == "completed" and "capture_errors" not in ep.metadata
    return ep


def stored_edges(store, episode_id: str) -> dict[str, tuple[str, list[str]]]:
    return edges(stored_episode(store, episode_id))


@pytest.fixture(autouse=True)
def no_capture_errors():
    recording.reset_capture_stats()
    yield
    assert recording.capture_stats()["errors"] == 0, recording.capture_stats()


# -- a writer/editor loop over turns: the writer reads the editor's last feedback ----------------


class Turn(TypedDict, total=False):
    question: str
    draft: str
    feedback: str


class WriterInput(TypedDict, total=False):
    question: str
    feedback: str


class EditorInput(TypedDict):
    draft: str


def turns_app(review=None):
    """writer -> editor; the writer reads the question and the feedback the editor left on the
    thread, the editor reads only the draft. ``review`` (optional) runs in the editor before its model."""
    writer, editor = fake("draft"), fake("tighten it")

    def write(s: WriterInput):
        return {"draft": writer.invoke(f"{s['question']} {s.get('feedback', '')}").content}

    def edit(s: EditorInput):
        note = review(s) if review is not None else ""
        return {"feedback": editor.invoke(f"{s['draft']} {note}").content}

    g = StateGraph(Turn)
    g.add_node("writer", write, input_schema=WriterInput)
    g.add_node("editor", edit, input_schema=EditorInput)
    g.add_edge(START, "writer")
    g.add_edge("writer", "editor")
    g.add_edge("editor", END)
    return g.compile(checkpointer=InMemorySaver())


def test_second_run_on_a_thread_depends_on_the_first_runs_writer(sqlite_store):
    app = mb.instrument(turns_app(), store=sqlite_store)
    with mb.episode(store=sqlite_store, task="two turns") as ep:
        app.invoke({"question": "q1"}, cfg("t1"))
        out = app.invoke({"question": "q2"}, cfg("t1"))
    assert out == {"question": "q2", "draft": "draft", "feedback": "tighten it"}
    assert stored_edges(sqlite_store, ep.id) == {
        "writer@1": ("llm", []),
        "editor@2": ("llm", ["writer@1"]),
        "writer@7": ("llm", ["editor@2"]),  # it read the feedback run 1's editor left on the thread
        "editor@8": ("llm", ["writer@7"]),
    }


def test_async_runs_in_a_capture_block_too(sqlite_store):
    app = turns_app()  # built elsewhere: captured by the block

    async def two_turns():
        await app.ainvoke({"question": "q1"}, cfg("t1"))
        await app.ainvoke({"question": "q2"}, cfg("t1"))

    with mb.episode(store=sqlite_store, task="async") as ep, mb.capture(store=sqlite_store):
        asyncio.run(two_turns())
    assert stored_edges(sqlite_store, ep.id) == {
        "writer@1": ("llm", []), "editor@2": ("llm", ["writer@1"]),
        "writer@7": ("llm", ["editor@2"]), "editor@8": ("llm", ["writer@7"]),
    }


def test_threads_of_one_episode_keep_their_own_history(sqlite_store):
    app = mb.instrument(turns_app(), store=sqlite_store)
    with mb.episode(store=sqlite_store, task="two threads") as ep:
        app.invoke({"question": "a1"}, cfg("a"))
        app.invoke({"question": "b1"}, cfg("b"))
        app.invoke({"question": "a2"}, cfg("a"))
    assert stored_edges(sqlite_store, ep.id) == {
        "writer@1": ("llm", []),
        "editor@2": ("llm", ["writer@1"]),
        "writer@3": ("llm", []),  # thread b starts empty
        "editor@4": ("llm", ["writer@3"]),
        "writer@9": ("llm", ["editor@2"]),  # thread a: thread b's editor@4 ran last, but elsewhere
        "editor@10": ("llm", ["writer@9"]),
    }


def test_state_changed_between_runs_ends_the_dependency(sqlite_store):
    app = mb.instrument(turns_app(), store=sqlite_store)
    with mb.episode(store=sqlite_store, task="edited by hand") as ep:
        app.invoke({"question": "q1"}, cfg("t1"))
        app.update_state(cfg("t1"), {"feedback": "by hand"}, as_node="editor")  # no captured action wrote it
        app.invoke({"question": "q2"}, cfg("t1"))
    assert stored_edges(sqlite_store, ep.id) == {
        "writer@1": ("llm", []), "editor@2": ("llm", ["writer@1"]),
        "writer@8": ("llm", []), "editor@9": ("llm", ["writer@8"]),
    }


def test_each_run_its_own_episode_has_no_edges_across_episodes(sqlite_store):
    app = mb.instrument(turns_app(), store=sqlite_store)
    app.invoke({"question": "q1"}, cfg("t1"))
    first = app.last_episode_id
    app.invoke({"question": "q2"}, cfg("t1"))
    assert app.last_episode_id != first
    assert stored_edges(sqlite_store, first) == {"writer@1": ("llm", []), "editor@2": ("llm", ["writer@1"])}
    # the feedback run 2's writer read came from the first episode: outside this one, so no edge
    assert stored_edges(sqlite_store, app.last_episode_id) == {
        "writer@5": ("llm", []), "editor@6": ("llm", ["writer@5"])}


def test_history_goes_with_the_episode(sqlite_store):
    app = mb.instrument(turns_app(), store=sqlite_store)
    with mb.episode(store=sqlite_store, task="t") as ep:
        app.invoke({"question": "q1"}, cfg("t1"))
        assert [key for key in lg.runs.scope(ep).threads] == [("t1", "")]
    ref = weakref.ref(ep)
    del ep
    gc.collect()
    assert ref() is None  # capture keeps no finished episode alive, nor (weakly keyed) its history


# -- interrupt() and Command(resume=...) ---------------------------------------------------------


def test_interrupt_and_resume_in_one_episode(sqlite_store):
    app = mb.instrument(turns_app(review=lambda s: interrupt(f"ok? {s['draft']}")), store=sqlite_store)
    with mb.episode(store=sqlite_store, task="human in the loop") as ep:
        first = app.invoke({"question": "q1"}, cfg("t1"))
        assert first["__interrupt__"][0].value == "ok? draft"
        out = app.invoke(Command(resume="fine"), cfg("t1"))
    assert out == {"question": "q1", "draft": "draft", "feedback": "tighten it"}
    assert stored_edges(sqlite_store, ep.id) == {
        "writer@1": ("llm", []),
        "editor@3": ("llm", ["writer@1"]),  # resumed: it reads the draft run 1's writer wrote
    }


def test_interrupt_and_resume_as_two_episodes(sqlite_store):
    app = mb.instrument(turns_app(review=lambda s: interrupt("ok?")), store=sqlite_store)
    app.invoke({"question": "q1"}, cfg("t1"))
    first = app.last_episode_id
    app.invoke(Command(resume="fine"), cfg("t1"))
    assert stored_edges(sqlite_store, first) == {"writer@1": ("llm", [])}
    assert stored_edges(sqlite_store, app.last_episode_id) == {"editor@2": ("llm", [])}


class Pair(TypedDict, total=False):
    topic: str
    facts: str
    angle: str
    summary: str


def parallel_interrupt_app():
    """researcher and strategist run in parallel; the strategist asks a human first; the
    summarizer joins both. On resume the researcher's saved writes come back: it does not run again."""
    researcher, strategist, summarizer = fake("facts"), fake("angle"), fake("summary")

    def strategize(s):
        hint = interrupt("which angle?")
        return {"angle": strategist.invoke(f"{s['topic']} {hint}").content}

    g = StateGraph(Pair)
    g.add_node("researcher", lambda s: {"facts": researcher.invoke(s["topic"]).content})
    g.add_node("strategist", strategize)
    g.add_node("summarizer", lambda s: {"summary": summarizer.invoke(f"{s['facts']} {s['angle']}").content})
    g.add_edge(START, "researcher")
    g.add_edge(START, "strategist")
    g.add_edge(["researcher", "strategist"], "summarizer")
    g.add_edge("summarizer", END)
    return g.compile(checkpointer=InMemorySaver())


def test_parallel_step_resumed_in_one_episode_is_one_run(sqlite_store):
    app = mb.instrument(parallel_interrupt_app(), store=sqlite_store)
    with mb.episode(store=sqlite_store, task="parallel") as ep:
        app.invoke({"topic": "tea"}, cfg("t1"))
        out = app.invoke(Command(resume="history"), cfg("t1"))
    assert out == {"topic": "tea", "facts": "facts", "angle": "angle", "summary": "summary"}
    assert stored_edges(sqlite_store, ep.id) == {
        "researcher@1": ("llm", []),  # once: on resume its writes come back from the checkpoint
        "strategist@2": ("llm", []),
        "summarizer@3": ("llm", ["researcher@1", "strategist@2"]),
    }


class Outer(TypedDict, total=False):
    topic: str
    plan: str
    text: str


class Inner(TypedDict, total=False):
    plan: str
    text: str


def subgraph_interrupt_app():
    """planner -> team, a subgraph: drafter -> checker, which asks a human before its model and
    reads the whole subgraph state (plan and text)."""
    planner, drafter, checker = fake("plan"), fake("text"), fake("checked")

    def check(s):
        note = interrupt("publish?")
        return {"text": checker.invoke(f"{s['text']} {note}").content}

    inner = StateGraph(Inner)
    inner.add_node("drafter", lambda s: {"text": drafter.invoke(s["plan"]).content})
    inner.add_node("checker", check)
    inner.add_edge(START, "drafter")
    inner.add_edge("drafter", "checker")
    g = StateGraph(Outer)
    g.add_node("planner", lambda s: {"plan": planner.invoke(s["topic"]).content})
    g.add_node("team", inner.compile())
    g.add_edge(START, "planner")
    g.add_edge("planner", "team")
    return g.compile(checkpointer=InMemorySaver())


def test_subgraph_interrupted_and_resumed_in_one_episode(sqlite_store):
    app = mb.instrument(subgraph_interrupt_app(), store=sqlite_store)
    with mb.episode(store=sqlite_store, task="subgraph") as ep:
        app.invoke({"topic": "tea"}, cfg("t1"))
        out = app.invoke(Command(resume="yes"), cfg("t1"))
        assert list(lg.runs.scope(ep).threads) == [("t1", "")]  # the finished subgraph's history went
    assert out == {"topic": "tea", "plan": "plan", "text": "checked"}
    assert stored_edges(sqlite_store, ep.id) == {
        "planner@1": ("llm", []),
        "team/drafter@2": ("llm", ["planner@1"]),
        # the subgraph resumes where run 1 left it: it reads the plan and run 1's draft
        "team/checker@4": ("llm", ["planner@1", "team/drafter@2"]),
    }


def test_functional_api_previous_value_links_the_runs(sqlite_store):
    from langgraph.func import entrypoint, task

    model = fake("hello")

    @task
    def reply(prompt: str) -> str:
        return model.invoke(prompt).content

    @entrypoint(checkpointer=InMemorySaver())
    def chat(message: str, *, previous: str | None = None) -> str:
        return reply(f"{previous} {message}").result()

    app = mb.instrument(chat, store=sqlite_store)
    with mb.episode(store=sqlite_store, task="chat") as ep:
        app.invoke("hi", cfg("t1"))
        app.invoke("again", cfg("t1"))
    app.invoke("alone", cfg("t1"))
    # `previous` in run 2 is what run 1 returned: its reply
    assert stored_edges(sqlite_store, ep.id) == {"reply@0": ("llm", []), "reply@2": ("llm", ["reply@0"])}
    assert stored_edges(sqlite_store, app.last_episode_id) == {"reply@4": ("llm", [])}


# -- time travel inside one episode: a run from an older checkpoint starts from what it held then ----


def in_order(store, episode_id: str) -> dict[str, list[str]]:
    """``agent:kind#n`` (its n-th action) -> what it depends on: steps after a replay are LangGraph's to number."""
    ep = stored_episode(store, episode_id)
    names = labels(ep)
    return {names[a.id]: sorted(names[d] for d in a.depends_on) for a in ep.actions}


def checkpoint_before(app, thread: str, node: str, run: int):
    """The config of the thread's checkpoint whose next step is ``node``, of the ``run``-th run (0-based)."""
    found = [h.config for h in app.get_state_history(cfg(thread)) if h.next == (node,)]
    return list(reversed(found))[run]  # the history is newest first


def test_a_replay_from_an_older_checkpoint_depends_on_what_that_checkpoint_held(sqlite_store):
    app = mb.instrument(turns_app(), store=sqlite_store)
    with mb.episode(store=sqlite_store, task="replay") as ep:
        app.invoke({"question": "q1"}, cfg("t1"))
        app.invoke({"question": "q2"}, cfg("t1"))
        app.invoke(None, checkpoint_before(app, "t1", "editor", 0))  # run 1's editor again
    assert in_order(sqlite_store, ep.id) == {
        "writer:llm#0": [], "editor:llm#0": ["writer:llm#0"],
        "writer:llm#1": ["editor:llm#0"], "editor:llm#1": ["writer:llm#1"],
        "editor:llm#2": ["writer:llm#0"],  # it read run 1's draft, not the one run 2 left last
    }


def test_a_fork_update_state_wrote_on_an_older_checkpoint_keeps_what_it_did_not_change(sqlite_store):
    app = mb.instrument(turns_app(), store=sqlite_store)
    with mb.episode(store=sqlite_store, task="fork") as ep:
        app.invoke({"question": "q1"}, cfg("t1"))
        app.invoke({"question": "q2"}, cfg("t1"))
        fork = app.update_state(checkpoint_before(app, "t1", "writer", 1), {"question": "q3"}, as_node="__start__")
        app.invoke(None, fork)
    assert in_order(sqlite_store, ep.id) == {
        "writer:llm#0": [], "editor:llm#0": ["writer:llm#0"],
        "writer:llm#1": ["editor:llm#0"], "editor:llm#1": ["writer:llm#1"],
        # run 2's start held run 1's feedback; the fork changed only the question
        "writer:llm#2": ["editor:llm#0"], "editor:llm#2": ["writer:llm#2"],
    }


class Chat(TypedDict):
    messages: Annotated[list, add_messages]


def test_a_regenerated_reply_does_not_depend_on_the_reply_it_replaces(sqlite_store):
    model = fake("first answer", "second answer")
    g = StateGraph(Chat)
    g.add_node("chat", lambda s: {"messages": [model.invoke(s["messages"])]})
    g.add_edge(START, "chat")
    g.add_edge("chat", END)
    app = mb.instrument(g.compile(checkpointer=InMemorySaver()), store=sqlite_store)
    with mb.episode(store=sqlite_store, task="regenerate") as ep:
        app.invoke({"messages": [HumanMessage("hi")]}, cfg("c"))
        out = app.invoke(None, checkpoint_before(app, "c", "chat", 0))
    assert [m.content for m in out["messages"]] == ["hi", "second answer"]
    assert in_order(sqlite_store, ep.id) == {"chat:llm#0": [], "chat:llm#1": []}  # it saw only "hi"
