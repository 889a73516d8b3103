"""Capture OpenAI Agents SDK runs (``openai-agents``) through the SDK's public tracing API.

``install()`` registers one ``TracingProcessor`` with ``agents.add_trace_processor`` (idempotent;
``marft_bridge.episode`` and ``marft_bridge.capture`` call it). An app that later replaces the
processors with ``agents.set_trace_processors([...])`` must include ``trace_processor()`` in the
list. Tracing must be on (``RunConfig(tracing_disabled=True)`` / ``set_tracing_disabled(True)``
hide the run from capture; nothing breaks, nothing is recorded).

What is a run: one SDK trace, i.e. one ``Runner.run`` / ``run_sync`` / ``run_streamed`` call, or
every run inside one ``with agents.trace(...)`` block (the SDK's workflow). A trace that starts
inside ``marft_bridge.episode(...)`` joins that episode; one that starts inside
``marft_bridge.capture(...)`` and outside any episode is an episode of its own (``source
"openai_agents"``, ``metadata["trace_id"]``, finished when the trace ends). Traces outside both
record nothing.

What becomes what:
- each model request of the run (the raw ``openai`` hook sees it: ``/responses``, or
  ``/chat/completions`` with ``OpenAIChatCompletionsModel``) is an ``llm`` action of the SDK agent
  whose agent span encloses it (``Agent.name``), policy = the requested model; it depends on the
  earlier actions whose output text its input holds and, by tool-call id, on the tool steps (else
  model calls) its input's tool calls/results refer to;
- each function-tool execution (function span) is a ``kind="tool"`` action of that agent, in the
  shape of the MCP / LangChain tool steps (``observation``: the assistant tool call; ``output.text``:
  the result; ``error``; ``metadata``: ``tool.name``, ``tool.arguments``, ``tool_call_id``,
  ``latency_s``), depending on the model call that asked for it (matched by agent, name and
  arguments: the SDK's function span carries no call id);
- each handoff (handoff span) is the ``transfer_to_<agent>`` tool step it answers, with
  ``metadata["handoff.goto"]`` = the receiving agent; it is recorded when the next model call goes
  out (its result is the tool message that call carries; at the trace's end, the SDK's default
  transfer message), so the receiving agent's first call depends on it.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from typing import Any

from .. import episode_context
from ..capture_errors import guarded
from ..messages import arguments_json, canonical_arguments, tool_call
from ..recording import EpisodeRecorder
from . import openai as oa

_LOCK = threading.Lock()
_RUNS: dict[str, _Run] = {}  # trace id -> run
_PROCESSOR: list[Any] = []  # the one processor
_INSTALLED: list[bool] = []


def _ts(value: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _handoff_tool_name(agent: str) -> str:
    # What ``agents.Handoff.default_tool_name`` makes of an agent name.
    import re

    return re.sub(r"[^a-zA-Z0-9_]", "_", re.sub(r"\s", "_", f"transfer_to_{agent}")).lower()


class _Run:
    """One captured SDK trace: its recorder, spans seen, tool calls not yet run."""

    def __init__(self, rec: EpisodeRecorder, owned: bool, capture: Any) -> None:
        self.rec, self.owned, self.capture = rec, owned, capture
        self.lock = threading.Lock()
        self.spans: dict[str, tuple[str, str | None, str | None]] = {}  # id -> (type, name, parent id)
        self.pending: list[dict[str, Any]] = []  # tool calls asked for: id, name, args, llm, agent
        self.handoffs: list[dict[str, Any]] = []  # handoff spans ended, not yet recorded
        self.error: str | None = None
        self.t0: dict[str, float] = {}

    def agent_of(self, span_id: str | None) -> str | None:
        seen = 0
        with self.lock:
            while span_id is not None and seen < 1000:
                kind, name, parent = self.spans.get(span_id, (None, None, None))
                if kind == "agent":
                    return name
                span_id, seen = parent, seen + 1
        return None

    def take_call(self, agent: str | None, name: str, args: Any) -> dict | None:
        """The pending tool call of ``agent`` this execution answers (first by name and arguments)."""
        key = canonical_arguments(args) if args is not None else None
        with self.lock:
            mine = [c for c in self.pending if agent is None or c["agent"] == agent]
            for ok in (lambda c: c["name"] == name and (key is None or c["key"] == key),
                       lambda c: c["name"] == name):
                hit = next((c for c in mine if ok(c)), None)
                if hit is not None:
                    self.pending.remove(hit)
                    return hit
        return None


def _current_run() -> _Run | None:
    from agents import get_current_trace

    t = get_current_trace()
    return _RUNS.get(t.trace_id) if t is not None and _RUNS else None


# -- recording --------------------------------------------------------------------------------


def _tool_step(run: _Run, agent: str, call: dict | None, name: str, args: Any, text: str, error: str | None,
               started: datetime | None, ended: datetime | None, latency: float | None,
               extra: dict[str, Any] | None = None) -> None:
    call_id = call["id"] if call is not None else None
    args_json = arguments_json(args)
    try:
        parsed = json.loads(args_json)
    except ValueError:
        parsed = args_json
    tc = tool_call(call_id, name, args_json)
    meta = {"tool.name": name, "tool.arguments": parsed, "tool_call_id": call_id, "latency_s": latency, **(extra or {})}
    deps = [call["llm"]] if call is not None else [x for x in [run.rec.last_action_id(agent)] if x]
    aid = run.rec.record_action(
        agent, kind="tool", depends_on=deps, started_at=started, ended_at=ended, error=error,
        observation={"messages": [{"role": "assistant", "content": None, "tool_calls": [tc]}]},
        output={"text": text}, metadata={k: v for k, v in meta.items() if v is not None})
    oa.note_tool_step(run.rec, call_id, aid)


def _flush_handoffs(run: _Run, messages: list[dict] | None) -> None:
    """Record the handoffs seen so far; their result is the tool message answering the call (if given)."""
    with run.lock:
        todo, run.handoffs = run.handoffs, []
    for h in todo:
        text = json.dumps({"assistant": h["to"]})  # the SDK's default transfer message
        if h["call"] is not None:
            for m in messages or ():
                if m.get("role") == "tool" and m.get("tool_call_id") == h["call"]["id"]:
                    text = m.get("content") or ""
        name = h["call"]["name"] if h["call"] is not None else _handoff_tool_name(h["to"] or "")
        args = h["call"]["args"] if h["call"] is not None else "{}"
        _tool_step(run, h["from"], h["call"], name, args, text, h["error"], h["started"], h["ended"], None,
                   {"handoff.goto": h["to"]})


def _in_task() -> bool:
    return _current_run() is not None


def _record(fields: dict[str, Any], started: datetime | None = None, kind: str = "llm") -> bool:
    """A model request inside a captured run: an action of the enclosing SDK agent."""
    run = _current_run()
    if run is None:
        return False
    from agents import get_current_span

    span = get_current_span()
    agent = run.agent_of(span.span_id if span is not None else None) or fields["policy"]["name"]
    messages = fields["observation"]["messages"]
    _flush_handoffs(run, messages)
    rec = run.rec
    rec.set_task(next((m.get("content") for m in messages if m.get("role") == "user"), None))
    aid = rec.record_action(agent, kind=kind, depends_on=oa.message_dependencies(rec, messages),
                            started_at=started, **fields)
    calls = fields["output"].get("tool_calls") or []
    oa.note_tool_calls(rec, aid, calls)
    with run.lock:
        for c in calls:
            fn = c.get("function") or {}
            run.pending.append({"id": c.get("id"), "name": fn.get("name"), "args": fn.get("arguments"),
                                "key": canonical_arguments(fn.get("arguments")), "llm": aid, "agent": agent})
    return True


# -- the processor ----------------------------------------------------------------------------


def _make_processor() -> Any:
    from agents import TracingProcessor

    class EpisodeTraceProcessor(TracingProcessor):
        """Turns captured SDK traces into episodes (see ``integrations.openai_agents``)."""

        def on_trace_start(self, trace: Any) -> None:
            with guarded("openai_agents.trace_start"):
                cap = _capture_of_context()
                rec = episode_context.current_episode()
                if rec is not None:
                    run = _Run(rec, False, cap)
                elif cap is not None:
                    rec = EpisodeRecorder(cap.store, source="openai_agents", registry=cap.registry,
                                          metadata={"trace_id": trace.trace_id, "workflow": trace.name})
                    run = _Run(rec, True, cap)
                else:
                    return
                with _LOCK:
                    _RUNS[trace.trace_id] = run

        def on_trace_end(self, trace: Any) -> None:
            with _LOCK:
                run = _RUNS.pop(trace.trace_id, None)
            if run is None:
                return
            with guarded("openai_agents.trace_end", run.rec):
                _flush_handoffs(run, None)
            if run.owned:
                run.rec.finish("failed" if run.error else "completed", run.error)
                if run.capture is not None:
                    run.capture.episode_ids.append(run.rec.id)

        def on_span_start(self, span: Any) -> None:
            run = _RUNS.get(span.trace_id) if _RUNS else None
            if run is None:
                return
            with guarded("openai_agents.span_start", run.rec):
                data = span.span_data
                with run.lock:
                    run.spans[span.span_id] = (data.type, getattr(data, "name", None), span.parent_id)
                    run.t0[span.span_id] = time.perf_counter()

        def on_span_end(self, span: Any) -> None:
            run = _RUNS.get(span.trace_id) if _RUNS else None
            if run is None:
                return
            with guarded("openai_agents.span_end", run.rec):
                self._span_end(run, span)

        def _span_end(self, run: _Run, span: Any) -> None:
            data, err = span.span_data, span.error
            error = str(err.get("message") or err) if err else None
            with run.lock:
                t0 = run.t0.pop(span.span_id, None)
            latency = time.perf_counter() - t0 if t0 is not None else None
            if data.type == "function":
                agent = run.agent_of(span.parent_id) or "agent"
                call = run.take_call(agent, data.name, data.input)
                text = "" if data.output is None else data.output if isinstance(data.output, str) else str(data.output)
                _tool_step(run, agent, call, data.name, call["args"] if call else data.input, text, error,
                           _ts(span.started_at), _ts(span.ended_at), latency)
            elif data.type == "handoff":
                frm = data.from_agent or run.agent_of(span.parent_id) or "agent"
                call = run.take_call(frm, _handoff_tool_name(data.to_agent or ""), None)
                if call is None:  # a custom handoff tool name: the one transfer call still pending
                    with run.lock:
                        call = next((c for c in run.pending if c["agent"] == frm
                                     and str(c["name"]).startswith("transfer_to_")), None)
                        if call is not None:
                            run.pending.remove(call)
                with run.lock:
                    run.handoffs.append({"from": frm, "to": data.to_agent, "call": call, "error": error,
                                         "started": _ts(span.started_at), "ended": _ts(span.ended_at)})
            elif data.type == "agent" and error and run.error is None:
                run.error = f"{data.name}: {error}"

        def shutdown(self) -> None:
            pass

        def force_flush(self) -> None:
            pass

    return EpisodeTraceProcessor()


# -- which capture() block is open ------------------------------------------------------------

_CAPTURE_OF_CONTEXT: list[Any] = []  # set by install(): the session's lookup of the open capture()


def _capture_of_context() -> Any:
    return _CAPTURE_OF_CONTEXT[0]() if _CAPTURE_OF_CONTEXT else None


def trace_processor() -> Any:
    """The processor capture registers (for apps that set their own processor list)."""
    with _LOCK:
        if not _PROCESSOR:
            _PROCESSOR.append(_make_processor())
        return _PROCESSOR[0]


def install(capture_of_context: Any = None) -> bool:
    """Register the trace processor, the episode finder and the task context; False without the SDK.

    ``capture_of_context()``: the ``capture()`` block open in this context (an object with
    ``store``, ``registry``, ``episode_ids``), or None."""
    try:
        import agents
    except ImportError:
        return False
    with _LOCK:
        if capture_of_context is not None and not _CAPTURE_OF_CONTEXT:
            _CAPTURE_OF_CONTEXT.append(capture_of_context)
        if _INSTALLED:
            return True
        _INSTALLED.append(True)
    agents.add_trace_processor(trace_processor())
    episode_context.register_episode_finder(_find_episode)
    episode_context.register_task_context(_in_task, _record)
    return True


def _find_episode() -> EpisodeRecorder | None:
    run = _current_run()
    return run.rec if run is not None else None


__all__ = ["install", "trace_processor"]
