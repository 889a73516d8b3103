"""OpenTelemetry in both directions: spans from any instrumented app -> Episodes, and our actions -> spans.

Spans -> Episodes
    ``EpisodeSpanProcessor(store)`` (add to a ``TracerProvider``) or ``EpisodeSpanExporter(store)``
    (behind a ``BatchSpanProcessor``, or fed by an OTLP receiver) collect the spans of each trace
    and, when the trace's local root span ends, turn it into one Episode (``source="otel"``, id =
    trace id) and ``store.submit`` it. ``spans_to_episode(spans)`` is the conversion itself.
    Understood producers:
    - GenAI semantic conventions (``gen_ai.operation.name`` = ``chat``/``text_completion``/
      ``generate_content`` -> llm action, ``execute_tool`` -> tool action; agent from the nearest
      ``invoke_agent`` ancestor's ``gen_ai.agent.name``, else the request model);
    - OpenInference (``openinference.span.kind`` LLM/TOOL; agent from the ``agent_name`` metadata
      or the LangGraph node path in ``langgraph_checkpoint_ns``; step from ``langgraph_step``);
    - our own emitted spans (``marft.*``: exact ids, steps, dependencies, token ids, versions).
    Messages: ``text`` parts -> content, ``tool_call`` parts -> assistant ``tool_calls``,
    ``tool_call_response`` parts -> tool messages (``tool_call_id`` = the part's id, content = its
    result); other part types are kept as text and counted (``capture_stats()`` under
    ``otel.unknown_part``, ``metadata["unknown_parts"]``). ``gen_ai.tool.definitions`` (or
    OpenInference's ``llm.tools``) -> ``Observation.tools``. A tool span is a tool step in the
    MCP / LangChain shape (``tool.name``, ``tool.arguments``, ``tool_call_id``).
    Dependencies without ``marft.depends_on``: parentage (earlier actions made directly by this
    action's agent or an enclosing agent, not those inside a sibling sub-agent's span), message
    flow (earlier actions whose output text, or a JSON output re-serialised, occurs in this
    action's input messages or its agent span's input) and tool-call ids (an assistant turn's
    tool call X: the model call that emitted X; a tool message answering X: the tool step that
    ran X, else that model call). A tool step answering a recorded call depends on that call
    alone (plus what ran inside it); one without a known call id takes parentage. A tool span is recorded at its end, after what ran
    inside it: an agent run as a tool (its ``invoke_agent`` span a child of the ``execute_tool``
    span) gives the tool step an edge from the sub-agent's action whose output is the tool's result
    (else from its last one); the first action below a span still open (a model call around an
    ADK ``AgentTool``) depends on it, the first below a tool span on the call that asked for that
    tool. A handoff tool step (``transfer_to_agent`` / ``handoff_to_agent`` naming ``agent_name``,
    ``transfer_to_<agent>``) is a source of the named agent's next action. Span links to actions of
    the trace are dependencies. Agents: ``gen_ai.agent.name``, OpenInference's ``agent.name``, an
    ``AGENT`` span's name (``CodeAgent.run`` -> ``CodeAgent``); a workflow (``invoke_workflow``,
    named by ``gen_ai.workflow.name`` or, since GenAI conventions 0.1.0, ``gen_ai.agent.name``) is
    never an agent. Spans of traces that never finish are kept up to ``max_traces``;
    older ones are dropped and counted.

Actions -> spans (``integrations.otel_emit``, re-exported here)
    ``SpanEmitter(tracer_provider=None, capture_content=True).instrument()`` emits every finished
    episode as GenAI-convention spans (``invoke_workflow marft`` root, one ``chat {model}`` /
    ``execute_tool {agent}`` / ``invoke_agent {agent}`` span per action, with the action's real
    start/end times and span links to its dependencies), so existing tracing backends see them.
    Token ids, log-probs, steps, dependencies and adapter versions go under ``marft.*``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ...capture_errors import guarded
from .emit import SpanEmitter
from .episode import dead_letter_record, raw_span, spans_to_episode
from .spans import call_kind
from ...seams import EpisodeSink


# -- collecting traces ---------------------------------------------------------------------------


class _Assembler:
    def __init__(self, store: EpisodeSink, source: str, max_traces: int, include_own: bool):
        self.store = store
        self.source = source
        self.max_traces = max_traces
        self.include_own = include_own
        self.lock = threading.Lock()
        self.traces: OrderedDict[int, list[Any]] = OrderedDict()
        self.dropped_traces = 0
        self.episodes = 0

    def add(self, span: Any) -> None:
        with guarded("otel.collect"):
            tid = span.context.trace_id
            done = None
            with self.lock:
                spans = self.traces.setdefault(tid, [])
                spans.append(span)
                self.traces.move_to_end(tid)
                if span.parent is None or span.parent.is_remote:
                    done = self.traces.pop(tid)
                while len(self.traces) > self.max_traces:
                    self.traces.popitem(last=False)
                    self.dropped_traces += 1
            if done is not None:
                self._convert(done)

    def _convert(self, spans: list[Any]) -> None:
        if not self.include_own and any("marft.episode.id" in (s.attributes or {}) for s in spans):
            return  # our own emitted spans: the episode is stored already
        with guarded("otel.convert"):
            trace, refused = f"otel trace {format(spans[0].context.trace_id, '032x')}", []
            try:
                # Reading the spans is inside the try: a span that cannot be read (too-deep
                # metadata) dead-letters its trace rather than losing it.
                if not any(call_kind(s.attributes or {}) for s in spans):
                    return  # a trace without model or tool calls is not an episode
                ep = spans_to_episode(spans, source=self.source, limits=getattr(self.store, "limits", None),
                                      refused=refused)
            except Exception as e:  # refused by the record model (past a record limit, say): kept as a dead letter
                self.store.dead_letter(dead_letter_record(e, trace), [raw_span(s) for s in spans])
                raise
            self.store.submit(ep)
            self.episodes += 1
            for span, e in refused:  # left out of the episode: kept beside it, as it came
                self.store.dead_letter(dead_letter_record(e, f"{trace} span {format(span.context.span_id, '016x')}"), [raw_span(span)])

    def flush_pending(self) -> None:
        with self.lock:
            pending = list(self.traces.values())
            self.traces.clear()
        for spans in pending:
            self._convert(spans)


def _sdk():
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    return SpanProcessor, SpanExporter, SpanExportResult


def _make_classes():
    SpanProcessor, SpanExporter, SpanExportResult = _sdk()

    class EpisodeSpanProcessor(SpanProcessor):
        """A span processor that turns each finished trace into an Episode in ``store``."""

        def __init__(self, store: EpisodeSink | None = None, source: str = "otel", max_traces: int = 10_000,
                     include_own: bool = False):
            from ...capture.recording import resolve_store

            self.assembler = _Assembler(resolve_store(store), source, max_traces, include_own)

        def on_start(self, span: Any, parent_context: Any = None) -> None:
            pass

        def on_end(self, span: Any) -> None:
            self.assembler.add(span)

        def shutdown(self) -> None:
            self.assembler.flush_pending()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    class EpisodeSpanExporter(SpanExporter):
        """A span exporter (for ``BatchSpanProcessor`` or an OTLP receiver) that writes Episodes."""

        def __init__(self, store: EpisodeSink | None = None, source: str = "otel", max_traces: int = 10_000,
                     include_own: bool = False):
            from ...capture.recording import resolve_store

            self.assembler = _Assembler(resolve_store(store), source, max_traces, include_own)

        def export(self, spans: Sequence[Any]) -> Any:
            for s in spans:
                self.assembler.add(s)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            self.assembler.flush_pending()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    return EpisodeSpanProcessor, EpisodeSpanExporter


def __getattr__(name: str) -> Any:
    # The SDK classes are built on first use so importing this module does not import the SDK.
    if name in ("EpisodeSpanProcessor", "EpisodeSpanExporter"):
        proc, exp = _make_classes()
        globals().update(EpisodeSpanProcessor=proc, EpisodeSpanExporter=exp)
        return globals()[name]
    raise AttributeError(name)


__all__ = ["EpisodeSpanExporter", "EpisodeSpanProcessor", "SpanEmitter", "spans_to_episode"]
