"""Captured runs and their tasks, shared by both tiers.

A ``_Run`` is one captured graph invocation: its recorder, its tasks (in the capture state's
``tasks``, by LangGraph task id, filled by the precision tier from the Pregel loop, or by the public
tier from run metadata), and the recording order its ``depends_on`` lists keep. Runs that join one
episode share a ``_Scope`` (recording order, checkpointed threads' provenance, the tool calls asked
for), kept in the recorder's ``integration_data``. No LangGraph import here.
"""

from __future__ import annotations

import contextvars
import json
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

from ...capture import episode_context
from ...capture_errors import guarded
from ...seams import EpisodeSink, RegistryRef
from ...capture.recording import EpisodeRecorder
from .provenance import EMPTY, Task, agent_path, public_deps, seen

# Write channels of LangGraph's own (the functional API's task result and error).
ERROR, RETURN = "__error__", "__return__"
_ENV_OUTPUT_CHARS = 4000
# Episode metadata key: where the dependency graph came from.
DEPENDENCY_SOURCE = "dependency_source"
CHANNELS, PUBLIC = "langgraph_channels", "langgraph_run_metadata"

_SCOPE_KEY = "langgraph.scope"  # the recorder's ``integration_data`` key
_SCOPE_LOCK = threading.Lock()
# The run an instrumented call started (public tier: runs are found through it, not the loop). Per
# call context, like every context variable of the capture.
RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("marft_langgraph_run", default=None)


class _Scope:
    """What the runs that join one episode share: recording order (depends_on lists stay in it
    across runs), each checkpointed thread's history, by (thread_id, checkpoint_ns), the tool
    calls its model calls asked for (a tool interrupted in one run runs again in the next) and
    what its runs put in LangGraph's long-term store."""

    __slots__ = ("lock", "order", "threads", "calls", "memory", "cache")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.order: dict[str, int] = {}
        self.threads: dict[tuple[str, str], Any] = {}
        self.calls = ToolCalls()
        self.memory: dict[tuple[tuple, str], frozenset[str]] = {}  # long-term store keys (memory.py)
        self.cache: dict[tuple, frozenset[str]] = {}  # node cache key -> what the writes it filled carried


class ToolCalls:
    """The tool calls model calls asked for and which were answered (see ``tools.py``)."""

    __slots__ = ("owners", "answered_calls", "failed")

    def __init__(self) -> None:
        # tool_call_id (and name+arguments, and name alone) -> (model call id, agent, tool_call_id, arguments)
        self.owners: dict[str, tuple[str, str, str | None, str | None]] = {}
        self.answered_calls: set[tuple[str, str | None]] = set()  # (model call id, tool_call_id) answered
        # (model call id, tool_call_id) -> the failed tool step that answered it last: a retry replaces it
        self.failed: dict[tuple[str, str | None], str] = {}


def scope(rec: EpisodeRecorder) -> _Scope:
    with _SCOPE_LOCK:
        s = rec.integration_data.get(_SCOPE_KEY)
        if s is None:
            s = rec.integration_data[_SCOPE_KEY] = _Scope()
        return s


class _Run:
    """One captured graph run: where its actions go and the tasks it has seen."""

    def __init__(self, handler: CaptureHandler, recorder: EpisodeRecorder, owned: bool, task_input: Any = None):
        self.handler = handler
        self.state = handler.state  # the capture state its tasks are registered in
        self.recorder = recorder
        self.owned = owned
        self.input = task_input
        self.base: int | None = None
        # A run that owns its episode shares it with no other run: it needs no scope.
        self.scope = None if owned else scope(recorder)
        self.lock = self.scope.lock if self.scope else threading.Lock()
        self.order: dict[str, int] = self.scope.order if self.scope else {}
        self.task_ids: list[str] = []
        self.public: dict[str, Task] = {}  # public tier: tasks by checkpoint namespace
        # Tool calls asked for: per episode, so a run resumed after an interrupt finds their owners.
        self.calls = self.scope.calls if self.scope else ToolCalls()
        self.memory: dict[tuple[tuple, str], frozenset[str]] = self.scope.memory if self.scope else {}
        self.cache: dict[tuple, frozenset[str]] = self.scope.cache if self.scope else {}
        self.finished = False

    def sorted_ids(self, ids: Any) -> list[str]:
        if len(ids) < 2:
            return list(ids)
        return sorted(ids, key=lambda i: self.order.get(i, 1 << 60))  # recording order

    def record(self, task: Task, kind: str, fields: dict[str, Any], deps: Any, started: datetime | None,
               agent: str | None = None) -> str:
        meta = {"langgraph_node": task.node, "langgraph_steps": task.lg_steps, "langgraph_checkpoint_ns": task.ns}
        extra = fields.pop("metadata", None)
        if extra:
            meta.update(extra)
        fields["metadata"] = meta
        aid = self.recorder.record_action(
            agent or task.agent, kind=kind, step=task.step, depends_on=self.sorted_ids(deps) if deps else (),
            started_at=started, validate=False, **fields,
        )
        with self.lock:
            self.order[aid] = len(self.order)
            # A model call that raised handed nothing on: what runs after it in the task (a fallback
            # model, a retry, the node's next write) did not read it. A failed tool step stays a source:
            # its error text is what the tool node hands the model.
            if not (kind == "llm" and fields.get("error")):
                task.actions.append(aid)
        return aid

    def new_attempt(self, task: Task, attempt: int) -> None:
        """A node LangGraph runs again (a RetryPolicy; ``attempt`` 1-based) starts from its inputs:
        what the failed attempts recorded stays in the episode but is neither what the new attempt
        read nor what the task hands on (under the run's lock)."""
        if attempt > task.attempt:
            task.attempt = attempt
            task.actions = []
            task.calls = 0

    def deps_of(self, task: Task) -> frozenset[str]:
        """What the task's next action depends on (under the run's lock)."""
        if task.id in self.public:
            return public_deps(self.public.values(), task)
        return seen(task)

    def finish(self, output: Any = None, error: BaseException | None = None, closed_early: bool = False) -> None:
        if self.finished:
            return
        self.finished = True
        # Reference cycles (run <-> handler, task <-> subgraph state, caller <-> @task) are cut
        # here: left to the cyclic GC, each run's garbage would cost a collection every few runs.
        h, self.handler = self.handler, None
        tasks = self.state.tasks
        for tid in self.task_ids:
            t = tasks.pop(tid, None)
            if t is not None:
                t.children, t.pushed, t.received, t.pusher = [], [], set(), None
        self.public.clear()
        self.state.forget(self)
        rec = self.recorder
        rec.metadata.setdefault(DEPENDENCY_SOURCE, h.dependency_source())
        if h.reward_fn is not None and error is None:
            with guarded("langgraph.reward_fn", rec):
                rec.reward(float(h.reward_fn(self.input, output)), source="reward_fn")
        if closed_early:
            rec.metadata["stream_closed_early"] = True
        if self.owned:
            rec.finish("failed" if error is not None else "completed",
                       f"{type(error).__name__}: {error}" if error is not None else None)
        if h.on_finish is not None:
            h.on_finish(rec)


class CaptureHandler:
    """The settings and runs of one ``instrument``-ed call (``run`` set) or one ``capture()`` block."""

    def __init__(self, state: Any, store: EpisodeSink | None = None, reward_fn: Callable[[Any, Any], float] | None = None,
                 source: str = "langgraph", on_finish: Callable[[EpisodeRecorder], None] | None = None,
                 registry: RegistryRef | None = None):
        self.state = state  # the ``LangGraphState`` its runs register their tasks in
        self.store = store
        self.reward_fn = reward_fn
        self.source = source
        self.on_finish = on_finish
        self.registry = registry  # the adapter registry of the episodes it opens (``recorder.registry``)
        self.run: _Run | None = None
        self.precise = False  # set by the precision tier when it attaches to a loop of this handler

    def dependency_source(self) -> str:
        return CHANNELS if self.precise else PUBLIC

    def new_run(self, task_input: Any) -> _Run:
        """A run for one graph invocation; ``task_input`` is the raw input (stored JSON-safe)."""
        rec = episode_context.current_episode()
        owned = rec is None
        if owned:
            rec = EpisodeRecorder(self.store, task=task_input, source=self.source, registry=self.registry)
        else:
            rec.set_task(task_input)
            if rec.registry is None and self.registry is not None:
                rec.registry = self.registry
        return _Run(self, rec, owned, task_input)


def task_id(ns: str | None) -> str | None:
    if not ns:
        return None
    return ns.rsplit("|", 1)[-1].rpartition(":")[2] or None


def find_task(state: Any, meta: dict[str, Any]) -> Task | None:
    """The captured task a LangChain run (model or tool call) with this metadata runs in."""
    ns = meta.get("langgraph_checkpoint_ns")
    tasks = state.tasks
    t = tasks.get(task_id(ns)) if tasks and ns else None
    if t is not None:
        return t
    run = RUN.get()
    if run is None or run.finished or run.handler is None or run.handler.precise or ns is None:
        return None
    return _public_task(run, ns, meta)


def _public_task(run: _Run, ns: str, meta: dict[str, Any]) -> Task:
    """Public tier: a task known only from its run metadata (agent = node path, step = superstep)."""
    with run.lock:
        t = run.public.get(ns)
        if t is not None:
            return t
        names = [seg.partition(":")[0] for seg in ns.split("|")]
        node = str(meta.get("agent_name") or meta.get("langgraph_node") or names[-1])
        outer = run.public.get(ns.rpartition("|")[0]) if len(names) > 1 else None
        graph = meta.get("lc_agent_name") if isinstance(meta.get("lc_agent_name"), str) else None
        if run.base is None:
            run.base = run.recorder.max_step() or 0
        root = run.public.get(ns.split("|", 1)[0]) if len(names) > 1 else None
        lg_step = meta.get("langgraph_step")
        step = root.step if root is not None else (run.base + lg_step if isinstance(lg_step, int) else None)
        # The naming rule (``agent_path``); an enclosing task that made no call is known by its path only.
        agent = agent_path(outer, graph, node) if outer is not None or len(names) == 1 else \
            agent_path(None, graph, "/".join([*names[:-1], node]))
        t = Task(ns, run, agent, str(meta.get("langgraph_node") or names[-1]), step,
                 [lg_step] if isinstance(lg_step, int) else [], ns, EMPTY)
        t.graph_name = graph
        run.public[ns] = t
        return t


def record_env(t: Task, writes: Any) -> None:
    """A task that called no model: an environment step, recorded (not trained)."""
    err = next((str(v) for c, v in writes if c == ERROR), None)
    returned = [v for c, v in writes if c == RETURN]
    if returned:  # a functional-API task: its output is its result
        out_text = returned[0] if isinstance(returned[0], str) else json.dumps(returned[0], default=str)
    else:
        out = {c: v for c, v in writes if not c.startswith(("__", "branch:"))}
        out_text = json.dumps(out, default=str) if out else ""
    t.run.record(t, "env", {"output": {"text": out_text[:_ENV_OUTPUT_CHARS]}, "error": err}, t.deps, t.started)
