"""LangGraph's long-term store (``BaseStore``: ``runtime.store``, an injected ``store``,
``get_store()``) as a data path: what a captured task puts under a key carries what the task had
made or read when it put it, and a task that reads the key (``get``, or ``search`` returning it)
depends on that from then on — within a run, and across the runs of one episode (another thread
reading a memory an earlier run saved). Keys are ``(namespace, key)``; the provenance lives in the
run (its episode's scope when runs share one). Hooks of the precision tier (``precision._targets``)
on ``BaseStore``'s public ``put``/``get``/``search`` and their async forms, pass-through.
"""

from __future__ import annotations

import functools
from typing import Any

from ...capture_errors import guarded
from ..hooks import arg
from .provenance import EMPTY
from .runs import find_task


def _task(state: Any) -> Any:
    if not state.tasks:
        return None
    from langchain_core.runnables.config import var_child_runnable_config

    cfg = var_child_runnable_config.get() or {}
    return find_task(state, cfg.get("metadata") or {})


def _put(state: Any, args: tuple, kwargs: dict, out: Any) -> None:
    task = _task(state)
    if task is None:
        return
    key = (tuple(arg(args, kwargs, 0, "namespace") or ()), str(arg(args, kwargs, 1, "key")))
    with task.run.lock:
        # What the task made so far (the model call whose answer it saves), else what it read.
        task.run.memory[key] = frozenset(task.actions) or task.deps


def _read(state: Any, args: tuple, kwargs: dict, items: Any) -> None:
    task = _task(state) if items is not None else None
    if task is None:
        return
    found = items if isinstance(items, list) else [items]
    with task.run.lock:
        memory = task.run.memory
        prov = EMPTY.union(*(memory.get((tuple(getattr(i, "namespace", ())), str(getattr(i, "key", ""))), EMPTY)
                             for i in found))
        if prov - task.deps:
            task.deps = task.deps | prov


def _hook(note: Any, where: str, is_async: bool) -> Any:
    """A pass-through hook calling ``note(state, args, kwargs, result)`` after the store call."""
    if is_async:
        async def ahook(state: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            out = await wrapped(*args, **kwargs)
            with guarded(where):
                note(state, args, kwargs, out)
            return out
        return ahook

    def hook(state: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        out = wrapped(*args, **kwargs)
        with guarded(where):
            note(state, args, kwargs, out)
        return out
    return hook


def targets(state: Any) -> list[tuple[Any, str, Any]]:
    from langgraph.store.base import BaseStore

    notes = {"put": (_put, "langgraph.store_put"), "get": (_read, "langgraph.store_read"),
             "search": (_read, "langgraph.store_read")}
    return [(BaseStore, prefix + name, functools.partial(_hook(note, where, bool(prefix)), state))
            for name, (note, where) in notes.items() for prefix in ("", "a")]
