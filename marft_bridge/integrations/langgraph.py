"""Capture LangGraph runs as Flex-POMDP episodes.

``instrument(app, store=None, reward_fn=None)`` wraps a compiled graph in place (and returns it):
``invoke``/``ainvoke``/``stream``/``astream`` (and ``batch``/``abatch``, which call them) return
exactly what they did, and each run becomes one Episode (``app.last_episode_id``); inside
``marft_bridge.episode(...)`` runs join that episode instead. ``uninstrument(app)`` undoes it.
``with capture(store=...):`` captures every graph run started in the block, for apps built
elsewhere. ``reward_fn(inputs, outputs) -> float`` adds a team reward per run (for streams,
``outputs`` is the list of streamed chunks).

What becomes what:
- An agent is a node, or the node's ``metadata={"agent_name": ...}``; nodes of subgraphs are
  named by their path (``"team/researcher"``). Each chat-model call inside a node is an ``llm``
  action: the capture hooks LangChain's callback managers at class level (every call path
  reports there: invoke, stream, batch, structured output, tool binding) without adding a
  callback handler to the app. A direct ``openai`` client call in a node is an action too (see
  ``integrations.openai``). A node that calls no model is recorded as an ``env`` action (not trained).
- ``Action.step`` is the LangGraph superstep (offset so later runs of one episode come after
  earlier ones); actions of a subgraph take the superstep of the parent node that ran it, and
  the raw steps are kept in ``metadata["langgraph_steps"]``.
- ``depends_on`` follows the data, not the clock: the capture hooks LangGraph's Pregel loop
  (``tick`` / ``after_tick``) and keeps, per channel, the actions whose output the channel's
  current value came from (reducer channels accumulate, plain channels are replaced, cleared
  channels are dropped). A task depends on the provenance of the channels its node reads and
  of its triggers; a ``Send`` task on the task that sent it; a subgraph's first step on the
  parent task's inputs, and the parent's writes carry the subgraph's output provenance. Model
  calls later in the same node also depend on the node's earlier calls. Env nodes pass
  provenance along through their own action. Functional-API ``@task`` calls (``accept_push``)
  are agents named after the task, at the caller's step. A task's output reaches its caller
  through its future, which the capture hands over noting reads (``.result()``, ``await``): a
  task, or a model call of the entrypoint or task itself, depends on the caller's inputs, its
  earlier calls and the results it had read before starting it; a result never read gives no
  edge. A task that calls no model is recorded as an env action when its result is read.
- Runs on a checkpointed thread read what earlier runs there wrote. Runs that join one episode
  keep that provenance per (``thread_id``, ``checkpoint_ns``), so a later run depends on the
  earlier runs' actions as if it were one run; on ``Command(resume=...)`` the interrupted step's
  tasks keep their inputs, and those that had finished are not recorded again. A channel a
  captured run did not write since (``update_state``, ``Command(update=...)``) loses its old
  provenance unless it accumulates. A run that is an episode of its own starts without history:
  the earlier writers are in other episodes, and there are no edges across episodes. The history
  belongs to the episode's recorder and goes with it.

Capture never breaks the app: every hook runs under ``recording.guarded`` (errors logged and
counted in ``recording.capture_stats()``), and episodes are written through ``store.submit``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import json
import threading
import weakref
from collections.abc import Callable
from datetime import datetime
from typing import Any
from uuid import UUID

from .. import recording
from ..recording import EpisodeRecorder, capture_error, guarded
from ..schema import utcnow
from . import openai as oa

_PUSH = "__pregel_push"
_TASKS = "__pregel_tasks"
_ERROR = "__error__"
_RETURN = "__return__"  # the channel a functional-API task's result is written to
# The value an entrypoint saved on its thread (functional API): every task is handed it.
_PREVIOUS = "__previous__"
# Channel types whose value accumulates every write (so provenance accumulates too).
_ACCUMULATING = {"BinaryOperatorAggregate", "Topic", "NamedBarrierValue", "NamedBarrierValueAfterFinish"}
_ENV_OUTPUT_CHARS = 4000

# Config key that marks an instrumented run; "__" keeps it out of checkpoint metadata.
_MARK = "__marft_capture"
_CAPTURE_HANDLER: contextvars.ContextVar[CaptureHandler | None] = contextvars.ContextVar(
    "marft_langgraph_capture", default=None
)
# Tasks of captured runs by LangGraph task id, and model calls in flight by LangChain run id.
# Task ids are unique per checkpoint, namespace and step, so one registry serves every run.
_TASK_INDEX: dict[str, _Task] = {}
_CALLS: dict[UUID, _Call] = {}
# What runs that join an episode share, by episode. Weak keys: it goes with its recorder.
_SCOPES: weakref.WeakKeyDictionary[EpisodeRecorder, _Scope] = weakref.WeakKeyDictionary()
_SCOPES_LOCK = threading.Lock()


# -- records of one run --------------------------------------------------------------------------


class _Task:
    """One LangGraph task (a node execution) of a captured run."""

    __slots__ = ("id", "run", "agent", "node", "step", "lg_steps", "ns", "deps", "actions", "children", "internal",
                 "calls", "started", "pushed", "pusher", "received")

    def __init__(self, id: str, run: _Run, agent: str, node: str, step: int, lg_steps: list[int], ns: str,
                 deps: frozenset[str], internal: bool):
        self.id = id
        self.run = run
        self.agent = agent
        self.node = node
        self.step = step
        self.lg_steps = lg_steps
        self.ns = ns
        self.deps = deps
        self.actions: list[str] = []
        self.children: list[_LoopState] = []
        self.internal = internal
        self.calls = 0  # model calls seen, recorded or not
        self.started = utcnow()
        self.pushed: list[_Task] = []  # functional-API tasks this task started (``@task`` calls)
        self.pusher: _Task | None = None
        self.received: set[_Task] = set()  # those of them whose result it has read


class _LoopState:
    """Provenance of one Pregel loop's channels (a root graph or a subgraph)."""

    __slots__ = ("loop", "run", "parent", "prov", "sends", "seen", "resumed")

    def __init__(self, loop: Any, run: _Run, parent: _Task | None):
        self.loop = loop
        self.run = run
        self.parent = parent
        self.prov: dict[str, frozenset[str]] = {}
        self.sends: dict[int, tuple[Any, frozenset[str]]] = {}  # id(Send.arg) -> (Send, provenance)
        self.seen: set[str] = set()
        self.resumed: dict[str, tuple[frozenset[str], list[str]]] = {}  # see _ThreadHistory.stopped

    def output_provenance(self) -> frozenset[str]:
        keys = self.loop.output_keys
        keys = [keys] if isinstance(keys, str) else keys
        return frozenset().union(*(self.prov.get(k, frozenset()) for k in keys))


class _ThreadHistory:
    """What a run leaves on a checkpointed thread for the next run of the same episode there: the
    provenance of its channels, their versions then, and the tasks of the step it stopped in
    (interrupted or failed): id -> (deps, actions). Those run again on resume, with the same
    inputs, or hand back the writes they saved."""

    __slots__ = ("prov", "versions", "stopped")

    def __init__(self, st: _LoopState):
        self.prov = st.prov
        self.versions = dict(st.loop.checkpoint["channel_versions"])
        self.stopped = {tid: (t.deps, list(t.actions)) for tid in st.loop.tasks
                        if (t := _TASK_INDEX.get(tid)) is not None}


class _Scope:
    """What the runs that join one episode share: recording order (depends_on lists stay in it
    across runs) and each checkpointed thread's history, by (thread_id, checkpoint_ns)."""

    __slots__ = ("lock", "order", "threads")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.order: dict[str, int] = {}
        self.threads: dict[tuple[str, str], _ThreadHistory] = {}


def _scope(rec: EpisodeRecorder) -> _Scope:
    with _SCOPES_LOCK:
        scope = _SCOPES.get(rec)
        if scope is None:
            scope = _SCOPES[rec] = _Scope()
        return scope


class _Run:
    """One captured graph run: where its actions go and the tasks it has seen."""

    def __init__(self, handler: CaptureHandler, recorder: EpisodeRecorder, owned: bool, task_input: Any = None):
        self.handler = handler
        self.recorder = recorder
        self.owned = owned
        self.input = task_input
        self.base: int | None = None
        # A run that owns its episode shares it with no other run: it needs no scope.
        self.scope = None if owned else _scope(recorder)
        self.lock = self.scope.lock if self.scope else threading.Lock()
        self.order: dict[str, int] = self.scope.order if self.scope else {}
        self.task_ids: list[str] = []
        self.finished = False

    def sorted_ids(self, ids: Any) -> list[str]:
        if len(ids) < 2:
            return list(ids)
        return sorted(ids, key=lambda i: self.order.get(i, 1 << 60))  # recording order

    def record(self, task: _Task, kind: str, fields: dict[str, Any], deps: Any, started: datetime | None) -> str:
        meta = {"langgraph_node": task.node, "langgraph_steps": task.lg_steps, "langgraph_checkpoint_ns": task.ns}
        extra = fields.pop("metadata", None)
        if extra:
            meta.update(extra)
        fields["metadata"] = meta
        aid = self.recorder.record_action(
            task.agent, kind=kind, step=task.step, depends_on=self.sorted_ids(deps) if deps else (),
            started_at=started, validate=False, **fields,
        )
        with self.lock:
            self.order[aid] = len(self.order)
            task.actions.append(aid)
        return aid

    def finish(self, output: Any = None, error: BaseException | None = None, closed_early: bool = False) -> None:
        if self.finished:
            return
        self.finished = True
        # Reference cycles (run <-> handler, task <-> subgraph state, caller <-> @task) are cut
        # here: left to the cyclic GC, each run's garbage would cost a collection every few runs.
        h, self.handler = self.handler, None
        for tid in self.task_ids:
            t = _TASK_INDEX.pop(tid, None)
            if t is not None:
                t.children, t.pushed, t.received, t.pusher = [], [], set(), None
        if _CALLS:  # model calls that never ended (an abandoned stream): forget them
            for rid in [rid for rid, c in list(_CALLS.items()) if c.task.run is self]:
                _CALLS.pop(rid, None)
        rec = self.recorder
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


# -- message conversion --------------------------------------------------------------------------

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "function",
          "HumanMessageChunk": "user", "AIMessageChunk": "assistant", "SystemMessageChunk": "system",
          "ToolMessageChunk": "tool", "FunctionMessageChunk": "function"}


def _tool_calls(msg: Any) -> list[dict] | None:
    calls = getattr(msg, "tool_calls", None)
    if not calls:
        return None
    return [
        {"id": c.get("id"), "type": "function",
         "function": {"name": c.get("name"), "arguments": json.dumps(c.get("args"), default=str)}}
        for c in calls
    ]


def _message(m: Any) -> dict[str, Any]:
    # Fields are read by message type: a missing attribute on a pydantic message costs microseconds.
    kind = getattr(m, "type", "")
    role = _ROLES.get(kind) or (str(getattr(m, "role", "user")) if kind in ("chat", "ChatMessageChunk") else "user")
    out: dict[str, Any] = {"role": role, "content": oa._text(getattr(m, "content", None))}
    if getattr(m, "name", None):
        out["name"] = m.name
    if role == "tool" and getattr(m, "tool_call_id", None):
        out["tool_call_id"] = m.tool_call_id
    elif role == "assistant":
        tc = _tool_calls(m)
        if tc:
            out["tool_calls"] = tc
    return out


_EMPTY: dict = {}


def _sampling(params: dict[str, Any]) -> dict[str, Any] | None:
    extra = params.get("extra_body") or _EMPTY
    s = {}
    for k in ("temperature", "top_p", "top_k", "seed"):
        v = params.get(k, extra.get(k)) if extra else params.get(k)
        if v is not None:
            s[k] = v
    v = params.get("max_tokens") or params.get("max_completion_tokens")
    if v is not None:
        s["max_tokens"] = v
    stop = params.get("stop")
    if stop is not None:
        s["stop"] = [stop] if isinstance(stop, str) else stop
    return s or None


# -- run settings --------------------------------------------------------------------------------


class _Call:
    __slots__ = ("task", "deps", "messages", "params", "model", "started", "sink", "sink_token")

    def __init__(self, task: _Task, deps: frozenset[str], messages: list[dict], params: dict, model: str,
                 sink: oa.RawCall, sink_token: Any):
        self.task = task
        self.deps = deps
        self.messages = messages
        self.params = params
        self.model = model
        self.started = utcnow()
        self.sink = sink
        self.sink_token = sink_token


class CaptureHandler:
    """The settings and runs of one ``instrument``-ed call (``run`` set) or one ``capture()`` block.

    It travels in the run's config (``configurable["__marft_capture"]``) or in the capture
    block's context; the Pregel hooks find it there. Model calls are seen through class-level
    hooks on LangChain's callback managers, so capture adds no callback handler to the app.
    """

    def __init__(self, store: Any = None, reward_fn: Callable[[Any, Any], float] | None = None,
                 source: str = "langgraph", on_finish: Callable[[EpisodeRecorder], None] | None = None,
                 registry: Any = None):
        self.store = store
        self.registry = registry  # the adapter registry of the episodes it opens (``recorder.registry``)
        self.reward_fn = reward_fn
        self.source = source
        self.on_finish = on_finish
        self.run: _Run | None = None

    def new_run(self, task_input: Any) -> _Run:
        """A run for one graph invocation; ``task_input`` is the raw input (stored JSON-safe)."""
        rec = recording.current_episode()
        owned = rec is None
        if owned:
            rec = EpisodeRecorder(self.store, task=task_input, source=self.source, registry=self.registry)
        else:
            rec.set_task(task_input)
            if rec.registry is None and self.registry is not None:
                rec.registry = self.registry
        return _Run(self, rec, owned, task_input)

    # Pregel loop events -----------------------------------------------------------------------

    def attach(self, loop: Any) -> _LoopState | None:
        ns = (loop.config.get("configurable") or {}).get("checkpoint_ns") or ""
        parent = _TASK_INDEX.get(_task_id(ns)) if ns else None
        if parent is not None:
            st = _LoopState(loop, parent.run, parent)
            parent.children.append(st)
        elif self.run is None:  # capture(): every root graph run is a run of its own
            run = self.new_run(loop.input)
            st = _LoopState(loop, run, None)
            loop.__dict__["_marft_owns_run"] = run
        elif self.run.base is not None:
            return None  # a second root loop under one instrumented call: not ours
        else:
            st = _LoopState(loop, self.run, None)
        if parent is None:
            st.run.base = st.run.recorder.max_step() or 0
        _restore_history(st)
        return st


# -- checkpointed threads: provenance from earlier runs of the same episode -----------------------
# A run on a checkpointed thread reads what earlier runs there wrote. Inside one episode it depends
# on them as if it were one run; a run that is its episode of its own starts without history (the
# earlier writers are in other episodes: no edges across episodes).


def _thread_key(st: _LoopState) -> tuple[str, str] | None:
    """Where the loop's channels and the run's episode both outlive the run: (thread_id, checkpoint_ns)."""
    loop = st.loop
    conf = loop.config.get("configurable") or {}
    if st.run.scope is None or loop.checkpointer is None or conf.get("thread_id") is None:
        return None
    return str(conf["thread_id"]), conf.get("checkpoint_ns") or ""


def _restore_history(st: _LoopState) -> None:
    key = _thread_key(st)
    # Taken, not read: the loop leaves its own history when it exits (a finished subgraph none).
    hist = st.run.scope.threads.pop(key, None) if key else None
    if hist is None:
        return
    versions, channels = st.loop.checkpoint["channel_versions"], st.loop.channels
    # A plain channel changed since (update_state, Command(update=...), an uncaptured run) no
    # longer holds what the recorded actions wrote; an accumulating one still holds it too.
    st.prov = {ch: p for ch, p in hist.prov.items()
               if versions.get(ch) == hist.versions.get(ch) or type(channels.get(ch)).__name__ in _ACCUMULATING}
    st.resumed = hist.stopped


def _save_history(st: _LoopState, exc: BaseException | None) -> None:
    key = _thread_key(st)
    if key is None or st.run.recorder.closed:
        return
    from langgraph.errors import GraphInterrupt

    # A subgraph's namespace names its parent task: only resuming that interrupted task reruns it.
    if st.parent is None or isinstance(exc, GraphInterrupt):
        st.run.scope.threads[key] = _ThreadHistory(st)


def _task_id(ns: str | None) -> str | None:
    if not ns:
        return None
    return ns.rsplit("|", 1)[-1].rpartition(":")[2] or None


# -- model calls: class-level hooks on LangChain's callback managers -----------------------------
# LangChain calls these for every chat-model/LLM call (invoke, batch, stream, structured output,
# tool binding), handlers or not; with nothing captured each hook costs one dict check.


def _start_calls(manager: Any, serialized: dict, messages: list, managers: list, kw: dict) -> None:
    meta = manager.metadata or {}
    task = _TASK_INDEX.get(_task_id(meta.get("langgraph_checkpoint_ns")))
    if task is None:
        return
    params = kw.get("invocation_params") or {}
    model = str(params.get("model") or params.get("model_name") or meta.get("ls_model_name")
                or (serialized or {}).get("name") or params.get("_type") or "unknown")
    single = len(managers) == 1
    for msgs, rm in zip(messages, managers):
        with task.run.lock:
            deps = _seen(task)
            task.calls += 1
        sink = oa.RawCall()
        token = oa.RAW_SINK.set(sink) if single else None  # the raw response pairs with a lone call only
        converted = [m if isinstance(m, dict) else _message(m) for m in msgs]
        _CALLS[rm.run_id] = _Call(task, deps, converted, params, model, sink, token)


def _safe_start(manager: Any, serialized: dict, messages: list, managers: list, kw: dict) -> None:
    try:
        _start_calls(manager, serialized, messages, managers, kw)
    except Exception as e:  # noqa: BLE001 - capture must not break the app
        capture_error("langgraph.model_start", e)


def _end_call(run_id: UUID, response: Any = None, error: BaseException | None = None) -> None:
    call = _CALLS.pop(run_id, None)
    if call is None:
        return
    call.sink.done = True
    if call.sink_token is not None:
        try:
            oa.RAW_SINK.reset(call.sink_token)
        except ValueError:  # ended in another context; the done flag already disarms it
            pass
    try:
        if error is not None:
            fields = {"observation": {"messages": call.messages}, "policy": {"name": call.model},
                      "sampling": _sampling(call.params), "error": f"{type(error).__name__}: {error}"}
        elif call.sink.response is not None:
            fields = oa.completion_fields(call.sink.request or {}, call.sink.response)
            fields["observation"]["messages"] = call.messages or fields["observation"]["messages"]
        else:
            fields = _fields_from_generation(call, response)
        call.task.run.record(call.task, "llm", fields, call.deps, call.started)
    except Exception as e:  # noqa: BLE001
        capture_error("langgraph.llm_end", e, call.task.run.recorder)


def _fields_from_generation(call: _Call, response: Any) -> dict[str, Any]:
    gen = response.generations[0][0]
    msg = getattr(gen, "message", None)
    info = gen.generation_info or {}
    rmeta = getattr(msg, "response_metadata", None) or {}
    logprobs = info.get("logprobs") or rmeta.get("logprobs")
    ids, lps, problem = oa.token_data(logprobs, None) if logprobs else (None, None, None)
    return {
        "observation": {"messages": call.messages},
        "output": {"text": gen.text or "", "token_ids": ids, "logprobs": lps, "tool_calls": _tool_calls(msg),
                   "finish_reason": info.get("finish_reason") or rmeta.get("finish_reason")},
        "sampling": _sampling(call.params),
        "policy": {"name": call.model},
        "metadata": {"token_data_dropped": problem} if problem else {},
    }


def _prompt_messages(prompts: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": p}] for p in prompts]


def _patch_langchain() -> None:
    from langchain_core.callbacks import manager as m

    cm, acm = m.CallbackManager, m.AsyncCallbackManager
    rm, arm = m.CallbackManagerForLLMRun, m.AsyncCallbackManagerForLLMRun
    chat, llm, achat, allm = cm.on_chat_model_start, cm.on_llm_start, acm.on_chat_model_start, acm.on_llm_start
    end, err, aend, aerr = rm.on_llm_end, rm.on_llm_error, arm.on_llm_end, arm.on_llm_error

    def on_chat_model_start(self: Any, serialized: dict, messages: list, run_id: Any = None, **kw: Any) -> Any:
        managers = chat(self, serialized, messages, run_id, **kw)
        if _TASK_INDEX:
            _safe_start(self, serialized, messages, managers, kw)
        return managers

    def on_llm_start(self: Any, serialized: dict, prompts: list, run_id: Any = None, **kw: Any) -> Any:
        managers = llm(self, serialized, prompts, run_id, **kw)
        if _TASK_INDEX:
            _safe_start(self, serialized, _prompt_messages(prompts), managers, kw)
        return managers

    async def aon_chat_model_start(self: Any, serialized: dict, messages: list, run_id: Any = None, **kw: Any) -> Any:
        managers = await achat(self, serialized, messages, run_id, **kw)
        if _TASK_INDEX:
            _safe_start(self, serialized, messages, managers, kw)
        return managers

    async def aon_llm_start(self: Any, serialized: dict, prompts: list, run_id: Any = None, **kw: Any) -> Any:
        managers = await allm(self, serialized, prompts, run_id, **kw)
        if _TASK_INDEX:
            _safe_start(self, serialized, _prompt_messages(prompts), managers, kw)
        return managers

    def on_llm_end(self: Any, response: Any, **kw: Any) -> None:
        try:
            end(self, response, **kw)
        finally:
            if _CALLS:
                _end_call(self.run_id, response)

    def on_llm_error(self: Any, error: BaseException, **kw: Any) -> None:
        try:
            err(self, error, **kw)
        finally:
            if _CALLS:
                _end_call(self.run_id, error=error)

    async def aon_llm_end(self: Any, response: Any, **kw: Any) -> None:
        try:
            await aend(self, response, **kw)
        finally:
            if _CALLS:
                _end_call(self.run_id, response)

    async def aon_llm_error(self: Any, error: BaseException, **kw: Any) -> None:
        try:
            await aerr(self, error, **kw)
        finally:
            if _CALLS:
                _end_call(self.run_id, error=error)

    cm.on_chat_model_start, cm.on_llm_start = on_chat_model_start, on_llm_start
    acm.on_chat_model_start, acm.on_llm_start = aon_chat_model_start, aon_llm_start
    rm.on_llm_end, rm.on_llm_error = on_llm_end, on_llm_error
    arm.on_llm_end, arm.on_llm_error = aon_llm_end, aon_llm_error


# -- Pregel loop hooks ---------------------------------------------------------------------------


def _find_handler(loop: Any) -> CaptureHandler | None:
    h = (loop.config.get("configurable") or {}).get(_MARK)
    return h if isinstance(h, CaptureHandler) else _CAPTURE_HANDLER.get()


def _state(loop: Any) -> _LoopState | None:
    st = loop.__dict__.get("_marft")
    if st is False:
        return None
    if st is None:
        h = _find_handler(loop)
        st = (h.attach(loop) if h is not None else None) or False
        loop.__dict__["_marft"] = st
    return st or None


def _register_tasks(st: _LoopState) -> None:
    loop, run, parent = st.loop, st.run, st.parent
    for task in loop.tasks.values():
        if task.id in st.seen:
            continue
        st.seen.add(task.id)
        internal = task.name.startswith("__")
        resumed = st.resumed.get(task.id)
        if resumed is not None:
            deps = resumed[0]  # a task of the step an earlier run stopped in: the same inputs
        elif internal:
            deps = parent.deps if parent is not None else frozenset()
        elif task.path and task.path[0] == _PUSH:
            sent = st.sends.get(id(task.input))
            deps = sent[1] if sent is not None and sent[0].arg is task.input else frozenset().union(
                *(p for _, p in st.sends.values()))
        else:
            node = loop.nodes.get(task.name)
            chans = getattr(node, "channels", None) or []
            chans = [chans] if isinstance(chans, str) else list(chans)
            deps = frozenset().union(*(st.prov.get(c, frozenset()) for c in (*chans, *task.triggers, _PREVIOUS)))
        meta = task.config.get("metadata") or {}
        name = str(meta.get("agent_name") or task.name)
        if parent is not None:
            agent, step, lg_steps = f"{parent.agent}/{name}", parent.step, [*parent.lg_steps, loop.step]
        else:
            agent, step, lg_steps = name, (run.base or 0) + loop.step, [loop.step]
        ns = meta.get("langgraph_checkpoint_ns") or task.id
        t = _TASK_INDEX[task.id] = _Task(task.id, run, agent, task.name, step, lg_steps, ns, deps, internal)
        if resumed is not None and task.writes:
            t.actions.extend(resumed[1])  # it had finished: its saved writes come back, it does not run again
        run.task_ids.append(task.id)


# -- functional API: ``@task`` calls and the results the caller reads -----------------------------
# A task's output reaches its caller only through its future (``.result()`` / ``await``), so the
# capture hands the caller a future that notes the read. What a task or model call then depends on
# is what its caller had read before starting it, not what happened to have finished.


def _seen(t: _Task) -> frozenset[str]:
    """What a task's next action starts from: its inputs, its own actions, the results it read.
    Under the run's lock."""
    deps = t.deps | frozenset(t.actions)
    return deps.union(*(_result(r) for r in t.received)) if t.received else deps


def _result(t: _Task) -> frozenset[str]:
    """Provenance of what a ``@task`` (or an entrypoint) hands back: its own actions, the results
    it read and the output of graphs it ran; its inputs when none of these could be recorded."""
    out = frozenset(t.actions).union(*(_result(r) for r in t.received),
                                     *(c.output_provenance() for c in t.children))
    return t.deps if not out and (t.calls or t.children) else out


class _Push:
    """One ``@task`` call of a captured task: filled in when LangGraph schedules it."""

    __slots__ = ("caller", "task", "writes")

    def __init__(self, caller: _Task):
        self.caller = caller
        self.task: _Task | None = None
        self.writes: Any = ()


# The ``@task`` call being scheduled in this context (LangGraph schedules async ones in a task
# that copies the caller's context).
_PUSHING: contextvars.ContextVar[_Push | None] = contextvars.ContextVar("marft_langgraph_push", default=None)


def _register_pushed(st: _LoopState, caller: Any, pushed: Any) -> None:
    """A functional-API ``@task`` started by a running task: an agent of its own (its name) at the
    caller's step. Its arguments come from the caller, so it depends on what the caller had seen
    when it started it: its inputs, its own calls and the results of tasks it had read."""
    parent = _TASK_INDEX.get(caller.id)
    if parent is None:
        return
    if pushed.id not in st.seen:
        st.seen.add(pushed.id)
        resumed = st.resumed.get(pushed.id)
        if resumed is not None:
            deps = resumed[0]  # started before the interrupt this run resumes: the same inputs
        else:
            with parent.run.lock:
                deps = _seen(parent)
        meta = pushed.config.get("metadata") or {}
        name = str(meta.get("agent_name") or pushed.name)
        agent = f"{parent.agent.rpartition('/')[0]}/{name}" if "/" in parent.agent else name
        t = _Task(pushed.id, parent.run, agent, pushed.name, parent.step, parent.lg_steps,
                  meta.get("langgraph_checkpoint_ns") or pushed.id, deps, False)
        if resumed is not None and pushed.writes:
            t.actions.extend(resumed[1])  # it had finished: its saved result comes back, it does not run again
        t.pusher = parent
        parent.pushed.append(t)
        _TASK_INDEX[pushed.id] = t
        parent.run.task_ids.append(pushed.id)
    push = _PUSHING.get()
    if push is not None and push.caller is parent:
        push.task, push.writes = _TASK_INDEX.get(pushed.id), pushed.writes


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
        _record_env(t, push.writes)


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


def _tracked_call(call: Callable[..., Any], task: Any, func: Any, input: Any, **kw: Any) -> Any:
    """LangGraph's ``@task`` call (``_runner._call`` / ``_acall``), with a future that notes reads."""
    caller = _TASK_INDEX.get(getattr(task(), "id", None)) if _TASK_INDEX else None
    if caller is None:
        return call(task, func, input, **kw)
    push = _Push(caller)
    token = _PUSHING.set(push)
    try:
        fut = call(task, func, input, **kw)
    finally:
        _PUSHING.reset(token)
    try:
        return _chain(fut, push)
    except Exception as e:  # noqa: BLE001
        capture_error("langgraph.task_call", e, caller.run.recorder)
        return fut


def _chain(fut: Any, push: _Push) -> Any:
    from langgraph._internal._future import chain_future

    out = _AsyncTaskFuture(loop=fut.get_loop()) if isinstance(fut, asyncio.Future) else _TaskFuture()
    out.marft_push = push
    return chain_future(fut, out)


def _record_env(t: _Task, writes: Any) -> None:
    """A task that called no model: an environment step, recorded (not trained)."""
    err = next((str(v) for c, v in writes if c == _ERROR), None)
    returned = [v for c, v in writes if c == _RETURN]
    if returned:  # a functional-API task: its output is its result
        text = returned[0] if isinstance(returned[0], str) else json.dumps(returned[0], default=str)
    else:
        out = {c: v for c, v in writes if not c.startswith(("__", "branch:"))}
        text = json.dumps(out, default=str) if out else ""
    text = text[:_ENV_OUTPUT_CHARS]
    t.run.record(t, "env", {"output": {"text": text}, "error": err}, t.deps, t.started)


def _task_output(task: Any, t: _Task) -> frozenset[str]:
    if t.internal:
        return t.deps
    if t.pushed:
        # An entrypoint's result comes from the tasks whose results it read and its own model calls.
        return _result(t)
    if t.children:
        out = frozenset().union(*(c.output_provenance() for c in t.children))
        if out or not t.actions:
            return out or t.deps
    if not t.actions and t.calls:
        return t.deps  # its model calls could not be recorded (counted): pass the inputs on
    if not t.actions:
        _record_env(t, task.writes)
    return frozenset(t.actions)


def _apply_writes(st: _LoopState) -> None:
    loop = st.loop
    st.sends = {}
    written: set[str] = set()
    for task in loop.tasks.values():
        t = _TASK_INDEX.get(task.id)
        if t is None:
            continue
        out = _task_output(task, t)
        for ch, val in task.writes:
            if ch == _TASKS:
                if hasattr(val, "arg"):
                    st.sends[id(val.arg)] = (val, out)
                continue
            kind = type(loop.channels.get(ch)).__name__
            if kind in _ACCUMULATING or ch in written:
                st.prov[ch] = st.prov.get(ch, frozenset()) | out
            else:
                st.prov[ch] = out
            written.add(ch)


def _drop_cleared(st: _LoopState) -> None:
    channels = st.loop.channels
    for ch in list(st.prov):
        c = channels.get(ch)
        if c is None or not c.is_available():
            del st.prov[ch]


_patched: dict[str, Any] = {}


def _patch_pregel() -> None:
    """Hook the Pregel loop and LangChain's model-call events once per process; runs nobody
    captures pay a dict lookup per superstep and per model call."""
    if _patched:
        return
    from langgraph.pregel import _loop, _runner

    cls, sync_cls, async_cls = _loop.PregelLoop, _loop.SyncPregelLoop, _loop.AsyncPregelLoop
    tick, after_tick, accept_push = cls.tick, cls.after_tick, cls.accept_push
    sync_exit, async_exit = sync_cls.__exit__, async_cls.__aexit__

    def hooked_tick(self: Any) -> bool:
        more = tick(self)
        if more:
            try:
                st = _state(self)
                if st is not None:
                    _register_tasks(st)
            except Exception as e:  # noqa: BLE001 - capture must not break the app
                capture_error("langgraph.tick", e)
        return more

    def hooked_after_tick(self: Any) -> None:
        st = None
        try:
            st = _state(self)
            if st is not None:
                _apply_writes(st)
        except Exception as e:  # noqa: BLE001
            capture_error("langgraph.after_tick", e)
        after_tick(self)
        if st is not None:
            try:
                _drop_cleared(st)
            except Exception as e:  # noqa: BLE001
                capture_error("langgraph.after_tick", e)

    def hooked_accept_push(self: Any, task: Any, write_idx: int, call: Any = None) -> Any:
        pushed = accept_push(self, task, write_idx, call)
        if pushed is not None:
            try:
                st = _state(self)
                if st is not None:
                    _register_pushed(st, task, pushed)
            except Exception as e:  # noqa: BLE001
                capture_error("langgraph.accept_push", e)
        return pushed

    def hooked_exit(self: Any, exc_type: Any, exc: Any, tb: Any) -> Any:
        try:
            return sync_exit(self, exc_type, exc, tb)
        finally:
            _loop_exited(self, exc)

    async def hooked_aexit(self: Any, exc_type: Any, exc: Any, tb: Any) -> Any:
        try:
            return await async_exit(self, exc_type, exc, tb)
        finally:
            _loop_exited(self, exc)

    _patched.update(tick=tick, after_tick=after_tick, accept_push=accept_push, exit=sync_exit, aexit=async_exit,
                    call=_runner._call, acall=_runner._acall)
    cls.tick, cls.after_tick, cls.accept_push = hooked_tick, hooked_after_tick, hooked_accept_push
    sync_cls.__exit__, async_cls.__aexit__ = hooked_exit, hooked_aexit
    # The runner looks these up when it hands a task its ``@task`` call (and a called task its own).
    _runner._call = functools.partial(_tracked_call, _runner._call)
    _runner._acall = functools.partial(_tracked_call, _runner._acall)
    _patch_langchain()


def _loop_exited(loop: Any, exc: BaseException | None) -> None:
    d = loop.__dict__
    st = d.get("_marft")
    if st:
        d["_marft"] = False  # cuts the loop <-> state cycle; the loop has ended
        with guarded("langgraph.history", st.run.recorder):
            _save_history(st, exc)
    run = d.pop("_marft_owns_run", None)
    if run is not None:
        with guarded("langgraph.finish", run.recorder):
            out = None
            with guarded("langgraph.output", run.recorder):
                out = recording.jsonable(loop.output) if exc is None else None
            run.finish(out, exc)


# -- context lookups used by other adapters ------------------------------------------------------


def _current_task() -> _Task | None:
    if not _TASK_INDEX:
        return None
    from langchain_core.runnables.config import var_child_runnable_config

    cfg = var_child_runnable_config.get()
    if not cfg:
        return None
    return _TASK_INDEX.get(_task_id((cfg.get("metadata") or {}).get("langgraph_checkpoint_ns")))


def _current_recorder() -> EpisodeRecorder | None:
    t = _current_task()
    return t.run.recorder if t is not None else None


recording.register_episode_finder(_current_recorder)


def in_captured_task() -> bool:
    return _current_task() is not None


def record_in_current_task(fields: dict[str, Any], started: datetime | None = None, kind: str = "llm") -> bool:
    """Record an action made inside a captured node as that node's agent (False when not in one).

    For other adapters: a direct ``openai`` call (``kind="llm"``), an MCP tool call
    (``kind="tool"``), ... ``fields`` are ``record_action`` keyword arguments (observation,
    output, sampling, policy, token_source, error, metadata). The action gets the node's step and
    depends on the node's inputs and on its earlier actions.
    """
    t = _current_task()
    if t is None:
        return False
    with t.run.lock:
        deps = _seen(t)
        t.calls += 1
    t.run.record(t, kind, dict(fields), deps, started)
    return True


recording.register_task_context(in_captured_task, record_in_current_task)


# -- instrument / capture ------------------------------------------------------------------------

_METHODS = ("invoke", "ainvoke", "stream", "astream")


def _with_handler(config: Any, handler: CaptureHandler) -> dict:
    cfg = dict(config or {})
    cfg["configurable"] = {**(cfg.get("configurable") or {}), _MARK: handler}
    return cfg


def _has_handler(config: Any) -> bool:
    return isinstance(config, dict) and _MARK in (config.get("configurable") or {})


class _Instrumentation:
    def __init__(self, app: Any, store: Any, reward_fn: Any, source: str, registry: Any = None):
        self.app = app
        self.registry = registry
        self.store = store
        self.reward_fn = reward_fn
        self.source = source
        self.originals = {m: getattr(app, m) for m in _METHODS}

    def start(self, inputs: Any) -> _Run | None:
        try:
            h = CaptureHandler(self.store, self.reward_fn, self.source, on_finish=self._done, registry=self.registry)
            h.run = h.new_run(inputs)
            return h.run
        except Exception as e:  # noqa: BLE001
            capture_error("langgraph.start", e)
            return None

    def _done(self, rec: EpisodeRecorder) -> None:
        self.app.__dict__["last_episode_id"] = rec.id

    def finish(self, run: _Run, output: Any = None, error: BaseException | None = None, early: bool = False) -> None:
        try:
            run.finish(output, error, early)
        except Exception as e:  # noqa: BLE001 - capture must not break the app
            capture_error("langgraph.finish", e, run.recorder)

    def install(self) -> None:
        app, orig = self.app, self.originals

        def invoke(input: Any, config: Any = None, **kw: Any) -> Any:
            if _has_handler(config) or (run := self.start(input)) is None:
                return orig["invoke"](input, config, **kw)
            try:
                out = orig["invoke"](input, _with_handler(config, run.handler), **kw)
            except BaseException as e:
                self.finish(run, error=e)
                raise
            self.finish(run, out)
            return out

        async def ainvoke(input: Any, config: Any = None, **kw: Any) -> Any:
            if _has_handler(config) or (run := self.start(input)) is None:
                return await orig["ainvoke"](input, config, **kw)
            try:
                out = await orig["ainvoke"](input, _with_handler(config, run.handler), **kw)
            except BaseException as e:
                self.finish(run, error=e)
                raise
            self.finish(run, out)
            return out

        def stream(input: Any, config: Any = None, **kw: Any) -> Any:
            if _has_handler(config) or (run := self.start(input)) is None:
                return orig["stream"](input, config, **kw)
            return self._stream(run, orig["stream"](input, _with_handler(config, run.handler), **kw))

        def astream(input: Any, config: Any = None, **kw: Any) -> Any:
            if _has_handler(config) or (run := self.start(input)) is None:
                return orig["astream"](input, config, **kw)
            return self._astream(run, orig["astream"](input, _with_handler(config, run.handler), **kw))

        for name, fn in (("invoke", invoke), ("ainvoke", ainvoke), ("stream", stream), ("astream", astream)):
            fn.__wrapped__ = orig[name]  # type: ignore[attr-defined]
            fn.__doc__ = getattr(orig[name], "__doc__", None)
            app.__dict__[name] = fn

    def _stream(self, run: _Run, it: Any) -> Any:
        chunks: list[Any] = []
        keep = self.reward_fn is not None
        try:
            for chunk in it:
                if keep:
                    chunks.append(chunk)
                yield chunk
        except GeneratorExit:
            self.finish(run, chunks, early=True)
            raise
        except BaseException as e:
            self.finish(run, error=e)
            raise
        self.finish(run, chunks)

    async def _astream(self, run: _Run, it: Any) -> Any:
        chunks: list[Any] = []
        keep = self.reward_fn is not None
        try:
            async for chunk in it:
                if keep:
                    chunks.append(chunk)
                yield chunk
        except GeneratorExit:
            self.finish(run, chunks, early=True)
            raise
        except BaseException as e:
            self.finish(run, error=e)
            raise
        self.finish(run, chunks)


def instrument(app: Any, store: Any = None, reward_fn: Callable[[Any, Any], float] | None = None,
               source: str = "langgraph", registry: Any = None) -> Any:
    """Capture every run of a compiled LangGraph graph as an Episode; returns the same object.

    ``store``: a ``TraceStore`` (default ``TraceStore.open()``). ``reward_fn(inputs, outputs)``
    returns a team reward per run. ``registry``: the adapter registry (root or ``AdapterRegistry``)
    the deployment publishes from; responses that name no adapter version (vLLM's) record the
    registry's live one (process-wide, ``integrations.openai.use_registry``). Calling it again on an
    instrumented app updates the settings.
    """
    if not all(callable(getattr(app, m, None)) for m in _METHODS):
        raise TypeError(f"instrument() needs a compiled LangGraph graph, got {type(app).__name__}")
    _install_hooks(registry)
    cur = app.__dict__.get("_marft_instrumentation")
    if cur is not None:
        cur.store, cur.reward_fn, cur.source, cur.registry = store, reward_fn, source, registry
        return app
    inst = _Instrumentation(app, store, reward_fn, source, registry)
    inst.install()
    app.__dict__["_marft_instrumentation"] = inst
    app.__dict__.setdefault("last_episode_id", None)
    return app


def _install_hooks(registry: Any) -> None:
    _patch_pregel()
    oa.install()
    if registry is not None:
        oa.use_registry(registry)


def uninstrument(app: Any) -> Any:
    """Remove what ``instrument`` added; the app behaves as before it was instrumented."""
    inst = app.__dict__.pop("_marft_instrumentation", None)
    if inst is not None:
        for m in _METHODS:
            app.__dict__.pop(m, None)
        app.__dict__.pop("last_episode_id", None)
    return app


class capture:
    """``with capture(store=...) as c:`` records every LangGraph run started in the block.

    Runs inside ``marft_bridge.episode(...)`` join it; otherwise each root graph run is one
    Episode. ``c.episode_ids`` lists the episodes this block recorded, in finishing order.
    """

    def __init__(self, store: Any = None, reward_fn: Callable[[Any, Any], float] | None = None,
                 source: str = "langgraph", registry: Any = None):
        self.handler = CaptureHandler(store, reward_fn, source, on_finish=self._done, registry=registry)
        self.registry = registry  # as in instrument()
        self.episode_ids: list[str] = []
        self._token: Any = None

    def _done(self, rec: EpisodeRecorder) -> None:
        self.episode_ids.append(rec.id)

    def __enter__(self) -> capture:
        _install_hooks(self.registry)
        self._token = _CAPTURE_HANDLER.set(self.handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        _CAPTURE_HANDLER.reset(self._token)

    async def __aenter__(self) -> capture:
        return self.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        self.__exit__(*exc)


__all__ = ["CaptureHandler", "capture", "in_captured_task", "instrument", "record_in_current_task", "uninstrument"]
