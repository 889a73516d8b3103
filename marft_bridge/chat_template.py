"""How recorded messages and tools enter a chat template: one rendering for the server (a request's
tools), the trainer (a recorded observation) and the store's exports, the one vLLM applies."""

from __future__ import annotations

import json
from typing import Any

from .schema import Message


def template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A recorded tool call as chat templates take it: ``arguments`` decoded to a dict.

    Recorded (OpenAI wire) calls carry ``arguments`` as a JSON string; transformers chat templates
    (Qwen2.5, Hermes, Llama 3) expect a mapping and would render a string re-quoted, so it is decoded
    here as vLLM does before rendering. Arguments that are not a JSON object stay as they are.
    """
    fn = call.get("function") if isinstance(call.get("function"), dict) else {}
    name = fn.get("name") or call.get("name")
    args = fn.get("arguments", call.get("arguments", call.get("args")))
    if isinstance(args, str):
        try:
            decoded = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):  # recorded text, not ours to refuse: rendered as it is
            decoded = None
        args = decoded if isinstance(decoded, dict) else args
    elif args is None:
        args = {}
    out = {"type": "function", "function": {"name": name, "arguments": args}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def template_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as vLLM hands it to a chat template: ``description`` and ``parameters`` always
    present (null when not given), ``strict`` only when set, nothing else. The server renders a
    request's tools and the trainer a recorded observation's through this one function, so both
    prompts are the one vLLM sampled from."""
    f = tool.get("function") or {}
    fn = {"name": f.get("name"), "description": f.get("description"), "parameters": f.get("parameters")}
    if f.get("strict") is not None:
        fn["strict"] = f["strict"]
    return {"type": tool.get("type", "function"), "function": fn}


def template_message(m: Message) -> dict[str, Any]:
    """One recorded message as chat templates take it (content ``""`` for none; tool calls, tool ids, name)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        out["tool_calls"] = [template_tool_call(c) for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out
