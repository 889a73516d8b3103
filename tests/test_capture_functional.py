"""LangGraph functional API: an action depends on the tasks whose result the code had received
(``.result()`` / ``await``) before it started, whether the entrypoint starts a task or calls a
model itself; a task that finished but was never read gives no edge. Sync and async entrypoints."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.func import entrypoint, task
from langgraph.types import Command, interrupt
from test_capture_checkpointer import cfg, no_capture_errors  # noqa: F401 - autouse: capture must not fail
from test_capture_langgraph import edges, fake

import marft_bridge as mb


def prompt_label(a) -> str:
    """agent(last prompt): tells apart calls of one agent at one step."""
    msgs = a.observation.messages
    return f"{a.agent}({msgs[-1].content if msgs else ''})"


def episode_edges(store, episode_id: str, key=prompt_label) -> dict[str, tuple[str, list[str]]]:
    store.flush()
    ep = store.get_episode(episode_id)
    assert ep.status == "completed"
    return edges(ep, key=key)


def run(app, store, inputs, is_async: bool = False):
    """Run the instrumented app (``ainvoke`` for async entrypoints); its output and edges."""
    out = asyncio.run(app.ainvoke(inputs)) if is_async else app.invoke(inputs)
    return out, episode_edges(store, app.last_episode_id)


def make(sync_fn, async_fn, is_async: bool, store):
    """The sync or the async entrypoint, instrumented. Both variants are named as the sync one
    (async tasks by ``@task(name=...)``), so they record the same agents."""
    fn = async_fn if is_async else sync_fn
    fn.__name__ = sync_fn.__name__
    return mb.instrument(entrypoint()(fn), store=store)


both = pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])


# -- sequential: each step reads the previous one's result ---------------------------------------


def sequential_app(is_async: bool, store):
    plan_model, solve_model, answer_model = fake("plan"), fake("solution"), fake("answer")

    @task
    def planner(q: str) -> str:
        return plan_model.invoke(q).content

    @task
    def solver(plan: str) -> str:
        return solve_model.invoke(plan).content

    @task(name="planner")
    async def aplanner(q: str) -> str:
        return (await plan_model.ainvoke(q)).content

    @task(name="solver")
    async def asolver(plan: str) -> str:
        return (await solve_model.ainvoke(plan)).content

    def workflow(q: str) -> str:
        solution = solver(planner(q).result()).result()
        return answer_model.invoke(solution).content  # the entrypoint's own call reads both

    async def aworkflow(q: str) -> str:
        solution = await asolver(await aplanner(q))
        return (await answer_model.ainvoke(solution)).content

    return make(workflow, aworkflow, is_async, store)


@both
def test_sequential_tasks_then_own_model_call(sqlite_store, is_async):
    app = sequential_app(is_async, sqlite_store)
    out, got = run(app, sqlite_store, "q", is_async)
    assert out == "answer"
    assert got == {
        "planner(q)": ("llm", []),
        "solver(plan)": ("llm", ["planner(q)"]),
        "workflow(solution)": ("llm", ["planner(q)", "solver(plan)"]),
    }


# -- parallel tasks then a join; one of them had finished before the others started ----------------


def parallel_app(is_async: bool, store):
    work_model, join_model = fake("note"), fake("summary")

    @task
    def worker(topic: str) -> str:
        return work_model.invoke(topic).content

    @task(name="worker")
    async def aworker(topic: str) -> str:
        return (await work_model.ainvoke(topic)).content

    def workflow(topics: list[str]) -> str:
        first = worker(topics[0])
        concurrent.futures.wait([first])  # finished, not read: the next workers do not see it
        futures = [first, *(worker(t) for t in topics[1:])]
        notes = [f.result() for f in futures]
        return join_model.invoke(" ".join(notes)).content

    async def aworkflow(topics: list[str]) -> str:
        first = aworker(topics[0])
        await asyncio.wait([first])
        notes = await asyncio.gather(first, *(aworker(t) for t in topics[1:]))
        return (await join_model.ainvoke(" ".join(notes))).content

    return make(workflow, aworkflow, is_async, store)


@both
def test_parallel_tasks_then_join(sqlite_store, is_async):
    app = parallel_app(is_async, sqlite_store)
    out, got = run(app, sqlite_store, ["a", "b", "c"], is_async)
    assert out == "summary"
    assert got == {
        "worker(a)": ("llm", []),
        "worker(b)": ("llm", []),
        "worker(c)": ("llm", []),
        "workflow(note note note)": ("llm", ["worker(a)", "worker(b)", "worker(c)"]),
    }


# -- a task whose result is never read; a task that calls no model --------------------------------


def unread_app(is_async: bool, store):
    audit_model, answer_model = fake("audited"), fake("answer")

    @task
    def auditor(q: str) -> str:
        return audit_model.invoke(q).content

    @task
    def retrieve(q: str) -> str:  # no model call: an environment step
        return f"docs on {q}"

    @task(name="auditor")
    async def aauditor(q: str) -> str:
        return (await audit_model.ainvoke(q)).content

    @task(name="retrieve")
    async def aretrieve(q: str) -> str:
        return f"docs on {q}"

    def workflow(q: str) -> str:
        audit = auditor(q)  # fire and forget
        concurrent.futures.wait([audit])
        docs = retrieve(q).result()
        return answer_model.invoke(docs).content

    async def aworkflow(q: str) -> str:
        audit = aauditor(q)
        await asyncio.wait([audit])
        docs = await aretrieve(q)
        return (await answer_model.ainvoke(docs)).content

    return make(workflow, aworkflow, is_async, store)


@both
def test_unread_task_gives_no_edge_and_env_task_passes_its_result(sqlite_store, is_async):
    app = unread_app(is_async, sqlite_store)
    out, got = run(app, sqlite_store, "q", is_async)
    assert out == "answer"
    assert got == {
        "auditor(q)": ("llm", []),
        "retrieve()": ("env", []),
        "workflow(docs on q)": ("llm", ["retrieve()"]),
    }
    env = [a for a in sqlite_store.get_episode(app.last_episode_id).actions if a.kind == "env"]
    assert [a.output.text for a in env] == ["docs on q"]  # the task's result


# -- a task that calls a task; a failed task the caller caught --------------------------------------


def nested_app(is_async: bool, store):
    inner_model, outer_model, answer_model = fake("facts"), fake("draft"), fake("answer")

    @task
    def inner(q: str) -> str:
        return inner_model.invoke(q).content

    @task
    def outer(q: str) -> str:
        return outer_model.invoke(inner(q).result()).content

    @task(name="inner")
    async def ainner(q: str) -> str:
        return (await inner_model.ainvoke(q)).content

    @task(name="outer")
    async def aouter(q: str) -> str:
        return (await outer_model.ainvoke(await ainner(q))).content

    def workflow(q: str) -> str:
        return answer_model.invoke(outer(q).result()).content

    async def aworkflow(q: str) -> str:
        return (await answer_model.ainvoke(await aouter(q))).content

    return make(workflow, aworkflow, is_async, store)


@both
def test_task_reading_a_task_it_called(sqlite_store, is_async):
    app = nested_app(is_async, sqlite_store)
    out, got = run(app, sqlite_store, "q", is_async)
    assert out == "answer"
    assert got == {
        "inner(q)": ("llm", []),
        "outer(facts)": ("llm", ["inner(q)"]),
        "workflow(draft)": ("llm", ["inner(q)", "outer(facts)"]),
    }


def test_failed_task_whose_error_was_read(sqlite_store):
    check_model, answer_model = fake("checked"), fake("answer")

    @task
    def checker(q: str) -> str:
        check_model.invoke(q)
        raise ValueError("rejected")

    def workflow(q: str) -> str:
        try:
            return checker(q).result()
        except ValueError as e:
            return answer_model.invoke(str(e)).content

    app = mb.instrument(entrypoint()(workflow), store=sqlite_store)
    out, got = run(app, sqlite_store, "q")
    assert out == "answer"
    assert got == {"checker(q)": ("llm", []), "workflow(rejected)": ("llm", ["checker(q)"])}


# -- checkpointed: resume after an interrupt; `previous` carries only what was read ---------------


def test_resumed_entrypoint_reads_the_result_saved_before_the_interrupt(sqlite_store):
    plan_model, answer_model = fake("plan"), fake("answer")

    @task
    def planner(q: str) -> str:
        return plan_model.invoke(q).content

    @entrypoint(checkpointer=InMemorySaver())
    def workflow(q: str) -> str:
        plan = planner(q).result()
        return answer_model.invoke(plan + interrupt("approve?")).content

    app = mb.instrument(workflow, store=sqlite_store)
    with mb.episode(store=sqlite_store, task="hitl") as ep:
        app.invoke("q", cfg("t1"))
        assert app.invoke(Command(resume=" ok"), cfg("t1")) == "answer"
    # planner ran once; on resume its saved result is what the entrypoint reads
    assert episode_edges(sqlite_store, ep.id) == {
        "planner(q)": ("llm", []),
        "workflow(plan ok)": ("llm", ["planner(q)"]),
    }


def test_previous_carries_only_the_results_the_entrypoint_read(sqlite_store):
    audit_model, reply_model = fake("audited"), fake("hello")

    @task
    def auditor(message: str) -> str:
        return audit_model.invoke(message).content

    @task
    def reply(prompt: str) -> str:
        return reply_model.invoke(prompt).content

    @entrypoint(checkpointer=InMemorySaver())
    def chat(message: str, *, previous: str | None = None) -> str:
        concurrent.futures.wait([auditor(message)])  # finished, never read
        return reply(f"{previous} {message}").result()

    app = mb.instrument(chat, store=sqlite_store)
    with mb.episode(store=sqlite_store, task="chat") as ep:
        app.invoke("hi", cfg("t1"))
        app.invoke("again", cfg("t1"))
    # run 2 reads `previous`, which is run 1's reply: not run 1's audit
    assert episode_edges(sqlite_store, ep.id, key=lambda a: f"{prompt_label(a)}@{a.step}") == {
        "auditor(hi)@0": ("llm", []),
        "reply(None hi)@0": ("llm", []),
        "auditor(again)@2": ("llm", ["reply(None hi)@0"]),
        "reply(hello again)@2": ("llm", ["reply(None hi)@0"]),
    }
