"""Our finished episodes as GenAI-convention OpenTelemetry spans (``SpanEmitter``; see ``integrations.otel``)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from ...capture_errors import guarded
from ...capture.recording import add_episode_listener, remove_episode_listener
from ...schema import Episode

SAMPLING_ATTRS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_tokens",
                  "seed": "seed"}


# -- emitting our actions as spans ---------------------------------------------------------------


def _ns(dt: datetime | None) -> int | None:
    return int(dt.timestamp() * 1e9) if dt is not None else None


def _genai_json(messages: list[Any]) -> str:
    out = []
    for m in messages:
        parts: list[dict[str, Any]] = []
        if m.role == "tool" and m.tool_call_id:
            parts.append({"type": "tool_call_response", "id": m.tool_call_id, "response": m.content or "",
                          **({"name": m.name} if m.name else {})})
            out.append({"role": "tool", "parts": parts})
            continue
        if m.content:
            parts.append({"type": "text", "content": m.content})
        for tc in m.tool_calls or []:
            fn = tc.get("function") or {}
            parts.append({"type": "tool_call", "id": tc.get("id"), "name": fn.get("name"),
                          "arguments": fn.get("arguments")})  # the exact JSON string the model wrote
        out.append({"role": m.role, "parts": parts, **({"name": m.name} if m.name else {})})
    return json.dumps(out)


class SpanEmitter:
    """Emit finished episodes as GenAI-convention spans (see the module docstring)."""

    def __init__(self, tracer_provider: Any = None, capture_content: bool = True):
        from opentelemetry import trace

        self.tracer = trace.get_tracer("marft_bridge", tracer_provider=tracer_provider)
        self.capture_content = capture_content

    def instrument(self) -> SpanEmitter:
        add_episode_listener(self.emit)
        return self

    def uninstrument(self) -> None:
        remove_episode_listener(self.emit)

    def emit(self, ep: Episode) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Link

        root = self.tracer.start_span(
            "invoke_workflow marft", start_time=_ns(ep.started_at),
            # GenAI conventions 0.1.0: a workflow is an internal invoke-agent span keyed by gen_ai.agent.name
            attributes={"gen_ai.operation.name": "invoke_workflow", "gen_ai.agent.name": ep.source,
                        "marft.episode.id": ep.id, "marft.episode.task": json.dumps(ep.task, default=str),
                        "marft.episode.status": ep.status})
        ctx = trace.set_span_in_context(root)
        spans: dict[str, Any] = {}
        for i, a in enumerate(ep.actions):
            with guarded("otel.emit"):
                attrs = self._attributes(ep, a)
                attrs["marft.index"] = i
                model = a.policy.name if a.policy else a.agent
                name = {"llm": f"chat {model}", "tool": f"execute_tool {a.agent}"}.get(a.kind, f"invoke_agent {a.agent}")
                links = [Link(spans[d].get_span_context()) for d in a.depends_on if d in spans]
                span = self.tracer.start_span(name, context=ctx, start_time=_ns(a.started_at or a.ended_at),
                                              attributes=attrs, links=links)
                if a.error:
                    span.set_status(trace.Status(trace.StatusCode.ERROR, a.error[:500]))
                span.end(end_time=_ns(a.ended_at))
                spans[a.id] = span
        root.end(end_time=_ns(ep.ended_at))

    def _attributes(self, ep: Episode, a: Any) -> dict[str, Any]:
        op = {"llm": "chat", "tool": "execute_tool"}.get(a.kind, "invoke_agent")
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": op, "gen_ai.agent.name": a.agent, "marft.episode.id": ep.id,
            "marft.action.id": a.id, "marft.kind": a.kind, "marft.step": a.step,
            "marft.depends_on": list(a.depends_on),
        }
        if a.token_source:
            attrs["marft.token_source"] = a.token_source
        if a.policy:
            attrs["gen_ai.request.model"] = a.policy.name
            attrs["marft.policy.name"] = a.policy.name
            if a.policy.version is not None:
                attrs["marft.policy.version"] = a.policy.version
        if a.sampling:
            for key, v in a.sampling.model_dump(exclude_none=True).items():
                if key in SAMPLING_ATTRS:
                    attrs[f"gen_ai.request.{key}"] = v
        if a.output.finish_reason:
            attrs["gen_ai.response.finish_reasons"] = [a.output.finish_reason]
        if a.output.token_ids is not None:
            attrs["marft.output.token_ids"] = list(a.output.token_ids)
            attrs["gen_ai.usage.output_tokens"] = len(a.output.token_ids)
        if a.output.logprobs is not None:
            attrs["marft.output.logprobs"] = list(a.output.logprobs)
        if a.observation.prompt_token_ids is not None:
            attrs["marft.observation.prompt_token_ids"] = list(a.observation.prompt_token_ids)
            attrs["gen_ai.usage.input_tokens"] = len(a.observation.prompt_token_ids)
        if self.capture_content:
            if a.kind == "tool":
                last = a.observation.messages[-1] if a.observation.messages else None
                call = (last.tool_calls or [None])[0] if last is not None else None
                fn = call.get("function") or {} if isinstance(call, dict) else {}
                attrs["gen_ai.tool.name"] = str(a.metadata.get("tool.name") or a.metadata.get("mcp.tool")
                                                or a.metadata.get("tool") or fn.get("name") or a.agent)
                args = fn.get("arguments") if fn else (last.content if last is not None else None)
                attrs["gen_ai.tool.call.arguments"] = args or ""
                if isinstance(call, dict) and call.get("id"):
                    attrs["gen_ai.tool.call.id"] = str(call["id"])
                attrs["gen_ai.tool.call.result"] = a.output.text
            else:
                attrs["gen_ai.input.messages"] = _genai_json(a.observation.messages)
                if a.observation.tools:
                    attrs["gen_ai.tool.definitions"] = json.dumps(
                        [{"type": "function", **(t.get("function") or {})} for t in a.observation.tools])
                if a.observation.tool_choice is not None:
                    attrs["marft.observation.tool_choice"] = json.dumps(a.observation.tool_choice)
                parts = [{"type": "text", "content": a.output.text}]
                for tc in a.output.tool_calls or ():
                    fn = tc.get("function") or {}
                    parts.append({"type": "tool_call", "id": tc.get("id"), "name": fn.get("name"),
                                  "arguments": fn.get("arguments")})
                attrs["gen_ai.output.messages"] = json.dumps(
                    [{"role": "assistant", "parts": parts, "finish_reason": a.output.finish_reason}])
        return attrs


__all__ = ["SAMPLING_ATTRS", "SpanEmitter"]
