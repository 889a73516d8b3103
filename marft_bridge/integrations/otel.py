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
    (else from its last one). Spans of traces that never finish are kept up to ``max_traces``;
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
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

from .. import messages as msgs
from ..capture_errors import capture_error, guarded
from ..errors import RecordError
from ..schema import Episode, as_record_error
from .otel_emit import SAMPLING_ATTRS as _SAMPLING
from .otel_emit import SpanEmitter
from .otel_messages import genai_messages as _genai_messages
from .otel_messages import loads as _loads
from .otel_messages import offered_tools as _tools
from .otel_messages import oi_messages as _oi_messages
from .otel_messages import tool_fields as _tool_fields

LLM_OPS = {"chat", "text_completion", "generate_content"}


# -- reading spans -------------------------------------------------------------------------------


# The semantic conventions' event carrying a call's content when an instrumentation records it as
# events only (gen_ai.input.messages, gen_ai.output.messages, gen_ai.system_instructions, ...).
DETAILS_EVENT = "gen_ai.client.inference.operation.details"


def _attrs(span: Any) -> dict[str, Any]:
    """The span's attributes, and those of its operation-details event where the span lacks them."""
    out = dict(span.attributes or {})
    for event in getattr(span, "events", None) or ():
        if event.name == DETAILS_EVENT:
            for k, v in (event.attributes or {}).items():
                out.setdefault(k, v)
    return out


def _dt(ns: int | None) -> datetime | None:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc) if ns else None


class _Span:
    """One span, classified."""

    def __init__(self, span: Any):
        self.raw = span
        self.id = span.context.span_id
        self.parent_id = span.parent.span_id if span.parent is not None else None
        self.start = span.start_time or 0
        self.end = span.end_time or self.start
        self.attrs = _attrs(span)
        try:
            self.meta = _loads(self.attrs.get("metadata")) or {}
        except RecursionError:
            # Too deep to parse: refused (the trace dead-lettered), as a too-deep record field is.
            raise RecordError(None, "metadata", f"span {self.id:016x}: JSON nested too deep to read (far past "
                              "the max_depth limit)") from None
        if not isinstance(self.meta, dict):
            self.meta = {}
        a = self.attrs
        op = a.get("gen_ai.operation.name")
        kind = a.get("openinference.span.kind")
        self.kind: str | None = None  # llm | tool | env | agent | workflow
        self.own = "marft.action.id" in a  # emitted by SpanEmitter: exact fields under marft.*
        if self.own:
            self.kind = {"llm": "llm", "tool": "tool"}.get(a.get("marft.kind"), "env")
        elif op in LLM_OPS or kind == "LLM":
            self.kind = "llm"
        elif op == "execute_tool" or kind == "TOOL":
            self.kind = "tool"
        elif op == "invoke_agent" or kind == "AGENT" or (
                kind == "CHAIN" and self.meta.get("langgraph_node") and not str(self.meta["langgraph_node"]).startswith("__")):
            self.kind = "agent"
        elif op in ("invoke_workflow", "create_agent") or (kind == "CHAIN" and self.parent_id is None):
            self.kind = "workflow"

    def agent_name(self) -> str | None:
        a = self.attrs
        if a.get("gen_ai.agent.name"):
            return str(a["gen_ai.agent.name"])
        return _node_path(self.meta)

    def input_text(self) -> str:
        a = self.attrs
        parts = [str(a.get("input.value") or "")]
        parts += [m.get("content") or "" for m in _genai_messages(a.get("gen_ai.input.messages"))]
        return "\n".join(p for p in parts if p)

    def error(self) -> str | None:
        status = getattr(self.raw, "status", None)
        if status is not None and getattr(status.status_code, "name", "") == "ERROR":
            return status.description or self._exception() or "error"
        return None

    def _exception(self) -> str | None:
        """The span's recorded exception (its ``exception`` event), as ``Type: message``."""
        for event in getattr(self.raw, "events", None) or ():
            if event.name == "exception":
                ev = event.attributes or {}
                kind, msg = ev.get("exception.type"), ev.get("exception.message")
                return ": ".join(str(x) for x in (kind, msg) if x) or None
        return None


def _message_finish(a: Any) -> Any:
    """The finish reason the GenAI convention puts on each output message (``finish_reason``)."""
    for m in _loads(a.get("gen_ai.output.messages")) or ():
        if isinstance(m, dict) and m.get("finish_reason"):
            return m["finish_reason"]
    return None


def _node_path(meta: dict[str, Any]) -> str | None:
    ns = meta.get("langgraph_checkpoint_ns")
    node = meta.get("langgraph_node")
    if not node and not ns:
        return None
    parts = [seg.partition(":")[0] for seg in str(ns).split("|")] if ns else [str(node)]
    if meta.get("agent_name"):
        parts[-1] = str(meta["agent_name"])
    return "/".join(parts)


def _fields(s: _Span) -> dict[str, Any]:
    """Observation, output, sampling and policy of one llm/tool span; ``metadata["unknown_parts"]``
    lists message part types kept as text."""
    a = s.attrs
    if s.kind == "env" and not s.own:
        return {"observation": {"messages": [{"role": "user", "content": s.input_text()}]},
                "output": {"text": str(a.get("output.value") or "")}, "token_source": None, "metadata": {}}
    if s.kind == "tool":
        return _tool_fields(a)
    unknown: list[str] = []
    messages = _genai_messages(a.get("gen_ai.input.messages"), unknown) or _oi_messages(a, "llm.input_messages.")
    if a.get("gen_ai.system_instructions") and not any(m["role"] == "system" for m in messages):
        sys_text = "".join(p.get("content", "") for p in _loads(a["gen_ai.system_instructions"]) or []
                           if isinstance(p, dict))
        messages.insert(0, {"role": "system", "content": sys_text})
    outs = _genai_messages(a.get("gen_ai.output.messages"), unknown) or _oi_messages(a, "llm.output_messages.")
    out_msg = next((m for m in outs if m["role"] == "assistant"), outs[0] if outs else {"content": ""})
    finish = a.get("gen_ai.response.finish_reasons") or a.get("llm.finish_reason") or _message_finish(a)
    if isinstance(finish, (list, tuple)):
        finish = finish[0] if finish else None
    params = _loads(a.get("llm.invocation_parameters")) or {}
    extra = params.get("extra_body") or {} if isinstance(params, dict) else {}
    sampling = {}
    for key, field in _SAMPLING.items():
        v = a.get(f"gen_ai.request.{key}")
        if v is None and isinstance(params, dict):
            v = params.get(key, extra.get(key))
            if key == "max_tokens" and v is None:
                v = params.get("max_completion_tokens")
        if v is not None:
            sampling[field] = v
    model = (a.get("marft.policy.name") or a.get("gen_ai.request.model") or a.get("llm.model_name")
             or a.get("gen_ai.response.model") or "unknown")
    token_ids = a.get("marft.output.token_ids")
    logprobs = a.get("marft.output.logprobs")
    prompt_ids = a.get("marft.observation.prompt_token_ids")
    return {
        "observation": {"messages": messages, "tools": _tools(a),
                        "tool_choice": _loads(a["marft.observation.tool_choice"]) if s.own and
                        "marft.observation.tool_choice" in a else None,
                        "prompt_token_ids": list(prompt_ids) if prompt_ids else None},
        "output": {"text": str(out_msg.get("content") or ""), "tool_calls": out_msg.get("tool_calls"),
                   "finish_reason": str(finish) if finish else None,
                   "token_ids": list(token_ids) if token_ids is not None else None,
                   "logprobs": list(logprobs) if logprobs is not None else None},
        "sampling": sampling or None,
        "policy": None if s.own and "marft.policy.name" not in a else {"name": str(model),
                                                                        "version": a.get("marft.policy.version")},
        "token_source": a.get("marft.token_source") if s.own else ("server" if token_ids is not None else "retokenize"),
        "metadata": {"unknown_parts": unknown} if unknown else {},
    }


def spans_to_episode(spans: Iterable[Any], source: str = "otel", episode_id: str | None = None,
                     limits: Any = None, refused: list | None = None) -> Episode:
    """Turn the spans of one trace (``ReadableSpan``s, any order) into an Episode, validated under
    ``limits`` (the store's ``RecordLimits``; default: the defaults). A model or tool span that
    cannot be an action (a message past the limits, say) is left out and counted; ``refused``, when
    given, receives ``(span, exception)`` for each, for the caller to keep.

    Parent ids that loop (a span its own parent, A -> B -> A): with no span outside the loop to be
    the root there is no episode (``ValueError``; the collectors dead-letter the trace). Beside a
    real root, each looping span's ancestry is cut where it comes back to a span already on it and
    the span is kept, as one whose parent is missing is (this loses least: nothing is left out); the
    loop is counted (``capture_stats()`` under ``otel.parent_loop``; the episode's
    ``metadata["last_capture_error"]``)."""
    from ..recording import EpisodeRecorder

    nodes = [_Span(s) for s in spans]
    if not nodes:
        raise ValueError("no spans")
    by_id = {n.id: n for n in nodes}
    roots = [n for n in nodes if n.parent_id not in by_id]
    if not roots:
        raise ValueError("no root span: the parent chain of every span loops back on itself")
    root = min(roots, key=lambda n: n.start)
    trace_id = format(root.raw.context.trace_id, "032x")
    own_episode = next((n.attrs["marft.episode.id"] for n in nodes if "marft.episode.id" in n.attrs), None)

    ancestry: dict[int, list[_Span]] = {}
    looped: list[int] = []  # spans whose parent chain comes back to itself
    for n in nodes:
        # Stop at a span already on the chain: looping parent ids would otherwise never end.
        out, seen, p = [], {n.id}, by_id.get(n.parent_id)
        while p is not None and p.id not in seen:
            out.append(p)
            seen.add(p.id)
            p = by_id.get(p.parent_id)
        if p is not None:
            looped.append(n.id)
        ancestry[n.id] = out
    # Node spans with no model/tool call below them are environment steps (OpenInference shows them).
    busy = {u.id for n in nodes if n.kind in ("llm", "tool") for u in ancestry[n.id]}
    for n in nodes:
        if n.kind == "agent" and n.id not in busy and not n.own and n.meta.get("langgraph_node"):
            n.kind = "env"

    wf = next((n for n in nodes if n.kind == "workflow"), root)
    if wf.attrs.get("marft.episode.task") is not None:
        task = _loads(wf.attrs["marft.episode.task"])
    else:
        first = _genai_messages(wf.attrs.get("gen_ai.input.messages"))
        raw = first[0]["content"] if first else wf.attrs.get("input.value")
        task = _loads(raw) if isinstance(raw, str) and raw[:1] in "{[" else raw

    rec = EpisodeRecorder(None, task=task, source=source, episode_id=episode_id or own_episode or trace_id,
                          metadata={"trace_id": trace_id}, limits=limits)
    if looped:
        capture_error("otel.parent_loop", ValueError(
            f"spans {', '.join(format(i, '016x') for i in looped[:8])}{' ...' if len(looped) > 8 else ''}: "
            "parent chain loops; cut where it repeats"), rec)
    recorded: list[tuple[_Span, str, str]] = []  # span, action id, output text
    emitted: dict[str, str] = {}  # tool call id -> the model call that asked for it
    answered: dict[str, str] = {}  # tool call id -> the tool step that ran it
    # Own spans keep the episode's recording order; others go by start time, except tool spans,
    # which are recorded when they end: what ran inside them (an agent as a tool) comes first.
    order = sorted((n for n in nodes if n.kind in ("llm", "tool", "env")),
                   key=lambda n: (n.attrs.get("marft.index", 0), n.end if n.kind == "tool" and not n.own else n.start,
                                  n.end))
    for n in order:
        try:
            a = n.attrs
            fields = _fields(n)
            meta = fields.pop("metadata", None) or {}
            if meta.get("unknown_parts"):
                capture_error("otel.unknown_part", ValueError(
                    f"message part types {sorted(set(meta['unknown_parts']))} kept as text"), rec)
            if n.own:
                deps = [str(d) for d in a.get("marft.depends_on") or () if rec.get_action(str(d)) is not None]
                agent = str(a.get("gen_ai.agent.name") or "unknown")
                kind, step, aid = str(a.get("marft.kind") or n.kind), int(a.get("marft.step") or 0), str(a["marft.action.id"])
            else:
                ups = ancestry[n.id]
                agent_spans = [u for u in ups if u.kind == "agent"]
                agent = _agent(n, agent_spans)
                kind, aid = n.kind, None
                asked = emitted.get(str(meta.get("tool_call_id"))) if n.kind == "tool" else None
                deps = _deps(n, fields, agent_spans, ancestry, recorded, asked)
                if n.kind != "tool":
                    for dep in _call_links(fields["observation"]["messages"], emitted, answered):
                        if dep not in deps:
                            deps.append(dep)
                step = _step(n, ups, [rec.get_action(d).step for d in deps])
            new_id = rec.record_action(
                agent, kind=kind, step=step, depends_on=deps, error=n.error(), action_id=aid,
                started_at=_dt(n.start), ended_at=_dt(n.end), metadata={"span_id": format(n.id, "016x"), **meta},
                **fields)
            for c in (fields.get("output") or {}).get("tool_calls") or ():
                if c.get("id"):
                    emitted.setdefault(str(c["id"]), new_id)
            if kind == "tool" and meta.get("tool_call_id"):
                answered[str(meta["tool_call_id"])] = new_id
            recorded.append((n, new_id, rec.get_action(new_id).output.text))
        except Exception as e:  # noqa: BLE001 - one span's fault leaves the rest of the episode
            capture_error("otel.span", e, rec)
            if refused is not None:
                refused.append((n.raw, e))
    return _finish(rec, root, limits)


def _named(exc: Exception, record: str) -> RecordError:
    err = as_record_error(exc, record)
    return err if err.record is not None else RecordError(record, err.field, err.reason)


def _raw(span: Any) -> dict[str, Any]:
    return {"name": span.name, **dict(span.attributes or {})}


def _call_links(messages: list[dict[str, Any]], emitted: dict[str, str], answered: dict[str, str]) -> list[str]:
    """Tool-call ids in an input: an assistant turn's tool call links to the model call that
    emitted it, a tool message to the tool step that answered it (else to the emitter)."""
    out: list[str] = []
    for m in messages:
        if m.get("tool_call_id"):
            cid = str(m["tool_call_id"])
            out.append(answered.get(cid) or emitted.get(cid))
        out += [emitted.get(str(c["id"])) for c in m.get("tool_calls") or () if isinstance(c, dict) and c.get("id")]
    return [d for d in dict.fromkeys(out) if d is not None]


def _deps(n: _Span, fields: dict[str, Any], agent_spans: list[_Span], ancestry: dict[int, list[_Span]],
          recorded: list[tuple[_Span, str, str]], asked: str | None = None) -> list[str]:
    """Parentage and message flow: earlier actions of this action's agent spans, and earlier actions
    whose output text is in its input. A tool span answering a call a recorded model call emitted
    (``asked``, by ``gen_ai.tool.call.id``) takes that call instead: its input is that call's
    arguments. A tool span's own descendants (an agent run as the tool) are inputs when their
    output is in the tool's result (else the last of them to end)."""
    texts = [m.get("content") or "" for m in fields["observation"]["messages"]]
    texts += [u.input_text() for u in agent_spans[:1]]
    inside = {u.id for u in agent_spans} | ({n.id} if n.kind == "env" else set())
    result = fields["output"]["text"] if n.kind == "tool" else ""
    deps, nested = [asked] if asked is not None else [], []
    for prev, pid, ptext in recorded:
        if n.kind == "tool" and any(u.id == n.id for u in ancestry[prev.id]):
            nested.append((prev, pid, ptext))
            continue
        if prev.end > n.start or asked is not None:
            continue  # still running when this one started, or not what the asked tool read
        # parentage: an action of one of this action's agents (not one inside a sibling sub-agent)
        own_agent = next((u.id for u in ancestry[prev.id] if u.kind == "agent"), None)
        if own_agent in inside or msgs.occurs_in(msgs.output_forms(ptext), texts):
            deps.append(pid)
    answer = [pid for _, pid, ptext in nested if msgs.occurs_in(msgs.output_forms(ptext), [result])]
    if nested and not answer:
        answer = [max(nested, key=lambda x: x[0].end)[1]]
    return deps + answer


def _agent(n: _Span, agent_spans: list[_Span]) -> str:
    named = [str(u.attrs["gen_ai.agent.name"]) for u in reversed(agent_spans) if u.attrs.get("gen_ai.agent.name")]
    if named:
        return "/".join(named)
    for meta in [n.meta, *(u.meta for u in agent_spans)]:
        path = _node_path(meta)
        if path:
            return path
    return str(n.attrs.get("gen_ai.request.model") or n.attrs.get("llm.model_name") or "unknown")


def _step(n: _Span, ups: list[_Span], dep_steps: list[int]) -> int:
    # LangGraph superstep of the outermost node span (subgraph actions take their parent's step).
    for s in reversed([n, *ups]):
        if isinstance(s.meta.get("langgraph_step"), int):
            return s.meta["langgraph_step"]
    return max(dep_steps, default=0) + 1


def _finish(rec: Any, root: _Span, limits: Any) -> Episode:
    status = "failed" if root.error() else "completed"
    acts = rec.actions()
    return Episode.model_validate(
        {"id": rec.id, "source": rec.source, "task": rec.task, "actions": acts, "status": status,
         "started_at": _dt(root.start) or rec.started_at, "ended_at": _dt(root.end), "metadata": rec.metadata},
        context={"limits": limits} if limits is not None else None)


# -- collecting traces ---------------------------------------------------------------------------


class _Assembler:
    def __init__(self, store: Any, source: str, max_traces: int, include_own: bool):
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
                if not any(_Span(s).kind in ("llm", "tool") for s in spans):
                    return  # a trace without model or tool calls is not an episode
                ep = spans_to_episode(spans, source=self.source, limits=getattr(self.store, "limits", None),
                                      refused=refused)
            except Exception as e:  # refused by the record model (past a record limit, say): kept as a dead letter
                self.store.dead_letter(_named(e, trace), [_raw(s) for s in spans])
                raise
            self.store.submit(ep)
            self.episodes += 1
            for span, e in refused:  # left out of the episode: kept beside it, as it came
                self.store.dead_letter(_named(e, f"{trace} span {format(span.context.span_id, '016x')}"), [_raw(span)])

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

        def __init__(self, store: Any = None, source: str = "otel", max_traces: int = 10_000,
                     include_own: bool = False):
            from ..recording import resolve_store

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

        def __init__(self, store: Any = None, source: str = "otel", max_traces: int = 10_000,
                     include_own: bool = False):
            from ..recording import resolve_store

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
