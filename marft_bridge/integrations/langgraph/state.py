"""The LangGraph capture's state: everything it keeps while an app is instrumented or a
``capture()`` block is open, and what the other integrations see of it (the running task).

``LangGraphState`` is created by the first ``instrument(app)`` / ``capture()`` and dropped with the
last (``instrumentation.LANGGRAPH``, an ``episode_context.Instrumentor``). ``start()`` applies the
precision tier's hooks (on supported LangGraph versions), points the callback handler at it and
instruments the ``openai`` client capture; ``stop()`` undoes all three. Nothing is registered at
import time.
"""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any
from uuid import UUID

from ...capture.episode_context import CaptureState
from ...capture.recording import EpisodeRecorder
from .. import openai as oa
from . import callbacks, precision
from .provenance import Task
from .runs import RUN, find_task
from .tools import current_tool_run, find_owner


class LangGraphState(CaptureState):
    """The registries of the running capture (see the module docstring)."""

    def __init__(self) -> None:
        # Tasks of captured runs by LangGraph task id (unique per checkpoint, namespace and step, so
        # one index serves every run).
        self.tasks: dict[str, Task] = {}
        self.calls: dict[UUID, Any] = {}  # model calls in flight, by LangChain run id (callbacks.py)
        self.tools: dict[UUID, Any] = {}  # tool executions in flight, by LangChain run id (tools.py)
        self.tools_lock = threading.Lock()
        # Public tier inside capture() without the precision tier: root runs by run id, and how many
        # such blocks are open (the handler then listens to chain events).
        self.roots: dict[UUID, tuple[Any, Any]] = {}
        self.roots_tracked = 0
        self.hooks = precision.hooks(self)

    def start(self) -> None:
        self.hooks.install()
        callbacks.attach(self)
        oa.OPENAI.instrument(self)

    def stop(self) -> None:
        callbacks.attach(None)
        self.hooks.uninstall()
        oa.OPENAI.uninstrument(self)

    def forget(self, run: Any) -> None:
        """A finished run's model calls and tool executions that never ended (an abandoned stream) go."""
        if self.calls:
            for rid in [rid for rid, c in list(self.calls.items()) if c.task.run is run]:
                self.calls.pop(rid, None)
        if self.tools:
            with self.tools_lock:
                for rid in [rid for rid, tr in self.tools.items() if tr.task.run is run]:
                    self.tools.pop(rid, None)

    # -- what other integrations see: the running task ---------------------------------------------

    def capturing(self) -> bool:
        """Whether a captured task may be running here: one is registered, or this context runs an
        instrumented app (the public tier finds its tasks from run metadata)."""
        return bool(self.tasks) or RUN.get() is not None

    def task(self) -> Task | None:
        if not self.capturing():
            return None
        from langchain_core.runnables.config import var_child_runnable_config

        cfg = var_child_runnable_config.get()
        if not cfg:
            return None
        t = find_task(self, cfg.get("metadata") or {})
        return t if t is not None and not t.run.finished else None

    def find_episode(self) -> EpisodeRecorder | None:
        t = self.task()
        return t.run.recorder if t is not None else None

    def current_task(self) -> TaskHandle | None:
        t = self.task()
        return TaskHandle(t) if t is not None else None

    def in_task(self) -> bool:
        return self.task() is not None

    def record_call(self, fields: dict[str, Any], started: datetime | None, kind: str) -> bool:
        """Record an action made inside a captured node as that node's agent (False when not in one):
        it gets the node's step and depends on the node's inputs and on its earlier actions."""
        t = self.task()
        if t is None:
            return False
        with t.run.lock:
            deps = t.run.deps_of(t)
            t.calls += 1
        t.run.record(t, kind, dict(fields), deps, started)
        return True


class TaskHandle:
    """The running task as ``episode_context.FrameworkTask``: what a protocol call step made in it needs."""

    __slots__ = ("_t",)

    def __init__(self, t: Task):
        self._t = t

    @property
    def agent(self) -> str:
        return self._t.agent

    @property
    def step(self) -> int | None:
        return self._t.step

    @property
    def recorder(self) -> EpisodeRecorder:
        return self._t.run.recorder

    @property
    def finished(self) -> bool:
        return self._t.run.finished

    def depends_on(self) -> list[str]:
        run = self._t.run
        with run.lock:
            return run.sorted_ids(run.deps_of(self._t))

    def record(self, kind: str, fields: dict[str, Any], depends_on: Any, started: datetime | None = None,
               agent: str | None = None) -> str:
        return self._t.run.record(self._t, kind, dict(fields), frozenset(depends_on), started, agent=agent)

    def tool_owner(self, name: str, arguments: Any) -> tuple[str, str] | None:
        owner = find_owner(self._t.run, name, arguments, None)
        return (owner[0], owner[1]) if owner is not None else None

    def tool_step(self) -> Any:
        run = self._t.run
        tr = current_tool_run(run.state)
        return tr if tr is not None and tr.task.run is run else None
