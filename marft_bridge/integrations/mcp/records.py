"""MCP requests and results as record fields, for the client and the server capture (mcp 1.x and
2.x: the SDK's models name their fields in camelCase in 1.x, snake_case in 2.x; wire dicts are
camelCase in both)."""

from __future__ import annotations

import json
from typing import Any

from ...capture import recording


def jsonable(v: Any) -> Any:
    if hasattr(v, "model_dump"):
        return v.model_dump(mode="json", by_alias=True, exclude_none=True)
    return recording.jsonable(v)


def _field(obj: Any, snake: str, camel: str) -> Any:
    v = getattr(obj, snake, None)
    return getattr(obj, camel, None) if v is None else v


def result_text(result: Any) -> tuple[str, bool]:
    """The text of a tool result (model or wire dict) and whether it is an error result."""
    if type(result).__name__ == "CallToolResult" and isinstance(getattr(result, "content", None), list):
        # The SDK's result model, read as it is (a model dump per call costs more than the rest).
        text = "\n".join(c.text for c in result.content if getattr(c, "type", None) == "text")
        structured = _field(result, "structured_content", "structuredContent")
        if not text and structured is not None:
            text = json.dumps(jsonable(structured), sort_keys=True)
        return text, bool(_field(result, "is_error", "isError"))
    # A wire dict (what a server middleware sees) is read as it is; anything else is dumped first.
    data = result if isinstance(result, dict) else jsonable(result)
    if not isinstance(data, dict):
        return str(data), False
    texts = [c.get("text", "") for c in data.get("content") or [] if isinstance(c, dict) and c.get("type") == "text"]
    text = "\n".join(texts)
    if not text and data.get("structuredContent") is not None:
        text = json.dumps(jsonable(data["structuredContent"]), sort_keys=True)
    return text, bool(data.get("isError"))


def tool_fields(name: str, arguments: Any) -> dict[str, Any]:
    args = jsonable(arguments or {})
    call = {"type": "function", "function": {"name": name, "arguments": json.dumps(args, sort_keys=True)}}
    return {
        "observation": {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]},
        "metadata": {"mcp.tool": name, "mcp.arguments": args},
    }


def block_text(content: Any) -> str:
    """The text of a sampling message's content: one block or a list of them (dumped)."""
    blocks = content if isinstance(content, list) else [content]
    return "\n".join(b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text")


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def input_required(result: Any) -> bool:
    """An intermediate round (2.x: the server asks the client's model first, then the request is retried)."""
    if type(result).__name__ == "InputRequiredResult":
        return True
    return isinstance(result, dict) and ("inputRequests" in result or result.get("resultType") == "input_required")


__all__ = ["block_text", "error_text", "input_required", "jsonable", "result_text", "tool_fields"]
