"""Precision tier: exact channel provenance from LangGraph's Pregel loop (private hooks, gated).

The ONLY module that imports LangGraph's private modules (``langgraph.pregel._loop``,
``langgraph.pregel._runner``, ``langgraph._internal._future``). ``hooks(state)`` gives the capture
state's ``integrations.hooks.Hooks``: pass-through ``wrapt`` wrappers (``(wrapped, instance, args,
kwargs)``: an upstream signature change cannot raise from binding) on ``PregelLoop.tick`` /
``after_tick`` / ``accept_push``, the loops' ``__exit__`` / ``__aexit__`` and the runner's
``_call`` / ``_acall``, applied only when the installed LangGraph is in ``SUPPORTED`` (else it logs
once and the public tier runs alone, the episodes marked ``metadata["dependency_source"] =
"langgraph_run_metadata"``); uninstalling puts every original back (``PregelLoop.tick is original``).
"""

from __future__ import annotations

import functools
from typing import Any

from ...capture_errors import capture_error, guarded
from ..hooks import Hooks, arg, installed_version
from . import channels as kinds
from . import futures, manager_events, memory, tools
from . import reads as rd
from . import provenance as pv
from .callbacks import CAPTURE_HANDLER
from .runs import CaptureHandler, Task, record_env, task_id
from .threads import restore_history, save_history, snapshot
from .. import checked_range

# LangGraph versions whose loop internals these hooks were checked against: [low, high).
SUPPORTED = checked_range("langgraph")  # the range in integrations.INTEGRATIONS
_PUSH = "__pregel_push"
_TASKS = "__pregel_tasks"
# The value an entrypoint saved on its thread (functional API): every task is handed it.
_PREVIOUS = "__previous__"
# Config key that marks an instrumented run; "__" keeps it out of checkpoint metadata.
MARK = "__marft_capture"


def supported(v: tuple[int, ...] | None = None) -> bool:
    v = installed_version("langgraph") if v is None else v
    return v is not None and SUPPORTED[0] <= v < SUPPORTED[1]


# -- one Pregel loop's provenance ----------------------------------------------------------------


class _LoopState:
    """Provenance of one Pregel loop's channels (a root graph or a subgraph)."""

    __slots__ = ("loop", "run", "parent", "prov", "sends", "seen", "resumed", "bubbled", "key_prov", "snapshots",
                 "start", "answer", "out_keys")

    def __init__(self, loop: Any, run: Any, parent: Task | None):
        self.loop = loop
        self.run = run
        self.parent = parent
        # A subgraph run on its parent task's input: per input key, where that part came from.
        self.key_prov: dict[str, frozenset[str]] | None = rd.key_provenance(parent, loop.input) if parent else None
        self.prov: dict[str, frozenset[str]] = {}
        self.sends: dict[int, tuple[Any, frozenset[str]]] = {}  # id(Send.arg) -> (Send, provenance)
        self.seen: set[str] = set()
        self.resumed: dict[str, tuple[frozenset[str], list[str]]] = {}  # see ThreadHistory.stopped
        # Actions of the step a ParentCommand (a handoff) unwound: they reach the parent graph.
        self.bubbled: frozenset[str] = pv.EMPTY
        # On a checkpointed thread of an episode: checkpoint id -> (provenance, channel versions) there.
        self.snapshots: dict[str, tuple[dict, dict]] | None = None
        # What its first step reads: its parent task's inputs, or for a graph run inside a tool's body
        # (an agent as a tool) what that tool step read (``tools.ran_graph``).
        self.start: frozenset[str] | None = parent.deps if parent is not None else None
        self.answer: frozenset[str] | None = None  # see ``answer_provenance``
        self.out_keys = frozenset(rd.output_keys(loop))  # the graph's output channels, read once per loop

    def output_provenance(self) -> frozenset[str]:
        return pv.inputs(self.prov, self.out_keys) | self.bubbled

    def answer_provenance(self) -> frozenset[str]:
        """What a caller that takes the graph's answer reads (an agent run inside a tool): the tasks
        of the last step that wrote its output, and a handoff it ended in; its whole output when
        none did."""
        return (self.answer | self.bubbled) if self.answer is not None else self.output_provenance()

    def accumulates(self, ch: str) -> bool:
        return kinds.accumulates(self.loop.channels.get(ch))


def _attach(h: CaptureHandler, loop: Any) -> _LoopState | None:
    ns = (loop.config.get("configurable") or {}).get("checkpoint_ns") or ""
    parent = h.state.tasks.get(task_id(ns)) if ns else None
    if parent is not None:
        st = _LoopState(loop, parent.run, parent)
        if not tools.ran_graph(h.state, parent, st):  # one a tool ran hands its answer to that tool step only
            parent.children.append(st)
    elif h.run is None:  # capture(): every root graph run is a run of its own
        run = h.new_run(loop.input)
        st = _LoopState(loop, run, None)
        loop.__dict__["_marft_owns_run"] = run
    elif h.run.base is not None:
        return None  # a second root loop under one instrumented call: not ours
    else:
        st = _LoopState(loop, h.run, None)
    h.precise = True
    if parent is None:
        st.run.base = st.run.recorder.max_step() or 0
    restore_history(st)
    return st


def _find_handler(loop: Any) -> CaptureHandler | None:
    h = (loop.config.get("configurable") or {}).get(MARK)
    return h if isinstance(h, CaptureHandler) else CAPTURE_HANDLER.get()


def _state(loop: Any) -> _LoopState | None:
    st = loop.__dict__.get("_marft")
    if st is False:
        return None
    if st is None:
        h = _find_handler(loop)
        st = (_attach(h, loop) if h is not None else None) or False
        loop.__dict__["_marft"] = st
    return st or None


# -- tasks of a step ---------------------------------------------------------------------------------


def _new_task(st: _LoopState, task: Any, deps: frozenset[str], internal: bool) -> Task:
    loop, run, parent = st.loop, st.run, st.parent
    meta = task.config.get("metadata") or {}
    graph = meta.get("lc_agent_name")
    agent = pv.agent_path(parent, graph, str(meta.get("agent_name") or task.name))
    if parent is not None:
        step, lg_steps = parent.step, [*parent.lg_steps, loop.step]
    else:
        step, lg_steps = (run.base or 0) + loop.step, [loop.step]
    t = Task(task.id, run, agent, task.name, step, lg_steps, meta.get("langgraph_checkpoint_ns") or task.id,
             deps, internal)
    t.graph_name = graph if isinstance(graph, str) else None
    return t


def _register_tasks(st: _LoopState) -> None:
    loop = st.loop
    values: dict[str, Any] | None = None  # the channels' values, read once for this tick's Send packets
    for task in loop.tasks.values():
        if task.id in st.seen:
            continue
        st.seen.add(task.id)
        internal = task.name.startswith("__")
        resumed = st.resumed.get(task.id)
        reads = None
        if resumed is not None:
            deps = resumed[0]  # a task of the step an earlier run stopped in: the same inputs
        elif internal:
            kp = st.key_prov
            if kp is not None:  # what the subgraph's input schema keeps (its start task writes them)
                deps = pv.EMPTY.union(*(p for k, p in kp.items() if k in loop.channels))
            else:
                deps = st.start if st.start is not None else pv.EMPTY
        elif task.path and task.path[0] == _PUSH:
            sent = st.sends.get(id(task.input))
            if sent is not None and sent[0].arg is task.input:
                if values is None:
                    values = {c: ch.get() for c, ch in loop.channels.items() if ch.is_available()}
                deps = sent[1] | rd.packet_provenance(st, task.input, values)
            else:
                deps = pv.EMPTY.union(*(p for _, p in st.sends.values()))
            reads = (st, task.input, None)
        else:
            chans = _node_channels(loop.nodes.get(task.name))
            deps = pv.inputs(st.prov, (*chans, *task.triggers, _PREVIOUS))
            reads = (st, task.input, chans)
        t = st.run.state.tasks[task.id] = _new_task(st, task, deps, internal)
        t.reads = reads
        if not internal:
            _state_tools(st, t, task)
        if resumed is not None and task.writes:
            t.actions.extend(resumed[1])  # it had finished: its saved writes come back, it does not run again
        st.run.task_ids.append(task.id)


def _node_channels(node: Any) -> list[str]:
    chans = getattr(node, "channels", None) or []
    return [chans] if isinstance(chans, str) else list(chans)


def _state_tools(st: _LoopState, t: Task, task: Any) -> None:
    """A tool node's tools handed graph state, and what that state carries: a node run by a ``Send``
    of bare tool calls (``create_agent``) reads the channels an edge would hand it
    (``ToolNode._extract_state``), the sender's decision besides."""
    node = st.loop.nodes.get(task.name)
    t.state_tools = tools.state_readers(getattr(node, "bound", None))
    if t.state_tools and task.path and task.path[0] == _PUSH:
        t.state_deps = t.deps | pv.inputs(st.prov, _node_channels(node))


def _apply_writes(st: _LoopState) -> None:
    loop = st.loop
    st.sends = {}
    tasks = st.run.state.tasks
    step: list[tuple[frozenset[str], list[str]]] = []
    keys, answer = st.out_keys, []
    for task in loop.tasks.values():
        t = tasks.get(task.id)
        if t is None:
            continue
        key = rd.cache_key(task)  # None: no node cache (most nodes)
        out = rd.cache_hit(st, key, t) if key is not None else None
        if out is None:
            out = pv.task_output(t)
            if out is None:
                record_env(t, task.writes)
                out = frozenset(t.actions)
            if key is not None:
                rd.fill_cache(st, key, out)
        chans = []
        for ch, val in task.writes:
            if ch == _TASKS:
                if hasattr(val, "arg"):
                    st.sends[id(val.arg)] = (val, out)
            else:
                chans.append(ch)
        if t.internal and st.key_prov is not None:
            step.extend(pv.subgraph_writes(st.key_prov, chans))
        elif t.handed:  # a tool node: each value it writes carries the tool step that returned it
            step.extend((pv.written(t, val, out), [ch]) for ch, val in task.writes if ch != _TASKS)
        elif t.children and not t.pushed:  # it ran subgraphs: each value it hands on, from where it was
            held = rd.held_values(t.children)
            step.extend((rd.returned_provenance(held, val, out), [ch]) for ch, val in task.writes if ch != _TASKS)
        else:
            step.append((out, chans))
        if not t.internal and not keys.isdisjoint(chans):
            answer.append(out)
    pv.apply_writes(st.prov, step, st.accumulates)
    if answer:  # the graph's answer so far: the tasks of its latest step that wrote its output
        st.answer = pv.EMPTY.union(*answer)


def _drop_cleared(st: _LoopState) -> None:
    channels = st.loop.channels
    pv.drop_cleared(st.prov, lambda ch: (c := channels.get(ch)) is not None and c.is_available())


def _loop_exited(loop: Any, exc: BaseException | None) -> None:
    d = loop.__dict__
    st = d.get("_marft")
    if st:
        d["_marft"] = False  # cuts the loop <-> state cycle; the loop has ended
        with guarded("langgraph.history", st.run.recorder):
            from langgraph.errors import GraphBubbleUp, GraphInterrupt

            if isinstance(exc, GraphBubbleUp) and not isinstance(exc, GraphInterrupt):
                # A ParentCommand (a handoff tool's or a node's Command(graph=PARENT)) unwound the step:
                # what its tasks' writes would have carried (the handoff's tool step), or for a task
                # that recorded nothing its inputs, is what the parent graph receives.
                tasks = st.run.state.tasks
                st.bubbled = pv.EMPTY.union(*(pv.task_output(t) or t.deps for tid in loop.tasks
                                              if (t := tasks.get(tid)) is not None))
            save_history(st, exc)
    run = d.pop("_marft_owns_run", None)
    if run is not None:
        from ...capture.recording import jsonable

        with guarded("langgraph.finish", run.recorder):
            out = None
            with guarded("langgraph.output", run.recorder):
                out = jsonable(loop.output) if exc is None else None
            run.finish(out, exc)


# -- the hooks ----------------------------------------------------------------------------------------



def _tick(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    more = wrapped(*args, **kwargs)
    if more:
        try:
            st = _state(instance)
            if st is not None:
                _register_tasks(st)
        except Exception as e:  # noqa: BLE001 - capture must not break the app
            capture_error("langgraph.tick", e)
    return more


def _after_tick(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    st = None
    try:
        st = _state(instance)
        if st is not None:
            _apply_writes(st)
    except Exception as e:  # noqa: BLE001
        capture_error("langgraph.after_tick", e)
    out = wrapped(*args, **kwargs)
    if st is not None:
        try:
            _drop_cleared(st)
            snapshot(st)
        except Exception as e:  # noqa: BLE001
            capture_error("langgraph.after_tick", e)
    return out


def _accept_push(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    pushed = wrapped(*args, **kwargs)
    if pushed is not None:
        try:
            st = _state(instance)
            if st is not None:
                futures.register_pushed(st, arg(args, kwargs, 0, "task"), pushed)
        except Exception as e:  # noqa: BLE001
            capture_error("langgraph.accept_push", e)
    return pushed


def _exit(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    try:
        return wrapped(*args, **kwargs)
    finally:
        with guarded("langgraph.loop_exit"):
            _loop_exited(instance, arg(args, kwargs, 1, "exc_value"))


async def _aexit(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    try:
        return await wrapped(*args, **kwargs)
    finally:
        with guarded("langgraph.loop_exit"):
            _loop_exited(instance, arg(args, kwargs, 1, "exc_value"))


def _call(state: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """LangGraph's ``@task`` call (``_runner._call`` / ``_acall``), with a future that notes reads."""
    if not state.tasks:
        return wrapped(*args, **kwargs)
    return futures.tracked_call(state, wrapped, arg(args, kwargs, 0, "task"), args, kwargs, _chain_future)


def _chain_future(source: Any, target: Any) -> Any:
    from langgraph._internal._future import chain_future

    return chain_future(source, target)


def _targets(state: Any) -> list[tuple[Any, str, Any]]:
    from langgraph.pregel import _loop, _runner

    call = functools.partial(_call, state)
    return [(_loop.PregelLoop, "tick", _tick), (_loop.PregelLoop, "after_tick", _after_tick),
            (_loop.PregelLoop, "accept_push", _accept_push), (_loop.SyncPregelLoop, "__exit__", _exit),
            (_loop.AsyncPregelLoop, "__aexit__", _aexit), (_runner, "_call", call), (_runner, "_acall", call),
            *memory.targets(state), *manager_events.targets(state)]


def hooks(state: Any) -> Hooks:
    """The precision tier's hooks for one capture state (installed by its ``start()``)."""
    return Hooks("langgraph", SUPPORTED, lambda: _targets(state),
                 "LangGraph channel provenance is off; dependencies come from public run metadata "
                 "(episodes say metadata['dependency_source'])")


def mark(config: Any, handler: CaptureHandler) -> dict:
    """``config`` with the capture handler in ``configurable`` (what the loop hook looks for)."""
    cfg = dict(config or {})
    cfg["configurable"] = {**(cfg.get("configurable") or {}), MARK: handler}
    return cfg


def marked(config: Any) -> bool:
    return isinstance(config, dict) and MARK in (config.get("configurable") or {})


__all__ = ["SUPPORTED", "hooks", "mark", "marked", "supported"]
