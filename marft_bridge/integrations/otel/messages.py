"""What OpenTelemetry spans say about messages, tools and tool calls, as our record fields (see
``integrations.otel``): GenAI-convention message parts, OpenInference's flattened messages, tool
spans and tool definitions."""

from __future__ import annotations

import json
from typing import Any

from ...capture import messages as msgs


def loads(value: Any) -> Any:
    """JSON text parsed (None when it is not JSON); anything else as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


def genai_messages(value: Any, unknown: list[str] | None = None) -> list[dict]:
    """GenAI-convention messages (role + parts) as chat messages: text parts -> content,
    ``tool_call`` parts -> ``tool_calls``, each ``tool_call_response`` part -> a tool message
    (``tool_call_id`` = the part's id, content = its ``response``/``result``). Other part types are
    kept as text (their content, else their JSON) and their types appended to ``unknown``."""
    out = []
    for m in loads(value) or []:
        if not isinstance(m, dict):
            continue
        texts, calls, results = [], [], []
        for p in m.get("parts") or []:
            if not isinstance(p, dict):
                continue
            kind = p.get("type")
            if kind == "text":
                texts.append(str(p.get("content", "")))
            elif kind == "tool_call":
                calls.append(msgs.tool_call(p.get("id"), p.get("name"), p.get("arguments")))
            elif kind == "tool_call_response":
                res = p.get("response", p.get("result"))
                text = res if isinstance(res, str) else json.dumps(res, default=str) if res is not None else ""
                results.append({"role": "tool", "tool_call_id": None if p.get("id") is None else str(p["id"]),
                                "content": text, **({"name": str(p["name"])} if p.get("name") else {})})
            else:
                if unknown is not None:
                    unknown.append(str(kind))
                body = p.get("content")
                texts.append(body if isinstance(body, str) else json.dumps(p, default=str))
        if texts or calls or not results:
            # an assistant turn of tool calls only has no content (null, as in the chat API)
            msg: dict[str, Any] = {"role": str(m.get("role") or "user"),
                                   "content": None if calls and not texts else "".join(texts)}
            if m.get("name"):
                msg["name"] = str(m["name"])
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        out.extend(results)
    return out


def oi_messages(attrs: dict[str, Any], prefix: str) -> list[dict]:
    by_index: dict[int, dict[str, Any]] = {}
    for k, v in attrs.items():
        if not k.startswith(prefix):
            continue
        idx, _, rest = k[len(prefix):].partition(".")
        if not idx.isdigit():
            continue
        m = by_index.setdefault(int(idx), {"role": "user", "content": "", "calls": {}})
        if rest == "message.role":
            m["role"] = str(v)
        elif rest == "message.content":
            m["content"] = str(v)
        elif rest.startswith("message.contents.") and rest.endswith(".message_content.text"):
            m["content"] += str(v)
        elif rest.startswith("message.tool_calls."):
            n, _, field = rest[len("message.tool_calls."):].partition(".")
            call = m["calls"].setdefault(int(n) if n.isdigit() else 0, {"type": "function", "function": {}})
            if field == "tool_call.function.name":
                call["function"]["name"] = str(v)
            elif field == "tool_call.function.arguments":
                call["function"]["arguments"] = str(v)
            elif field == "tool_call.id":
                call["id"] = str(v)
    out = []
    for _, m in sorted(by_index.items()):
        msg = {"role": m["role"], "content": m["content"]}
        if m["calls"]:
            msg["tool_calls"] = [c for _, c in sorted(m["calls"].items())]
        out.append(msg)
    return out


def tool_fields(a: dict[str, Any]) -> dict[str, Any]:
    """A tool span as a tool step, in the shape of the MCP / LangChain tool steps."""
    name = str(a.get("gen_ai.tool.name") or a.get("tool.name") or "tool")
    # Google ADK writes its own keys beside the convention's (``gcp.vertex.agent.*``)
    args = a.get("gen_ai.tool.call.arguments") or a.get("input.value") or a.get("gcp.vertex.agent.tool_call_args") or ""
    result = a.get("gen_ai.tool.call.result") or a.get("output.value") or a.get("gcp.vertex.agent.tool_response") or ""
    call_id = a.get("gen_ai.tool.call.id") or a.get("tool_call.id")
    parsed = loads(args) if isinstance(args, str) else args
    if (bound := _bound_call(parsed)) is not parsed:  # smolagents through OpenInference
        args = parsed = bound
    call = msgs.tool_call(call_id, name, args if args != "" else {})
    meta = {"tool.name": name, "tool.arguments": parsed if parsed is not None else args,
            **({"tool_call_id": str(call_id)} if call_id else {})}
    return {"observation": {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]},
            "output": {"text": result if isinstance(result, str) else json.dumps(result, default=str)},
            "metadata": meta}


def _block_text(block: Any) -> str:
    """A result block as text: its ``text``, else itself as JSON (``{"json": ...}``, an image's
    description), so nothing the tool returned is dropped."""
    if isinstance(block, dict) and "text" in block:
        return str(block["text"])
    return block if isinstance(block, str) else json.dumps(block, default=str)


def _bound_call(value: Any) -> Any:
    """OpenInference's smolagents wrapper writes ``Tool.__call__``'s bound arguments as the tool span's
    ``input.value`` (``{"args": [], "sanitize_inputs_outputs": true, "kwargs": {...}}``): the tool's
    own arguments are its ``kwargs``, or its one positional argument."""
    if isinstance(value, dict) and set(value) == {"args", "sanitize_inputs_outputs", "kwargs"}:
        args, kwargs = value["args"] or [], value["kwargs"] or {}
        if isinstance(args, list) and isinstance(kwargs, dict):
            if not args:
                return kwargs
            if len(args) == 1 and not kwargs:
                return args[0]
    return value


def offered_tools(a: dict[str, Any]) -> list[dict] | None:
    """The tools offered to a model call: ``gen_ai.tool.definitions``, else OpenInference's ``llm.tools``."""
    defs = loads(a.get("gen_ai.tool.definitions"))
    if not isinstance(defs, list):
        defs = [loads(v) for k, v in sorted(a.items()) if k.startswith("llm.tools.") and k.endswith(".tool.json_schema")]
    return msgs.chat_tools([d for d in defs if isinstance(d, dict)])


# The per-message events of the GenAI conventions before their content moved onto the span (still what
# Strands Agents writes unless OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental): one event per
# input message, ``gen_ai.choice`` for the output.
LEGACY_ROLES = {"gen_ai.system.message": "system", "gen_ai.user.message": "user",
                "gen_ai.assistant.message": "assistant", "gen_ai.tool.message": "tool"}


def legacy_messages(events: list[tuple[str, dict[str, Any]]]) -> tuple[list[dict], list[dict]]:
    """``(name, attributes)`` of a span's per-message events as convention messages (role + parts): the
    inputs, and the outputs from ``gen_ai.choice``."""
    inputs, outputs = [], []
    for name, attrs in events:
        if name in LEGACY_ROLES:
            inputs.append({"role": LEGACY_ROLES[name], "parts": _legacy_parts(attrs.get("content"))})
        elif name == "gen_ai.choice":
            outputs.append({"role": "assistant", "parts": _legacy_parts(attrs.get("message")),
                            **({"finish_reason": attrs["finish_reason"]} if attrs.get("finish_reason") else {})})
    return inputs, outputs


def _legacy_parts(content: Any) -> list[dict]:
    """An event's content as parts: plain text; a message object (``content``, ``tool_calls``); or a
    list of content blocks (``text``, ``toolUse``, ``toolResult``: Strands' and Bedrock's shape)."""
    value = loads(content)
    if isinstance(value, dict) and ("content" in value or "tool_calls" in value):
        parts = [{"type": "text", "content": str(value["content"])}] if value.get("content") else []
        calls = value.get("tool_calls")
        for c in calls if isinstance(calls, list) else ():
            fn = c.get("function") if isinstance(c, dict) else None
            if isinstance(fn, dict):  # anything else is not a call we can name
                parts.append({"type": "tool_call", "id": c.get("id"), "name": fn.get("name"),
                              "arguments": loads(fn.get("arguments"))})
        return parts
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        return [{"type": "text", "content": "" if content is None else str(content)}]
    parts = []
    for b in value:
        if not isinstance(b, dict):
            parts.append({"type": "text", "content": str(b)})
        elif "text" in b:
            parts.append({"type": "text", "content": str(b["text"])})
        elif isinstance(b.get("toolUse"), dict):
            u = b["toolUse"]
            parts.append({"type": "tool_call", "id": u.get("toolUseId"), "name": u.get("name"), "arguments": u.get("input")})
        elif isinstance(b.get("toolResult"), dict):
            r, content = b["toolResult"], b["toolResult"].get("content")
            blocks = content if isinstance(content, list) else [] if content is None else [content]
            text = "".join(_block_text(x) for x in blocks)
            parts.append({"type": "tool_call_response", "id": r.get("toolUseId"), "response": text})
        else:
            parts.append({"type": "text", "content": json.dumps(b, default=str)})
    return parts


__all__ = ["genai_messages", "legacy_messages", "loads", "offered_tools", "oi_messages", "tool_fields"]
