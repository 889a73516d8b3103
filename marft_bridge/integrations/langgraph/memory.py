"""LangGraph's long-term store (``BaseStore``: ``runtime.store``, an injected ``store``,
``get_store()``) as a data path: what a captured task puts under a key carries what the task had
made or read when it put it, and a task that reads the key (``get``, or ``search`` returning it)
depends on that from then on — within a run, and across the runs of one episode (another thread
reading a memory an earlier run saved). Keys are ``(namespace, key)``; the provenance lives in the
run (its episode's scope when runs share one). Hooks of the precision tier (``precision._targets``)
on ``BaseStore``'s public ``put``/``get``/``search`` and their async forms, pass-through.
"""

from __future__ import annotations

from typing import Any

from ...capture_errors import capture_error
from .provenance import EMPTY
from .runs import find_task


def _task(state: Any) -> Any:
    if not state.tasks:
        return None
    from langchain_core.runnables.config import var_child_runnable_config

    cfg = var_child_runnable_config.get() or {}
    return find_task(state, cfg.get("metadata") or {})


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


def _put(state: Any, args: tuple, kwargs: dict) -> None:
    task = _task(state)
    if task is None:
        return
    run = task.run
    key = (tuple(_arg(args, kwargs, 0, "namespace") or ()), str(_arg(args, kwargs, 1, "key")))
    with run.lock:
        # What the task made so far (the model call whose answer it saves), else what it read.
        run.memory[key] = frozenset(task.actions) or task.deps


def _read(state: Any, items: Any) -> None:
    if items is None:
        return
    task = _task(state)
    if task is None:
        return
    run = task.run
    found = items if isinstance(items, list) else [items]
    with run.lock:
        prov = EMPTY.union(*(run.memory.get((tuple(getattr(i, "namespace", ())), str(getattr(i, "key", ""))), EMPTY)
                             for i in found))
        if prov - task.deps:
            task.deps = task.deps | prov


def put(state: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    out = wrapped(*args, **kwargs)
    try:
        _put(state, args, kwargs)
    except Exception as e:  # noqa: BLE001 - capture must not break the app
        capture_error("langgraph.store_put", e)
    return out


async def aput(state: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    out = await wrapped(*args, **kwargs)
    try:
        _put(state, args, kwargs)
    except Exception as e:  # noqa: BLE001
        capture_error("langgraph.store_put", e)
    return out


def read(state: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    out = wrapped(*args, **kwargs)
    try:
        _read(state, out)
    except Exception as e:  # noqa: BLE001
        capture_error("langgraph.store_read", e)
    return out


async def aread(state: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    out = await wrapped(*args, **kwargs)
    try:
        _read(state, out)
    except Exception as e:  # noqa: BLE001
        capture_error("langgraph.store_read", e)
    return out


def targets(state: Any) -> list[tuple[Any, str, Any]]:
    import functools

    from langgraph.store.base import BaseStore

    def bound(fn: Any) -> Any:
        return functools.partial(fn, state)

    return [(BaseStore, "put", bound(put)), (BaseStore, "aput", bound(aput)),
            (BaseStore, "get", bound(read)), (BaseStore, "aget", bound(aread)),
            (BaseStore, "search", bound(read)), (BaseStore, "asearch", bound(aread))]
