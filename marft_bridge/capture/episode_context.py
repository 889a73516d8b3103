"""Which episode and which framework task the running code belongs to, and the integrations that
are instrumented now.

Every integration keeps what it captures in one state object (``CaptureState``) that exists only
while it is instrumented: ``Instrumentor.instrument(holder)`` creates and starts it for the first
holder (an app, a ``capture()`` block, an episode, the user), ``uninstrument(holder)`` stops and
drops it with the last; both are idempotent, and nothing is registered at import time. A started
state is *active* here, so the other integrations find what it captures without importing it.
Only the standard library and the error accounting are imported, so a lookup never pulls in the
recorder.

API
---
``current_episode() -> EpisodeRecorder | None``
    The open episode of this context, if any: an explicit/implicit one (``CURRENT_EPISODE``, which
    ``recording`` sets), else the episode of a captured run this code runs inside (an active
    state's ``find_episode()``: the LangGraph capture finds its run from LangChain's runnable
    config, so MCP/A2A/OpenAI calls made inside a captured node join the node's episode).

Framework tasks
    An active state that knows which framework task is running (the LangGraph capture: a node; the
    Agents SDK capture: an agent's span) answers ``current_task()`` (a ``FrameworkTask``) and
    ``in_task()`` / ``record_call(fields, started, kind)``; ``current_framework_task()``, ``in_framework_task()``
    and ``record_in_framework_task(fields, started, kind)`` are what the raw-client, MCP and A2A
    captures call.

Finished episodes
    An active state's ``episode_finished(episode)`` is called with every finished episode
    (``recording.add_episode_listener`` is such a state); ``listening()`` says whether any is.

Module-level state here is the ``CURRENT_EPISODE`` context variable (per call context, the place
context variables live) and ``_ACTIVE``, the one process-wide list of started integration states
(with the bound lookups derived from it, rebuilt on every start/stop, so a lookup reads a tuple).
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

from ..capture_errors import capture_error, guarded


class EpisodeHandle(Protocol):
    """An open episode as the lookups here hand it out: a ``recording.EpisodeRecorder`` (which
    imports this module), named by what is read here so imports run one way."""

    id: str
    closed: bool


class FrameworkTask(Protocol):
    """A running framework task (a LangGraph node), for call steps made inside it (MCP, A2A): its
    ``agent``, ``step``, ``recorder``, whether its run ``finished``, ``depends_on()`` (its inputs and
    earlier actions, in recording order), ``record(kind, fields, depends_on, started, agent=None)``,
    which records an action as one of the task's own (``fields``: ``record_action`` keywords;
    ``agent``: another agent than the task's, e.g. the one whose model call asked for a tool),
    ``tool_owner(name, arguments)``: ``(model call id, agent)`` of the call that asked for this
    tool call, and ``tool_step()``: the tool step running in this context (a ``ToolStep``)."""

    agent: str
    step: int | None
    recorder: EpisodeHandle
    finished: bool

    def depends_on(self) -> list[str]: ...

    def record(self, kind: str, fields: dict[str, Any], depends_on: Any, started: datetime | None = None,
               agent: str | None = None) -> str: ...

    def tool_owner(self, name: str, arguments: Any) -> tuple[str, str] | None: ...

    def tool_step(self) -> ToolStep | None: ...


class ToolStep(Protocol):
    """A tool step being executed (a LangChain tool run), recorded when it ends under the id
    ``action_id``. A protocol call made inside it (an MCP ``tools/call``) is that step, not one of
    its own: ``enrich(metadata, depends_on, on_recorded)`` adds its details and dependencies, and
    ``on_recorded(recorded)`` is called once the step is recorded (True) or dropped (False)."""

    action_id: str
    agent: str | None
    step: int | None

    def depends_on(self) -> list[str]: ...

    def enrich(self, metadata: dict[str, Any], depends_on: Any, on_recorded: Callable[[bool], None]) -> None: ...


class CaptureState:
    """What one integration keeps while it is instrumented. ``start()``/``stop()`` apply and remove
    its hooks; the lookups return None unless the integration overrides them."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def find_episode(self) -> EpisodeHandle | None:
        return None

    def current_task(self) -> FrameworkTask | None:
        return None

    def in_task(self) -> bool:
        """Whether a task of this integration is running here (one that ``record_call`` records into)."""
        return False

    def record_call(self, fields: dict[str, Any], started: datetime | None, kind: str) -> bool:
        return False

    def episode_finished(self, episode: Any) -> None:
        pass


class Instrumentor:
    """Start/stop of one integration, like an OpenTelemetry instrumentor: ``instrument(holder)``
    creates the state (``make_state()``) and starts it for the first holder; ``uninstrument(holder)``
    stops and drops it when the last holder goes; both idempotent (a holder counts once). ``holder``
    None is the process itself (the user's own ``instrument()``). ``weak``: holders that are garbage
    collected stop counting (apps), else they are kept until uninstrumented (listener functions)."""

    def __init__(self, make_state: Callable[[], CaptureState], weak: bool = False):
        self._make = make_state
        self._weak = weak
        # Holders by identity (an app or client need not be hashable): a weak reference, or the object.
        self._holders: dict[int, Any] = {}
        self.lock = threading.RLock()
        self.state: Any = None

    def _held(self) -> dict[int, Any]:
        """The live holders by id (collected ones are dropped)."""
        live = {}
        for key, ref in self._holders.items():
            obj = ref() if isinstance(ref, weakref.ref) else ref
            if obj is not None:
                live[key] = obj
        self._holders = {k: self._holders[k] for k in live}
        return live

    def _key(self, holder: Any) -> int | None:
        """The key ``holder`` is held under: by identity, or for kept holders by equality (a bound
        method is a new object each time it is read)."""
        ref = self._holders.get(id(holder))
        if ref is not None and (ref() if isinstance(ref, weakref.ref) else ref) is holder:
            return id(holder)
        if not self._weak:
            return next((k for k, h in self._held().items() if h == holder), None)
        return None

    def instrument(self, holder: Any = None) -> Any:
        holder = self if holder is None else holder
        state = self.state
        if state is not None and holder is self and id(self) in self._holders:
            return state  # the process holds it already (an ``episode()`` block on entry)
        with self.lock:
            if self._key(holder) is None:
                try:
                    self._holders[id(holder)] = weakref.ref(holder) if self._weak else holder
                except TypeError:  # not weakly referenceable: held until uninstrumented
                    self._holders[id(holder)] = holder
            if self.state is None:
                state = self._make()
                state.start()
                self.state = state
                _activate(state)
            return self.state

    def uninstrument(self, holder: Any = None) -> None:
        with self.lock:
            holder = self if holder is None else holder
            key = self._key(holder)
            if key is not None:
                del self._holders[key]
            if not self._held() and self.state is not None:
                self._drop()

    def uninstrument_all(self) -> None:
        with self.lock:
            self._holders.clear()
            if self.state is not None:
                self._drop()

    def _drop(self) -> None:
        state, self.state = self.state, None
        _deactivate(state)
        with guarded("capture.stop"):
            state.stop()

    def holders(self) -> list[Any]:
        with self.lock:
            return [h for h in self._held().values() if h is not self]

    @property
    def instrumented(self) -> bool:
        return self.state is not None


# The explicit or implicit episode of this context (set by ``recording.episode`` and friends).
CURRENT_EPISODE: contextvars.ContextVar[EpisodeHandle | None] = contextvars.ContextVar("marft_episode", default=None)

_ACTIVE: tuple[CaptureState, ...] = ()
_ACTIVE_LOCK = threading.Lock()
# Bound lookups of the active states that override them (read on every call; rebuilt on start/stop).
_FINDERS: tuple[Callable[[], Any], ...] = ()
_TASKS: tuple[Callable[[], Any], ...] = ()
_PROBES: tuple[Callable[[], bool], ...] = ()
_RECORDERS: tuple[Callable[..., bool], ...] = ()
_LISTENERS: tuple[Callable[[Any], None], ...] = ()


def _overridden(state: CaptureState, name: str) -> bool:
    return getattr(type(state), name) is not getattr(CaptureState, name)


def _rebuild() -> None:
    global _FINDERS, _TASKS, _PROBES, _RECORDERS, _LISTENERS
    _FINDERS = tuple(s.find_episode for s in _ACTIVE if _overridden(s, "find_episode"))
    _TASKS = tuple(s.current_task for s in _ACTIVE if _overridden(s, "current_task"))
    _PROBES = tuple(s.in_task for s in _ACTIVE if _overridden(s, "in_task"))
    _RECORDERS = tuple(s.record_call for s in _ACTIVE if _overridden(s, "record_call"))
    _LISTENERS = tuple(s.episode_finished for s in _ACTIVE if _overridden(s, "episode_finished"))


def _activate(state: CaptureState) -> None:
    global _ACTIVE
    with _ACTIVE_LOCK:
        _ACTIVE = (*_ACTIVE, state)
        _rebuild()


def _deactivate(state: CaptureState) -> None:
    global _ACTIVE
    with _ACTIVE_LOCK:
        _ACTIVE = tuple(s for s in _ACTIVE if s is not state)
        _rebuild()


def active_states() -> tuple[CaptureState, ...]:
    """The started integration states, in start order (for tests and diagnostics)."""
    return _ACTIVE


# -- the current episode -------------------------------------------------------------------------


# The ``marft_bridge.capture`` block open in this context (an object with ``store``, ``registry``,
# ``episode_ids``): integrations that open episodes of their own (the Agents SDK's runs) join it.
OPEN_CAPTURE: contextvars.ContextVar[Any] = contextvars.ContextVar("marft_open_capture", default=None)


def open_capture() -> Any:
    return OPEN_CAPTURE.get()


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


def current_framework_task() -> FrameworkTask | None:
    """The captured framework task running in this context, if any."""
    for current in _TASKS:
        with guarded("recording.task_context"):
            t = current()
            if t is not None:
                return t
    return None


def in_framework_task() -> bool:
    for probe in _PROBES:
        with guarded("recording.task_context"):
            if probe():
                return True
    return False


def record_in_framework_task(fields: dict[str, Any], started: datetime | None = None, kind: str = "llm") -> bool:
    """Record an action made inside a captured framework task as that task's agent (False when in none)."""
    for record in _RECORDERS:
        with guarded("recording.task_context"):
            if record(fields, started, kind):
                return True
    return False


# -- finished episodes ---------------------------------------------------------------------------


def listening() -> bool:
    return bool(_LISTENERS)


def episode_finished(episode: Any) -> None:
    """Hand a finished episode to the active states that take it (each guarded)."""
    for fn in _LISTENERS:
        with guarded(f"recording.listener {getattr(fn, '__qualname__', fn)}"):
            fn(episode)
