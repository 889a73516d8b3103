"""Functional API (precision tier): ``@task`` calls and the results their caller reads.

A task's output reaches its caller only through its future (``.result()`` / ``await``), so the
capture hands the caller a future that notes the read. What a task or model call then depends on
is what its caller had read before starting it, not what happened to have finished. No LangGraph
import: ``precision.py`` passes in LangGraph's ``chain_future``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
from collections.abc import Callable
from typing import Any

from ...capture_errors import capture_error
from .provenance import Task, seen
from .runs import record_env


class _Push:
    """One ``@task`` call of a captured task: filled in when LangGraph schedules it."""

    __slots__ = ("caller", "task", "writes")

    def __init__(self, caller: Task):
        self.caller = caller
        self.task: Task | None = None
        self.writes: Any = ()


# The ``@task`` call being scheduled in this context (LangGraph schedules async ones in a task
# that copies the caller's context).
_PUSHING: contextvars.ContextVar[_Push | None] = contextvars.ContextVar("marft_langgraph_push", default=None)


def register_pushed(st: Any, caller: Any, pushed: Any) -> None:
    """A functional-API ``@task`` started by a running task: an agent of its own (its name) at the
    caller's step. Its arguments come from the caller, so it depends on what the caller had seen
    when it started it: its inputs, its own calls and the results of tasks it had read."""
    tasks = st.run.state.tasks
    parent = tasks.get(getattr(caller, "id", None))
    if parent is None:
        return
    if pushed.id not in st.seen:
        st.seen.add(pushed.id)
        resumed = st.resumed.get(pushed.id)
        if resumed is not None:
            deps = resumed[0]  # started before the interrupt this run resumes: the same inputs
        else:
            with parent.run.lock:
                deps = seen(parent)
        meta = pushed.config.get("metadata") or {}
        name = str(meta.get("agent_name") or pushed.name)
        agent = f"{parent.agent.rpartition('/')[0]}/{name}" if "/" in parent.agent else name
        t = Task(pushed.id, parent.run, agent, pushed.name, parent.step, parent.lg_steps,
                 meta.get("langgraph_checkpoint_ns") or pushed.id, deps, False)
        if resumed is not None and pushed.writes:
            t.actions.extend(resumed[1])  # it had finished: its saved result comes back, it does not run again
        t.pusher = parent
        parent.pushed.append(t)
        tasks[pushed.id] = t
        parent.run.task_ids.append(pushed.id)
    push = _PUSHING.get()
    if push is not None and push.caller is parent:
        push.task, push.writes = tasks.get(pushed.id), pushed.writes


def _read(push: _Push) -> None:
    """The caller got a ``@task``'s result. A task that called no model is recorded now, as an
    env action, so what the caller does next can depend on it."""
    t, caller = push.task, push.caller
    if t is None:
        return
    with caller.run.lock:
        if t in caller.received:
            return
        caller.received.add(t)
        env = not (t.actions or t.calls or t.pushed or t.children)
    if env:
        record_env(t, push.writes)


def _safe_read(fut: Any) -> None:
    if fut.done() and not fut.cancelled():
        try:
            _read(fut.marft_push)
        except Exception as e:  # noqa: BLE001 - capture must not break the app
            capture_error("langgraph.task_result", e)


class _TaskFuture(concurrent.futures.Future):
    """The future a sync ``@task`` call returns, noting when its result is read."""

    marft_push: _Push

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        finally:
            _safe_read(self)


class _AsyncTaskFuture(asyncio.Future):
    """The future an async ``@task`` call returns, noting when it is awaited or its result read."""

    marft_push: _Push

    def result(self) -> Any:
        try:
            return super().result()
        finally:
            _safe_read(self)

    def __await__(self) -> Any:
        try:
            return (yield from super().__await__())
        finally:
            _safe_read(self)


def tracked_call(state: Any, call: Callable[..., Any], task_ref: Any, args: tuple, kwargs: dict,
                 chain_future: Callable[[Any, Any], Any]) -> Any:
    """Run LangGraph's ``@task`` call; hand back a future that notes when the caller reads it."""
    caller = state.tasks.get(getattr(task_ref(), "id", None)) if callable(task_ref) else None
    if caller is None:
        return call(*args, **kwargs)
    push = _Push(caller)
    token = _PUSHING.set(push)
    try:
        fut = call(*args, **kwargs)
    finally:
        _PUSHING.reset(token)
    try:
        out = _AsyncTaskFuture(loop=fut.get_loop()) if isinstance(fut, asyncio.Future) else _TaskFuture()
        out.marft_push = push
        return chain_future(fut, out)
    except Exception as e:  # noqa: BLE001
        capture_error("langgraph.task_call", e, caller.run.recorder)
        return fut
