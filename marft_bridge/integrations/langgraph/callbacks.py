"""Public tier: one LangChain callback handler, reading public run metadata.

Model calls (``on_chat_model_start`` / ``on_llm_start`` / ``on_llm_end`` / ``on_llm_error``) and
tool executions (``on_tool_start`` / ``on_tool_end`` / ``on_tool_error``) arrive here with the
run metadata LangGraph sets (``langgraph_checkpoint_ns``, ``langgraph_node``, ``langgraph_step``),
which names the task they run in. Inside ``capture()`` LangChain adds the handler to every run
(``langchain_core.tracers.context.register_configure_hook``); an instrumented run carries it in its
config only without the precision tier, which hands it the events at LangChain's callback managers
instead (``manager_events``); with no app instrumented and no capture block open nothing calls it. It is one object (LangChain de-duplicates it when both paths add it; a module-level
singleton for that reason) and keeps no state of its own: ``attach(state)`` points it at the
running capture's ``LangGraphState`` (its calls in flight, its tasks), ``attach(None)`` disarms it.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler

from ...capture_errors import capture_error, guarded
from ...capture.recording import jsonable
from ...schema import utcnow
from .. import openai as oa
from . import convert, tools
from .provenance import Task
from .runs import RUN, find_task


class _Call:
    __slots__ = ("task", "deps", "messages", "params", "model", "started", "sink", "sink_token")

    def __init__(self, task: Task, deps: frozenset[str], messages: list[dict], params: dict, model: str,
                 sink: oa.RawCall | None, sink_token: Any):
        self.task = task
        self.deps = deps
        self.messages = messages
        self.params = params
        self.model = model
        self.started = utcnow()
        self.sink = sink
        self.sink_token = sink_token


def _observation(call: _Call) -> dict[str, Any]:
    obs: dict[str, Any] = {"messages": call.messages}
    if not call.params.get("tools") and call.params.get("tool_choice") is None:
        return obs
    offered, choice = convert.offered_tools(call.params)
    if offered:
        obs["tools"] = offered
    if choice is not None:
        obs["tool_choice"] = choice
    return obs


def _start(state: Any, serialized: dict | None, messages: list, run_id: UUID, meta: dict | None, kw: dict) -> None:
    task = find_task(state, meta or {})
    if task is None:
        return
    params = kw.get("invocation_params") or {}
    model = str(params.get("model") or params.get("model_name") or (meta or {}).get("ls_model_name")
                or (serialized or {}).get("name") or params.get("_type") or "unknown")
    run = task.run
    attempt = node_attempt()
    tool = tools.current_tool_run(state)  # a model call inside a tool reads what the tool read
    with run.lock:
        run.new_attempt(task, attempt)
        deps = tool.deps if tool is not None and tool.task is task else run.deps_of(task)
        task.calls += 1
    # The raw openai response pairs with this call unless another call of this context is still
    # open (LangChain's generate() starts every prompt of a batch before the first ends): then
    # neither pairs.
    open_sink = oa.RAW_SINK.get()
    sink, token = None, None
    if open_sink is not None and not open_sink.done and open_sink.response is None:
        open_sink.done = True
    else:
        sink = oa.RawCall()
        token = oa.RAW_SINK.set(sink)
    converted = [m if isinstance(m, dict) else convert.message(m) for m in messages]
    state.calls[run_id] = _Call(task, deps, converted, params, model, sink, token)


def node_attempt() -> int:
    """Which attempt of its LangGraph node the running call is in (1-based; LangGraph's public
    ``get_runtime().execution_info``), 1 where LangGraph does not say (outside a node, older releases)."""
    try:
        return int(getattr(_get_runtime()().execution_info, "node_attempt", None) or 1)
    except Exception:  # noqa: BLE001 - no runtime here: a first attempt
        return 1


@functools.cache
def _get_runtime() -> Any:
    # Imported once, not on every model call (an import statement in a hot function costs a lookup).
    from langgraph.runtime import get_runtime

    return get_runtime


def _end(state: Any, run_id: UUID, response: Any = None, error: BaseException | None = None) -> None:
    call = state.calls.pop(run_id, None)
    if call is None:
        return
    sink = call.sink
    if sink is not None:
        sink.done = True
        try:
            oa.RAW_SINK.reset(call.sink_token)
        except ValueError:  # ended in another context; the done flag already disarms it
            pass
    try:
        if error is not None:
            fields = {"observation": _observation(call), "policy": {"name": call.model},
                      "sampling": convert.sampling(call.params), "error": f"{type(error).__name__}: {error}"}
        elif sink is not None and sink.response is not None:
            fields = oa.call_fields(sink.path, sink.request or {}, sink.response)
            obs = fields["observation"]
            mine = _observation(call)
            obs["messages"] = call.messages or obs["messages"]
            for k in ("tools", "tool_choice"):
                if obs.get(k) is None and k in mine:
                    obs[k] = mine[k]
        else:
            fields = _fields_from_generation(call, response)
        run = call.task.run
        aid = run.record(call.task, "llm", fields, call.deps, call.started)
        tools.note_calls(run, aid, call.task.agent, (fields.get("output") or {}).get("tool_calls"))
        if error is None and (tr := tools.current_tool_run(state)) is not None and tr.task is call.task:
            tr.made_inside(aid)
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
        "observation": _observation(call),
        "output": {"text": gen.text or "", "token_ids": ids, "logprobs": lps, "tool_calls": convert.tool_calls(msg),
                   "finish_reason": info.get("finish_reason") or rmeta.get("finish_reason")},
        "sampling": convert.sampling(call.params),
        "policy": {"name": call.model},
        "metadata": {"token_data_dropped": problem} if problem else {},
    }


class MarftCallbackHandler(BaseCallbackHandler):
    """Records the model calls and tool executions of captured LangGraph tasks (see module doc)."""

    run_inline = True  # called in the caller's context (the raw-response sink is a context variable)
    raise_error = False
    ignore_retriever = True
    ignore_agent = False  # tool events go through the "agent" switch
    ignore_retry = True
    ignore_custom_event = True
    state: Any = None  # the running capture's LangGraphState (``attach``); None: disarmed

    def on_chat_model_start(self, serialized: dict, messages: list[list], *, run_id: UUID,
                            metadata: dict | None = None, **kw: Any) -> None:
        state = self.state
        if state is None:
            return
        try:
            for msgs in messages:
                _start(state, serialized, msgs, run_id, metadata, kw)
        except Exception as e:  # noqa: BLE001 - capture must not break the app
            capture_error("langgraph.model_start", e)

    def on_llm_start(self, serialized: dict, prompts: list[str], *, run_id: UUID,
                     metadata: dict | None = None, **kw: Any) -> None:
        state = self.state
        if state is None:
            return
        try:
            for p in prompts:
                _start(state, serialized, [{"role": "user", "content": p}], run_id, metadata, kw)
        except Exception as e:  # noqa: BLE001
            capture_error("langgraph.model_start", e)

    def on_llm_end(self, response: Any, *, run_id: UUID, **kw: Any) -> None:
        state = self.state
        if state is not None and state.calls:
            _end(state, run_id, response)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kw: Any) -> None:
        state = self.state
        if state is not None and state.calls:
            _end(state, run_id, error=error)

    @property
    def ignore_chain(self) -> bool:
        # Chain events only matter to find root runs in a capture() block without the precision tier.
        state = self.state
        return state is None or not state.roots_tracked

    def on_chain_start(self, serialized: dict | None, inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                       **kw: Any) -> None:
        state = self.state
        if parent_run_id is None and state is not None:
            with guarded("langgraph.run_start"):
                _root_started(state, run_id, inputs)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kw: Any) -> None:
        state = self.state
        if parent_run_id is None and state is not None and state.roots:
            with guarded("langgraph.finish"):
                _root_ended(state, run_id, outputs)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None,
                       **kw: Any) -> None:
        state = self.state
        if parent_run_id is None and state is not None and state.roots:
            with guarded("langgraph.finish"):
                _root_ended(state, run_id, None, error)

    def on_tool_start(self, serialized: dict, input_str: str, *, run_id: UUID, metadata: dict | None = None,
                      inputs: dict | None = None, **kw: Any) -> None:
        state = self.state
        if state is None:
            return
        try:
            task = find_task(state, metadata or {})
            if task is not None:
                name = kw.get("name") or (serialized or {}).get("name") or "tool"
                args = inputs if inputs is not None else input_str
                tools.start(task, run_id, str(name), args, kw.get("tool_call_id"), node_attempt())
        except Exception as e:  # noqa: BLE001
            capture_error("langgraph.tool_start", e)

    def on_tool_end(self, output: Any, *, run_id: UUID, **kw: Any) -> None:
        state = self.state
        if state is not None:
            tools.end(state, run_id, output)

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kw: Any) -> None:
        state = self.state
        if state is not None:
            tools.end(state, run_id, error=error)


# Public tier inside capture() without the precision tier: each root run (a chain start without a
# parent) is a run of its own, found through RUN (the state's ``roots``, ``roots_tracked``).


def _root_started(state: Any, run_id: UUID, inputs: Any) -> None:
    h = CAPTURE_HANDLER.get()
    if h is None or RUN.get() is not None:
        return
    run = h.new_run(inputs)
    state.roots[run_id] = (run, RUN.set(run))


def _root_ended(state: Any, run_id: UUID, outputs: Any, error: BaseException | None = None) -> None:
    got = state.roots.pop(run_id, None)
    if got is None:
        return
    run, token = got
    try:
        RUN.reset(token)
    except ValueError:  # ended in another context
        pass
    if run.task_ids or run.public or run.recorder.max_step() is not None:  # a graph that recorded something
        run.finish(jsonable(outputs) if error is None else None, error)


HANDLER = MarftCallbackHandler()
# Set inside ``capture()`` blocks: LangChain's configure hook adds HANDLER to every run there.
ACTIVE: contextvars.ContextVar[MarftCallbackHandler | None] = contextvars.ContextVar(
    "marft_langgraph_callbacks", default=None)
# The handler of a ``capture()`` block in this context (the runs it opens take its settings).
CAPTURE_HANDLER: contextvars.ContextVar[Any] = contextvars.ContextVar("marft_langgraph_capture", default=None)


def attach(state: Any) -> None:
    """Point HANDLER at the running capture's state (None: it ignores every event). The first time,
    LangChain's configure hook is registered for ``ACTIVE``: LangChain cannot unregister one, and
    it adds the handler only while the variable is set (inside ``capture()`` blocks)."""
    if state is not None and not _HOOKED:
        from langchain_core.tracers.context import register_configure_hook

        register_configure_hook(ACTIVE, inheritable=True)
        _HOOKED.append(True)
    HANDLER.state = state


_HOOKED: list[bool] = []  # whether ``ACTIVE`` is registered with LangChain (once per process)


def with_handler(config: Any) -> Any:
    """``config`` with HANDLER among its callbacks (a list, or a manager that gets a copy)."""
    cbs = config.get("callbacks") if config else None
    if cbs is None:
        new: Any = [HANDLER]
    elif isinstance(cbs, list):
        new = cbs if HANDLER in cbs else [*cbs, HANDLER]
    else:  # a BaseCallbackManager
        new = cbs.copy()
        new.add_handler(HANDLER, inherit=True)
    return {**config, "callbacks": new}
