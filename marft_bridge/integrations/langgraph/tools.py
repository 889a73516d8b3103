"""Tool steps: every LangChain tool execution in a captured task is a ``kind="tool"`` action.

Same record shape as the MCP tool steps (``integrations.mcp``): ``observation.messages`` holds the
assistant tool call (``{"id", "type": "function", "function": {"name", "arguments"}}``),
``output.text`` the result (a ToolMessage's content; anything that is not a string as JSON),
``error`` what the tool raised, ``metadata``: ``tool.name``, ``tool.arguments``, ``tool_call_id``,
``latency_s``, and for a handoff (a tool returning ``Command(goto=..., graph=Command.PARENT)``)
``handoff.goto`` / ``handoff.graph``.

The step is an action of the agent whose model call asked for it (matched by ``tool_call_id``,
else by name and arguments, among the calls of every run of the episode: a tool interrupted by
``interrupt()`` runs again in the resuming run), depends on that model call only (its arguments
are what it reads, whatever state the tool node was handed; a tool handed graph state too, through
``InjectedState`` or a ``ToolRuntime``, also depends on what its node read), and is one of the running task's
actions, so the task's writes (the ToolMessage) carry it to the agent's next model call: each value
the task writes carries the step that returned it (``provenance.hand_on`` / ``written``: its
ToolMessage, a ``Command``'s update values), the task's other writes (its trigger) all its steps. A
model call inside a tool's body depends on what the tool read, and the step on it. A tool
called by hand in a node is the node agent's and depends on what the node had seen. A tool
interrupted by ``interrupt()`` (a ``GraphBubbleUp``) is recorded when it runs again on resume.
A graph run inside a tool's body (an agent as a tool) starts from what the tool step read, and the
step depends on the graph's answer (``ran_graph``). A failed step that a retry of the same call
replaced (``ToolRetryMiddleware``) hands nothing on.
"""

from __future__ import annotations

import contextlib
import json
import time
import typing
import weakref
from collections.abc import Callable
from typing import Any
from uuid import UUID

from ...capture.messages import canonical_arguments
from ...capture_errors import capture_error, guarded
from ...schema import utcnow
from . import convert
from .provenance import EMPTY, Task, hand_on

_PARENT = "__parent__"  # langgraph.types.Command.PARENT


class _ToolRun:
    """A tool execution in flight; as ``episode_context.ToolStep``, what an MCP call made inside it enriches."""

    __slots__ = ("task", "name", "args", "call_id", "owner", "deps", "started", "t0", "_id", "extra", "waiting",
                 "inner", "graphs")

    def __init__(self, task: Task, name: str, args: Any, call_id: str | None, owner: tuple | None,
                 deps: frozenset[str]):
        self.task, self.name, self.args, self.call_id, self.owner, self.deps = task, name, args, call_id, owner, deps
        self.started, self.t0 = utcnow(), time.perf_counter()
        self._id: str | None = None  # reserved when a call inside it needs it before the step is recorded
        # Set by a protocol call made inside it (``enrich``): its details, and who waits for the record.
        self.extra: dict[str, Any] | None = None
        self.waiting: list[Callable[[bool], None]] | None = None
        self.inner: frozenset[str] = frozenset()  # model calls made inside it: its result came from them
        self.graphs: list[Any] = []  # loop states of graphs run inside it (an agent as a tool)

    @property
    def action_id(self) -> str:
        if self._id is None:
            self._id = self.task.run.recorder.new_action_id()
        return self._id

    @property
    def agent(self) -> str:
        return self.owner[1] if self.owner is not None else self.task.agent

    @property
    def step(self) -> int | None:
        return self.task.step

    def depends_on(self) -> list[str]:
        run = self.task.run
        with run.lock:
            return run.sorted_ids(self.deps)

    def enrich(self, metadata: dict[str, Any], depends_on: Any, on_recorded: Callable[[bool], None]) -> None:
        with self.task.run.lock:
            self.extra = {**(self.extra or {}), **metadata}
            self.deps = self.deps | frozenset(depends_on)
            self.waiting = [*(self.waiting or ()), on_recorded]

    def made_inside(self, action_id: str) -> None:
        """A model call inside the tool's body: the step depends on it, and what it returns carries it."""
        with self.task.run.lock:
            self.inner = self.inner | {action_id}
            self.deps = self.deps | {action_id}

    def settle(self, recorded: bool) -> None:
        waiting, self.waiting = self.waiting or [], None
        for fn in waiting:
            with guarded("langgraph.tool_step", self.task.run.recorder):
                fn(recorded)


def ran_graph(state: Any, parent: Task, loop_state: Any) -> bool:
    """Whether a graph starting inside ``parent`` (precision tier) runs in a tool's body (an agent
    invoked by a tool, deepagents' ``task``): then its first step reads what the tool step read (the
    call that asked for it), and the step depends on the graph's answer (``end``)."""
    tr = current_tool_run(state)
    if tr is None or tr.task is not parent:
        return False
    with parent.run.lock:
        tr.graphs.append(loop_state)
        loop_state.start = tr.deps
    return True


def note_calls(run: Any, action_id: str, agent: str, calls: list[dict] | None) -> None:
    """Remember which model call asked for which tool calls (``tool_call_id`` -> owner)."""
    for c in calls or ():
        fn = c.get("function") or {}
        owner = (action_id, agent, c.get("id"), fn.get("arguments"))
        owners = run.calls.owners
        with run.lock:
            if c.get("id"):
                owners[c["id"]] = owner
            # By name and arguments too: LangChain before 1.1 does not pass tool_call_id to on_tool_start.
            owners.setdefault(f"{fn.get('name')}\x00{canonical_arguments(fn.get('arguments'))}", owner)
            owners[f"{fn.get('name')}\x00"] = owner  # and by name alone: the latest call of it


def find_owner(run: Any, name: str, args: Any, call_id: str | None) -> tuple | None:
    """The model call that asked for this tool call: ``(action id, agent, tool_call_id, arguments)``."""
    calls = run.calls
    with run.lock:
        if call_id is not None and call_id in calls.owners:
            return calls.owners[call_id]
        exact = calls.owners.get(f"{name}\x00{canonical_arguments(args)}")
        if exact is not None:
            return exact
        # By name alone only while that call is unanswered: a later tool.invoke by hand is not it.
        latest = calls.owners.get(f"{name}\x00")
        return latest if latest is not None and (latest[0], latest[2]) not in calls.answered_calls else None


def start(task: Task, run_id: UUID, name: str, args: Any, call_id: str | None, attempt: int = 1) -> None:
    """A tool run begins in ``task`` (``attempt``: its node's, ``Run.new_attempt``)."""
    run = task.run
    args = convert.jsonable(args) if not isinstance(args, str) else args
    if call_id is None and isinstance(args, dict) and isinstance(args.get("tool_call_id"), str):
        call_id = args["tool_call_id"]  # an InjectedToolCallId argument (older LangChain passes injected ones)
    owner = find_owner(run, name, args, call_id)
    asked = None
    if owner is not None:
        call_id = call_id or owner[2]
        with contextlib.suppress(TypeError, ValueError):
            asked = json.loads(owner[3]) if isinstance(owner[3], str) else None
        args, asked = _executed_arguments(args, asked)
    with run.lock:
        run.new_attempt(task, attempt)
        task.calls += 1
        if owner is not None:  # a retry (ToolRetryMiddleware) of a failed attempt: that error reached no one
            failed = run.calls.failed.pop((owner[0], call_id), None)
            if failed in task.actions:
                task.actions.remove(failed)
        # A tool step depends on the model call that asked for it: its arguments are what it reads
        # (a ToolNode reading the whole message list reads no more of it). A tool called by hand in
        # a node depends on what the node had seen; a tool call whose asking call this episode does
        # not hold (the reply came in an earlier episode) on the node's inputs, not on its siblings.
        # Arguments changed on the way (a human's edit, through the state): also what the node read.
        deps = frozenset((owner[0],)) if owner is not None else task.deps if call_id is not None \
            else run.deps_of(task)
        if asked is not None:
            deps |= run.deps_of(task)
        elif owner is not None and name in task.state_tools:
            # the state it was handed: its node's inputs (not its siblings' results)
            deps |= task.deps if task.state_deps is None else task.state_deps
    state = run.state
    tr = _ToolRun(task, name, args, call_id, owner, deps)
    if asked is not None:
        tr.extra = {"tool.asked_arguments": asked}
    with state.tools_lock:
        state.tools[run_id] = tr


_STATE_READERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tool node -> its names


def state_readers(node: Any) -> frozenset[str]:
    """The tools of a tool node (a runnable with ``tools_by_name``: LangGraph's ``ToolNode``, also in
    ``create_agent``) that are handed graph state: an argument the model does not send
    (``InjectedState``, ``ToolRuntime``), other than the call's id and the long-term store (memory.py
    records what is read from it). Worked out once per node."""
    by_name = getattr(node, "tools_by_name", None)
    if not isinstance(by_name, dict):
        return EMPTY
    with contextlib.suppress(KeyError, TypeError):
        return _STATE_READERS[node]
    names = frozenset(n for n, t in by_name.items() if _handed_state(t))
    with contextlib.suppress(TypeError):  # a node that takes no weak reference is worked out every time
        _STATE_READERS[node] = names
    return names


def _handed_state(tool: Any) -> bool:
    try:
        from langchain_core.tools import InjectedToolCallId
        from langgraph.prebuilt import InjectedStore

        fields = tool.get_input_schema().model_fields
        sent = tool.tool_call_schema.model_fields
    except Exception:  # noqa: BLE001 - a tool whose schema is not a pydantic model takes no injected argument
        return False

    def other(mark: Any) -> bool:
        return mark is InjectedToolCallId or isinstance(mark, (InjectedToolCallId, InjectedStore))

    if any(n not in sent and not any(other(m) for m in f.metadata) for n, f in fields.items()):
        return True
    # A tool built with its own args_schema (StructuredTool.from_function(infer_schema=False, ...):
    # deepagents' file tools and ``task``) leaves the injected argument out of both schemas; ToolNode
    # also reads the function's signature (a ``runtime`` parameter is injected by name), so do the same.
    func = getattr(tool, "func", None) or getattr(tool, "coroutine", None)
    try:
        hints = typing.get_type_hints(func, include_extras=True) if callable(func) else {}
    except Exception:  # noqa: BLE001 - annotations that do not resolve: what the schemas said stands
        return False
    return any(n not in sent and n != "return" and (n == "runtime" or _hands_state(h)) for n, h in hints.items())


def _hands_state(hint: Any) -> bool:
    """``ToolRuntime`` (also ``ToolRuntime[...]``), or ``Annotated[..., InjectedState(...)]``."""
    from langgraph.prebuilt import InjectedState

    try:
        from langgraph.prebuilt import ToolRuntime
    except ImportError:  # a LangGraph before ToolRuntime
        ToolRuntime = None  # noqa: N806
    if ToolRuntime is not None and (hint is ToolRuntime or typing.get_origin(hint) is ToolRuntime):
        return True
    if typing.get_origin(hint) is typing.Annotated:
        base, *marks = typing.get_args(hint)
        return _hands_state(base) or any(m is InjectedState or isinstance(m, InjectedState) for m in marks)
    return False


def _executed_arguments(reported: Any, asked: Any) -> tuple[Any, Any]:
    """The arguments the tool ran with, and the model's own where they differ (None where not): the
    model's keys with the values LangChain reports (a human-in-the-loop edit changes them; older
    LangChain also reports injected state, under keys the model never sent)."""
    if not isinstance(asked, dict):
        return (asked if asked is not None else reported), None
    if not isinstance(reported, dict):
        return asked, None
    ran = {k: reported.get(k, v) for k, v in asked.items()}
    return ran, (asked if ran != asked else None)


def _result(output: Any, call_id: str | None) -> tuple[str, dict[str, Any]]:
    """The result text and handoff metadata of what a tool returned (a ToolMessage, a Command, a value)."""
    extra: dict[str, Any] = {}
    goto = getattr(output, "goto", None)
    if hasattr(output, "update") and hasattr(output, "graph") and goto is not None:  # a langgraph Command
        extra["handoff.goto"] = convert.jsonable(goto if isinstance(goto, (str, list)) else getattr(goto, "node", goto))
        extra["handoff.graph"] = "parent" if output.graph == _PARENT else (output.graph or "current")
        update = output.update
        msgs = update.get("messages") if isinstance(update, dict) else None
        msgs = msgs if isinstance(msgs, list) else []
        tool_msgs = [m for m in msgs if getattr(m, "type", None) == "tool"]
        match = next((m for m in tool_msgs if getattr(m, "tool_call_id", None) == call_id), None)
        match = match or (tool_msgs[-1] if tool_msgs else None)
        return (convert.result_text(match.content) if match is not None else ""), extra
    if getattr(output, "type", None) == "tool" and hasattr(output, "content"):  # a ToolMessage
        if getattr(output, "status", "success") == "error":
            extra["tool.status"] = "error"
        return convert.result_text(output.content), extra
    return convert.result_text(convert.jsonable(output)), extra


def _returned(output: Any) -> list[Any]:
    """The objects a tool step hands its node to write: a Command's update values (and the messages
    in them), else the output itself (the ToolMessage the tool node writes)."""
    update = getattr(output, "update", None)
    if hasattr(output, "graph") and isinstance(update, dict):  # a langgraph Command
        vals = list(update.values())
        return vals + [m for v in vals if isinstance(v, list) for m in v]
    return [output]


def current_tool_run(state: Any) -> _ToolRun | None:
    """The tool run whose body is executing in this context: LangChain runs a tool with a child
    config whose callback manager names the tool's run as parent."""
    if not state.tools:
        return None
    from langchain_core.runnables.config import var_child_runnable_config

    cfg = var_child_runnable_config.get()
    parent = getattr((cfg or {}).get("callbacks"), "parent_run_id", None)
    return state.tools.get(parent) if parent is not None else None


def end(state: Any, run_id: UUID, output: Any = None, error: BaseException | None = None) -> None:
    if not state.tools:
        return
    with state.tools_lock:
        tr = state.tools.pop(run_id, None)
    if tr is None:
        return
    run = tr.task.run
    recorded = False
    try:
        if run.finished:
            return
        if error is not None and _bubbles(error):
            return  # interrupt(): the tool runs again on resume
        if tr.graphs:  # what the agents run inside it answered: its result came from them
            with run.lock:
                handed = EMPTY.union(*(g.answer_provenance() for g in tr.graphs))
                tr.deps, tr.inner = tr.deps | handed, tr.inner | handed
                # and what the task hands on where a value cannot be traced (as a model call made inside)
                tr.task.actions.extend(run.sorted_ids(handed - set(tr.task.actions)))
        text, extra = ("", {}) if error is not None else _result(output, tr.call_id)
        args_json = convert.arguments_json(tr.args)
        call = {"id": tr.call_id, "type": "function", "function": {"name": tr.name, "arguments": args_json}}
        meta = {"tool.name": tr.name, "tool.arguments": tr.args, "tool_call_id": tr.call_id,
                "latency_s": time.perf_counter() - tr.t0, **extra, **(tr.extra or {})}
        fields = {"observation": {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]},
                  "output": {"text": text}, "metadata": meta,
                  "error": f"{type(error).__name__}: {error}" if error is not None else None}
        if tr._id is not None:
            fields["action_id"] = tr._id
        agent = tr.owner[1] if tr.owner is not None else None
        aid = run.record(tr.task, "tool", fields, tr.deps, tr.started, agent=agent)
        recorded = True
        if error is None:
            with run.lock:
                hand_on(tr.task, _returned(output), tr.inner | {aid})
        if tr.owner is not None:
            with run.lock:
                run.calls.answered_calls.add((tr.owner[0], tr.owner[2]))
                if error is not None:
                    run.calls.failed[(tr.owner[0], tr.call_id)] = aid
    except Exception as e:  # noqa: BLE001 - capture must not break the app
        capture_error("langgraph.tool_end", e, run.recorder)
    finally:
        if tr.waiting:
            tr.settle(recorded)


def _bubbles(error: BaseException) -> bool:
    try:
        from langgraph.errors import GraphBubbleUp
    except ImportError:
        return False
    return isinstance(error, GraphBubbleUp)
