"""Which episode and which framework task the running code belongs to.

The protocol integrations share these lookups without importing each other: an adapter registers
how to find what it captures, and the others ask here. Only the standard library and the error
accounting are imported, so a lookup never pulls in the recorder.

API
---
``current_episode() -> EpisodeRecorder | None``
    The open episode of this context, if any: an explicit/implicit one (``CURRENT_EPISODE``, which
    ``recording`` sets), else the episode of a captured run this code runs inside (adapters add
    lookups with ``register_episode_finder(fn)``; the LangGraph capture uses it, so MCP/A2A/OpenAI
    calls made inside a captured node join the node's episode).

Framework tasks
    ``register_task_context(in_task, record, current=None)``: an integration that knows which
    framework task is running (the LangGraph capture: a node) registers how to probe for it, record
    into it and hand it out; ``in_framework_task()``, ``record_in_framework_task(fields, started,
    kind)`` and ``current_framework_task()`` (a ``FrameworkTask``: ``agent``, ``step``,
    ``recorder``, ``finished``, ``depends_on()``, ``record(kind, fields, depends_on, started)``) are
    what the raw-client, MCP and A2A captures call.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

from .capture_errors import capture_error, guarded


class EpisodeHandle(Protocol):
    """An open episode as the lookups here hand it out: a ``recording.EpisodeRecorder`` (which
    imports this module), named by what is read here so imports run one way."""

    id: str
    closed: bool

# The explicit or implicit episode of this context (set by ``recording.episode`` and friends).
CURRENT_EPISODE: contextvars.ContextVar[EpisodeHandle | None] = contextvars.ContextVar("marft_episode", default=None)

# -- the current episode -------------------------------------------------------------------------

_FINDERS: list[Callable[[], EpisodeHandle | None]] = []


def register_episode_finder(fn: Callable[[], EpisodeHandle | None]) -> None:
    """Let an adapter expose the episode of a run it captures without setting the context variable
    (the LangGraph capture finds its run from LangChain's runnable config inside a node)."""
    if fn not in _FINDERS:
        _FINDERS.append(fn)


def current_episode() -> EpisodeHandle | None:
    """The explicit episode of this context, else the episode of a captured run we are inside."""
    ep = CURRENT_EPISODE.get()
    if ep is not None and not ep.closed:
        return ep
    for find in _FINDERS:
        try:
            ep = find()
        except Exception as e:  # noqa: BLE001
            capture_error("recording.finder", e)
            continue
        if ep is not None and not ep.closed:
            return ep
    return None


# -- framework tasks ----------------------------------------------------------------------------
# An integration that knows which framework task is running (a LangGraph node, ...) registers how to
# record into it, so other integrations (raw openai calls, MCP tool calls) attach their actions to
# that task without importing the integration that owns it.

_TASK_CONTEXTS: list[tuple[Callable[[], bool], Callable[..., bool]]] = []
_TASK_HANDLES: list[Callable[[], Any]] = []


def register_task_context(in_task: Callable[[], bool], record: Callable[..., bool],
                          current: Callable[[], Any] | None = None) -> None:
    """``in_task()``: is a captured framework task running in this context; ``record(fields, started,
    kind)``: record an action as that task's agent (``record_action`` keyword fields), True if it did;
    ``current()``: the running task as a ``FrameworkTask`` (or None)."""
    if (in_task, record) not in _TASK_CONTEXTS:
        _TASK_CONTEXTS.append((in_task, record))
    if current is not None and current not in _TASK_HANDLES:
        _TASK_HANDLES.append(current)


class FrameworkTask(Protocol):
    """A running framework task (a LangGraph node), for call steps made inside it (MCP, A2A): its
    ``agent``, ``step``, ``recorder``, whether its run ``finished``, ``depends_on()`` (its inputs and
    earlier actions, in recording order) and ``record(kind, fields, depends_on, started)``, which
    records an action as one of the task's own (``fields``: ``record_action`` keywords)."""

    agent: str
    step: int | None
    recorder: EpisodeHandle
    finished: bool

    def depends_on(self) -> list[str]: ...

    def record(self, kind: str, fields: dict[str, Any], depends_on: Any, started: datetime | None = None) -> str: ...


def current_framework_task() -> FrameworkTask | None:
    """The captured framework task running in this context, if any."""
    for current in _TASK_HANDLES:
        with guarded("recording.task_context"):
            t = current()
            if t is not None:
                return t
    return None


def in_framework_task() -> bool:
    with guarded("recording.task_context"):
        return any(probe() for probe, _ in _TASK_CONTEXTS)
    return False


def record_in_framework_task(fields: dict[str, Any], started: datetime | None = None, kind: str = "llm") -> bool:
    """Record an action made inside a captured framework task as that task's agent (False when in none)."""
    with guarded("recording.task_context"):
        return any(record(fields, started, kind) for _, record in _TASK_CONTEXTS)
    return False
