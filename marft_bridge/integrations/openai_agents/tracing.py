"""Capture OpenAI Agents SDK runs (``openai-agents``) through the SDK's public tracing API.

``instrument(holder=None)`` creates the capture's state and makes sure the SDK's processors hold
``trace_processor()`` exactly once, whatever the app did first: it is added unless the list already
holds it (by identity) or another processor of its type (an app that called
``agents.set_trace_processors([trace_processor()])``, as advised for apps that drop the OpenAI
exporter, gets no second one), checked again on every ``instrument`` (an app that replaced the list
since gets it back); ``uninstrument(holder)`` drops the state with the last holder and takes out the
processor it added, unless the app set its own list since. The processor keeps no state (the SDK cannot unregister a
processor added with ``add_trace_processor``; one left behind does nothing), and each event counts
once even when an app registered it twice. ``marft_bridge.episode`` / ``capture`` blocks
instrument it for the process (when ``agents`` has been imported).

Tracing must be on for the SDK to report runs: with ``set_tracing_disabled(True)`` or
``RunConfig(tracing_disabled=True)`` the first model request of such a run inside an open capture
logs one warning naming the fix (keep tracing on and replace the exporter:
``agents.set_trace_processors([trace_processor()])``); nothing else changes.

What is a run: one SDK trace, i.e. one ``Runner.run`` / ``run_sync`` / ``run_streamed`` call, or
every run inside one ``with agents.trace(...)`` block (the SDK's workflow). A trace that starts
inside ``marft_bridge.episode(...)`` joins that episode; one that starts inside
``marft_bridge.capture(...)`` and outside any episode is an episode of its own (``source
"openai_agents"``, ``metadata["trace_id"]``, finished when the trace ends). Traces outside both
record nothing.

What becomes what:
- each model request of the run (the raw ``openai`` hook sees it: ``/responses``, or
  ``/chat/completions`` with ``OpenAIChatCompletionsModel``) is an ``llm`` action of the SDK agent
  whose agent span encloses it (``Agent.name``), policy = the requested model; it depends on every
  earlier action whose output its input holds: output text, the model call that emitted a tool
  call its input carries, the tool step (else the model call) a tool result answers;
- each function-tool execution (function span) is a ``kind="tool"`` action of that agent, in the
  shape of the MCP / LangChain tool steps (``observation``: the assistant tool call; ``output.text``:
  the result; ``error``; ``metadata``: ``tool.name``, ``tool.arguments``, ``tool_call_id``,
  ``latency_s``), depending on the model call that asked for it (matched by agent, name and
  arguments: the SDK's function span carries no call id);
- an agent used as a tool (``agent.as_tool(...)``: its agent span inside the function span): its
  first model call depends on the call that asked for the tool, and the tool step on the nested
  agent's final answer (the nested actions whose output the tool's result holds, else its last
  model call), in ``run_sync``, ``run`` and ``run_streamed`` alike;
- an MCP call made in a function tool's body is that tool step (``integrations.mcp``): its
  ``mcp.*`` details and the server's half join the function span's step;
- each handoff (handoff span) is the ``transfer_to_<agent>`` tool step it answers, with
  ``metadata["handoff.goto"]`` = the receiving agent; it is recorded when the next model call goes
  out (its result is the tool message that call carries; at the trace's end, the SDK's default
  transfer message), so the receiving agent's first call depends on it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from ...capture import episode_context
from ...capture import messages as msgs
from ...capture_errors import guarded
from ...capture.episode_context import CaptureState, Instrumentor, open_capture
from ...capture.recording import EpisodeRecorder
from .. import openai as oa
from .runs import Run, handoff_tool_name, tool_step, ts

log = logging.getLogger("marft_bridge.capture")

FIX = ("keep the SDK's tracing on and replace its exporter instead: "
       "agents.set_trace_processors([marft_bridge.integrations.openai_agents.trace_processor()])")


class AgentsState(CaptureState):
    """The runs being captured (by trace id) while the integration is instrumented."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: dict[str, Run] = {}
        self.capture_of_context: Callable[[], Any] = open_capture  # the open ``capture()`` block, if any
        self.added: tuple | None = None  # the SDK's processor list after ``start`` added ours
        self.warned = False

    def start(self) -> None:
        self.ensure_processor()

    def ensure_processor(self) -> None:
        """Add the processor unless the SDK's list holds it or one of its type (checked on every
        ``instrument``: an app may have replaced the list since)."""
        processors = registered_processors()
        if processors is None and self.added is not None:
            return  # unreadable list: added once already
        if processors is None or not any(p is _processor() or isinstance(p, type(_processor())) for p in processors):
            import agents

            agents.add_trace_processor(_processor())
            self.added = registered_processors(raw=True) or ()

    def stop(self) -> None:
        """Take out the processor ``start`` added, unless the app set its own list since."""
        now = registered_processors(raw=True)
        if self.added is not None and now is self.added:
            import agents

            agents.set_trace_processors([p for p in now if p is not _processor()])

    def run(self) -> Run | None:
        if not self.runs:
            return None
        from agents import get_current_trace

        t = get_current_trace()
        return self.runs.get(t.trace_id) if t is not None else None

    def find_episode(self) -> EpisodeRecorder | None:
        run = self.run()
        return run.rec if run is not None else None

    def in_task(self) -> bool:
        return self.run() is not None or self._untraced()

    def current_task(self) -> Any:
        """Inside a function tool's body: its step (an MCP call there is that tool step)."""
        run = self.run()
        if run is None:
            return None
        from agents import get_current_span

        span = get_current_span()
        return run.function_step(span.span_id if span is not None else None)

    def record_call(self, fields: dict[str, Any], started: datetime | None, kind: str) -> bool:
        """A model request inside a captured run: an action of the enclosing SDK agent."""
        run = self.run()
        if run is None:
            if self._untraced():
                self._warn()
            return False
        from agents import get_current_span

        span = get_current_span()
        span_id = span.span_id if span is not None else None
        agent = run.agent_of(span_id) or fields["policy"]["name"]
        messages = fields["observation"]["messages"]
        handed = run.flush_handoffs(messages)
        rec = run.rec
        rec.set_task(next((m.get("content") for m in messages if m.get("role") == "user"), None))
        deps = oa.call_inputs(rec, fields)
        # The agent a handoff went to reads it, also when a handoff input_filter took the transfer out
        deps += [step for to, step in handed if to == agent and step not in deps]
        asking = run.asking_call(span_id)  # an agent used as a tool: its first call reads the tool call
        if asking is not None:
            deps.append(asking)
        aid = rec.record_action(agent, kind=kind, depends_on=deps, started_at=started, **fields)
        run.note(span_id, aid, agent, fields["output"].get("tool_calls") or [])
        oa.note_response(rec, aid, fields, deps)
        return True

    def _untraced(self) -> bool:
        """An SDK run with tracing off is running here, inside an open capture."""
        if self.warned or (self.capture_of_context is None or self.capture_of_context() is None) \
                and episode_context.CURRENT_EPISODE.get() is None:
            return False
        from agents import get_current_trace
        from agents.tracing.traces import NoOpTrace

        return isinstance(get_current_trace(), NoOpTrace)

    def _warn(self) -> None:
        with self.lock:
            if self.warned:
                return
            self.warned = True
        log.warning("marft capture: an OpenAI Agents SDK run with tracing disabled (set_tracing_disabled(True) or "
                    "RunConfig(tracing_disabled=True)) is not captured; %s", FIX)

    # -- the processor's events ----------------------------------------------------------------

    def trace_start(self, trace: Any) -> None:
        with self.lock:
            if trace.trace_id in self.runs:
                return  # the processor is registered twice: the event counts once
        cap = self.capture_of_context() if self.capture_of_context is not None else None
        rec = episode_context.current_episode()
        if rec is not None:
            run = Run(rec, False, cap)
        elif cap is not None:
            rec = EpisodeRecorder(cap.store, source="openai_agents", registry=cap.registry,
                                  metadata={"trace_id": trace.trace_id, "workflow": trace.name})
            run = Run(rec, True, cap)
        else:
            return
        with self.lock:
            self.runs.setdefault(trace.trace_id, run)

    def trace_end(self, trace: Any) -> None:
        with self.lock:
            run = self.runs.pop(trace.trace_id, None)
        if run is None:
            return
        with guarded("openai_agents.trace_end", run.rec):
            run.flush_handoffs(None)
        if run.owned:
            run.rec.finish("failed" if run.error else "completed", run.error)
            if run.capture is not None:
                run.capture.episode_ids.append(run.rec.id)

    def span_end(self, run: Run, span: Any) -> None:
        data, err = span.span_data, span.error
        error = _error_text(err)
        t0 = run.end(span.span_id)
        if t0 is False:
            return  # already handled (a processor registered twice)
        latency = time.perf_counter() - t0 if t0 is not None else None
        if data.type == "function":
            agent = run.agent_of(span.parent_id) or "agent"
            call = run.call_of(span.span_id, agent, data.name, data.input)
            text = _tool_text(data.output)
            deps = [call["llm"]] if call is not None else [x for x in [run.rec.last_action_id(agent)] if x]
            deps += run.nested_answer(span.span_id, text)
            inner = run.functions.pop(span.span_id, None)  # a protocol call made inside it (MCP)
            recorded = False
            try:
                tool_step(run, agent, call, data.name, call["args"] if call else data.input, text, error,
                          ts(span.started_at), ts(span.ended_at), latency,
                          deps + (inner.deps if inner else []), inner.extra if inner else None,
                          inner.reserved_id if inner else None)
                recorded = True
            finally:
                if inner is not None:
                    inner.settle(recorded)
        elif data.type == "handoff":
            frm = data.from_agent or run.agent_of(span.parent_id) or "agent"
            call = run.take_call(frm, handoff_tool_name(data.to_agent or ""), None)
            if call is None:  # a custom handoff tool name: the one transfer call still pending
                call = run.take_transfer(frm)
            with run.lock:
                run.handoffs.append({"from": frm, "to": data.to_agent, "call": call, "error": error,
                                     "started": ts(span.started_at), "ended": ts(span.ended_at)})
        elif data.type in ("agent", "turn") and error and run.error is None:  # turn: SDK 0.2x's guardrail trips
            run.error = f"{getattr(data, 'name', None) or getattr(data, 'agent_name', None) or 'agent'}: {error}"
        elif data.type == "guardrail" and getattr(data, "triggered", False) and run.error is None:
            run.error = f"guardrail {data.name}: tripwire triggered"  # the SDK raises it into the app


def _tool_text(output: Any) -> str:
    """A function span's output as the text the model was given: content parts (an MCP tool's
    ``{"type": "text", "text": ...}``, or a list of them) by their text, other values as the SDK
    turns them into the tool message (``str``)."""
    if output is None:
        return ""
    if isinstance(output, str):
        return output
    parts = output if isinstance(output, list) else [output]
    if parts and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        return msgs.content_text(parts)
    return str(output)


def _error_text(err: Any) -> str | None:
    """A span's error: its message, and the exception text the SDK puts in its data when it may
    (a failed function tool: ``{"tool_name", "error"}``)."""
    if not err:
        return None
    if not isinstance(err, dict):
        return str(err)
    msg = str(err.get("message") or err)
    data = err.get("data")
    detail = data.get("error") if isinstance(data, dict) else None
    return f"{msg}: {detail}" if detail and str(detail) not in msg else msg


def _make_processor() -> Any:
    from agents import TracingProcessor

    class EpisodeTraceProcessor(TracingProcessor):
        """Turns captured SDK traces into episodes (see ``integrations.openai_agents``); stateless:
        it hands each event to the running capture's state, and does nothing while there is none."""

        def on_trace_start(self, trace: Any) -> None:
            state = AGENTS.state
            if state is not None:
                with guarded("openai_agents.trace_start"):
                    state.trace_start(trace)

        def on_trace_end(self, trace: Any) -> None:
            state = AGENTS.state
            if state is not None:
                state.trace_end(trace)

        def on_span_start(self, span: Any) -> None:
            state = AGENTS.state
            run = state.runs.get(span.trace_id) if state is not None and state.runs else None
            if run is not None:
                with guarded("openai_agents.span_start", run.rec):
                    run.start(span)

        def on_span_end(self, span: Any) -> None:
            state = AGENTS.state
            run = state.runs.get(span.trace_id) if state is not None and state.runs else None
            if run is not None:
                with guarded("openai_agents.span_end", run.rec):
                    state.span_end(run, span)

        def shutdown(self) -> None:
            pass

        def force_flush(self) -> None:
            pass

    return EpisodeTraceProcessor()


# The one processor: the SDK keeps what it is given for the life of the process, so the processor
# is a module-level object holding nothing but the way to the running state (``AGENTS``).
_PROCESSOR: list[Any] = []
_PROCESSOR_LOCK = threading.Lock()


def _processor() -> Any:
    with _PROCESSOR_LOCK:
        if not _PROCESSOR:
            _PROCESSOR.append(_make_processor())
        return _PROCESSOR[0]


def trace_processor() -> Any:
    """The processor capture registers (for apps that set their own processor list)."""
    return _processor()


def registered_processors(raw: bool = False) -> Any:
    """The SDK's registered processors, read from its provider (the SDK has no public reader; None
    where it cannot be read): a list, or with ``raw`` the SDK's own (immutable) tuple."""
    with guarded("openai_agents.processors"):
        from agents.tracing import get_trace_provider

        multi = getattr(get_trace_provider(), "_multi_processor", None)
        procs = getattr(multi, "_processors", None)
        if isinstance(procs, (list, tuple)):
            return procs if raw else list(procs)
    return None


AGENTS = Instrumentor(AgentsState)


def instrument(holder: Any = None, capture_of_context: Callable[[], Any] | None = None) -> bool:
    """Make the SDK's runs captured while ``holder`` holds (None: the process); False without the SDK.

    ``capture_of_context()``: the ``capture()`` block open in this context (an object with
    ``store``, ``registry``, ``episode_ids``), or None (default: ``episode_context.open_capture``)."""
    try:
        import agents  # noqa: F401
    except ImportError:
        return False
    state = AGENTS.instrument(holder)
    with guarded("openai_agents.instrument"):
        state.ensure_processor()
    if capture_of_context is not None:
        state.capture_of_context = capture_of_context
    return True


def uninstrument(holder: Any = None) -> None:
    AGENTS.uninstrument(holder)


__all__ = ["AGENTS", "instrument", "trace_processor", "uninstrument"]
