"""LangChain messages, invocation parameters and tool results as record fields (no LangGraph import).

The OpenAI shapes themselves (content text, tool calls, offered tools) come from
``marft_bridge.capture.messages``, shared with the raw-client capture, OTel and the server.
"""

from __future__ import annotations

import json
from typing import Any

from ...capture import messages as shapes

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "function",
          "HumanMessageChunk": "user", "AIMessageChunk": "assistant", "SystemMessageChunk": "system",
          "ToolMessageChunk": "tool", "FunctionMessageChunk": "function"}
_EMPTY: dict = {}


text = shapes.content_text


def arguments_json(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args if args is not None else {}, sort_keys=True, default=str)


def tool_calls(msg: Any) -> list[dict] | None:
    """An AIMessage's tool calls in the chat-completions shape (arguments as a JSON string)."""
    calls = getattr(msg, "tool_calls", None)
    if not calls:
        return None
    return [shapes.tool_call(c.get("id"), c.get("name"), c.get("args")) for c in calls]


def message(m: Any) -> dict[str, Any]:
    # Fields are read by message type: a missing attribute on a pydantic message costs microseconds.
    kind = getattr(m, "type", "")
    role = _ROLES.get(kind) or (str(getattr(m, "role", "user")) if kind in ("chat", "ChatMessageChunk") else "user")
    out: dict[str, Any] = {"role": role, "content": text(getattr(m, "content", None))}
    if getattr(m, "name", None):
        out["name"] = m.name
    if role == "tool" and getattr(m, "tool_call_id", None):
        out["tool_call_id"] = m.tool_call_id
    elif role == "assistant":
        tc = tool_calls(m)
        if tc:
            out["tool_calls"] = tc
    return out


def sampling(params: dict[str, Any]) -> dict[str, Any] | None:
    extra = params.get("extra_body") or _EMPTY
    s = {}
    for k in ("temperature", "top_p", "top_k", "seed", "allowed_token_ids"):
        v = params.get(k, extra.get(k)) if extra else params.get(k)
        if v is not None:
            s[k] = v
    v = params.get("max_tokens") or params.get("max_completion_tokens")
    if v is not None:
        s["max_tokens"] = v
    stop = params.get("stop")
    if stop is not None:
        s["stop"] = [stop] if isinstance(stop, str) else stop
    return s or None


def offered_tools(params: dict[str, Any]) -> tuple[list[dict] | None, Any]:
    """The function tools bound to a call (``invocation_params["tools"]``) and its ``tool_choice``."""
    tools = [t for t in shapes.chat_tools(params.get("tools")) or () if t.get("type") == "function"
             and isinstance(t.get("function"), dict) and t["function"].get("name")]
    choice = shapes.chat_tool_choice(params.get("tool_choice"))
    if isinstance(choice, str) and not 0 < len(choice) <= 64:
        choice = None
    return tools or None, choice


def jsonable(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return repr(value)


def result_text(value: Any) -> str:
    """A tool result as text: a string as it is, content parts joined, anything else as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, (str, dict)) for p in value) and value and all(
            isinstance(p, str) or p.get("type") == "text" for p in value):
        return text(value) or ""
    return json.dumps(value, sort_keys=True, default=str)
