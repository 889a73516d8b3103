"""Reading OpenTelemetry spans: one span classified (model call, tool, agent, node, workflow) and
its attributes as record fields, for the GenAI semantic conventions, OpenInference and our own
``marft.*`` spans."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from ...capture_errors import capture_error
from ...errors import RecordError
from .emit import SAMPLING_ATTRS as _SAMPLING
from .messages import genai_messages as _genai_messages
from .messages import loads as _loads
from .messages import offered_tools as _tools
from .messages import LEGACY_ROLES
from .messages import legacy_messages as _legacy_messages
from .messages import oi_messages as _oi_messages
from .messages import tool_fields as _tool_fields

LLM_OPS = {"chat", "text_completion", "generate_content"}

# The semantic conventions' event carrying a call's content when an instrumentation records it as
# events only (gen_ai.input.messages, gen_ai.output.messages, gen_ai.system_instructions, ...).
DETAILS_EVENT = "gen_ai.client.inference.operation.details"
LEGACY_EVENTS = {*LEGACY_ROLES, "gen_ai.choice"}


def span_attributes(span: Any) -> dict[str, Any]:
    """The span's attributes, and those of its operation-details event where the span lacks them; a
    span with neither but the older per-message events gets its messages from those."""
    out = dict(span.attributes or {})
    legacy = []
    for event in getattr(span, "events", None) or ():
        if event.name == DETAILS_EVENT:
            for k, v in (event.attributes or {}).items():
                out.setdefault(k, v)
        elif event.name in LEGACY_EVENTS:
            legacy.append((event.name, dict(event.attributes or {})))
    if not legacy or "gen_ai.input.messages" in out or "gen_ai.output.messages" in out:
        return out
    if out.get("gen_ai.operation.name") == "execute_tool":  # the call's arguments in, its result out
        for key, events in (("gen_ai.tool.call.arguments", "gen_ai.tool.message"), ("gen_ai.tool.call.result", "gen_ai.choice")):
            body = next((a.get("content", a.get("message")) for n, a in legacy if n == events), None)
            if body is not None:
                out.setdefault(key, body)
        return out
    try:
        inputs, outputs = _legacy_messages(legacy)
    except (RecursionError, ValueError, TypeError, AttributeError) as e:  # this span's content only
        capture_error("otel.legacy_events", e)
        return out
    out["gen_ai.input.messages"], out["gen_ai.output.messages"] = json.dumps(inputs), json.dumps(outputs)
    return out


def span_time(ns: int | None) -> datetime | None:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc) if ns else None


def call_kind(a: dict[str, Any]) -> str | None:
    """``"llm"`` or ``"tool"`` for a model call's or a tool's span (ours by ``marft.kind``), else None;
    from the span's own attributes (cheap: the intake asks it of every span of a trace)."""
    if "marft.action.id" in a:
        return {"llm": "llm", "tool": "tool"}.get(a.get("marft.kind"))
    op, kind = a.get("gen_ai.operation.name"), a.get("openinference.span.kind")
    if op in LLM_OPS or kind == "LLM":
        return "llm"
    if op == "execute_tool" or kind == "TOOL":
        return "tool"
    return None


class Span:
    """One span, classified."""

    def __init__(self, span: Any):
        self.raw = span
        self.id = span.context.span_id
        self.parent_id = span.parent.span_id if span.parent is not None else None
        self.start = span.start_time or 0
        self.end = span.end_time or self.start
        self.attrs = span_attributes(span)
        try:
            self.meta = _loads(self.attrs.get("metadata")) or {}
        except RecursionError:
            # Too deep to parse: refused (the trace dead-lettered), as a too-deep record field is.
            raise RecordError(None, "metadata", f"span {self.id:016x}: JSON nested too deep to read (far past "
                              "the max_depth limit)") from None
        if not isinstance(self.meta, dict):
            self.meta = {}
        a = self.attrs
        self.own = "marft.action.id" in a  # emitted by SpanEmitter: exact fields under marft.*
        self.kind: str | None = call_kind(a)  # llm | tool | env | agent | workflow
        if self.own:
            self.kind = self.kind or "env"
        elif self.kind is None:
            op, kind = a.get("gen_ai.operation.name"), a.get("openinference.span.kind")
            node = self.meta.get("langgraph_node")
            if op == "invoke_agent" or kind == "AGENT" or (kind == "CHAIN" and node and not str(node).startswith("__")):
                self.kind = "agent"
            elif op in ("invoke_workflow", "create_agent") or (kind == "CHAIN" and self.parent_id is None):
                self.kind = "workflow"

    def agent_name(self) -> str | None:
        named = self.own_name()
        return named if named is not None else node_path(self.meta)

    def own_name(self) -> str | None:
        """The name an agent span gives its agent: ``gen_ai.agent.name`` (the GenAI conventions, both
        before and since 0.1.0), OpenInference's ``agent.name``, else for an OpenInference ``AGENT``
        span its span name (smolagents: ``"ToolCallingAgent.run"`` -> ``"ToolCallingAgent"``)."""
        a = self.attrs
        for key in ("gen_ai.agent.name", "agent.name"):
            if a.get(key):
                return str(a[key])
        if a.get("openinference.span.kind") == "AGENT" and getattr(self.raw, "name", None):
            name = str(self.raw.name)
            return name[:-4] if name.endswith(".run") else name
        return None

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


def message_finish(a: Any) -> Any:
    """The finish reason the GenAI convention puts on each output message (``finish_reason``)."""
    for m in _loads(a.get("gen_ai.output.messages")) or ():
        if isinstance(m, dict) and m.get("finish_reason"):
            return m["finish_reason"]
    return None


def node_path(meta: dict[str, Any]) -> str | None:
    ns = meta.get("langgraph_checkpoint_ns")
    node = meta.get("langgraph_node")
    if not node and not ns:
        return None
    parts = [seg.partition(":")[0] for seg in str(ns).split("|")] if ns else [str(node)]
    if meta.get("agent_name"):
        parts[-1] = str(meta["agent_name"])
    return "/".join(parts)


def span_fields(s: Span) -> dict[str, Any]:
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
    finish = a.get("gen_ai.response.finish_reasons") or a.get("llm.finish_reason") or message_finish(a)
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
