"""OpenAI-shape messages, responses and Responses-API items, parsed in one place.

Every capture path (the raw ``openai`` client hook, OpenTelemetry spans, the embedded server)
turns what it saw into the same ``Message`` / ``Output`` field dicts (``marft_bridge.schema``):

- ``content_text(content)``: a message's content (a string or a list of content parts:
  ``text``, ``input_text``, ``output_text``, ``refusal``) as one string;
- ``tool_call(id, name, arguments)`` / ``tool_calls(calls)``: the chat-completions tool-call
  shape ``{"id", "type": "function", "function": {"name", "arguments"}}`` with ``arguments``
  always a JSON string (a dict or list is dumped with ``json.dumps``);
- ``chat_message(m)``: one chat-completions message (role, content, name, tool_call_id, tool_calls);
- ``chat_tools(tools)`` / ``chat_tool_choice(choice)``: the tools a request offered and its
  ``tool_choice`` in the chat-completions function-tool shape (Responses-API flat function tools
  are converted; other tool types are listed apart);
- ``responses_messages(instructions, input, unknown)``: a ``/responses`` request's
  ``instructions`` (-> system message) and ``input`` (a string or items) as chat messages:
  ``message`` items keep their role and text, ``function_call`` items become assistant
  ``tool_calls`` (consecutive ones in one assistant message), ``function_call_output`` items tool
  messages answering ``call_id``; items of other types (reasoning, built-in tool calls) are kept
  as text (their JSON) and their types appended to ``unknown`` so the caller can count them;
- ``responses_output(response)``: a Responses-API response's output text, tool calls and
  finish reason; ``chat_output(response)`` the same for a chat completion;
- ``output_forms(text)`` / ``occurs_in(forms, texts)``: message flow by text, a JSON output
  also found re-serialised (compact or spaced).

This module imports nothing but the standard library: capture, OTel and serving all use it.
"""

from __future__ import annotations

import functools
import json
from typing import Any

_TEXT_PARTS = {"text", "input_text", "output_text", "refusal"}


def content_text(content: Any) -> str | None:
    """A message's content as one string; content parts are joined (non-text parts by their JSON)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for p in content:
            if isinstance(p, str):
                out.append(p)
            elif isinstance(p, dict):
                if p.get("type") in _TEXT_PARTS or (p.get("type") is None and "text" in p):
                    out.append(str(p.get("text") if p.get("text") is not None else p.get("refusal") or ""))
            else:
                out.append(str(p))
        return "".join(out)
    return str(content)


def arguments_json(arguments: Any) -> str:
    """Tool-call arguments as the JSON string the chat API carries (a string is kept as it is)."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments if arguments is not None else {}, default=str)


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments (a JSON string or an object) as one canonical JSON text, to match a tool
    execution with the call that asked for it when no call id is given."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True, default=str)


def tool_call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    return {"id": None if call_id is None else str(call_id), "type": "function",
            "function": {"name": str(name or ""), "arguments": arguments_json(arguments)}}


def tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    """Chat-completions tool calls, normalised (arguments as a JSON string); None when there are none."""
    out = []
    for c in calls or ():
        if not isinstance(c, dict):
            continue
        fn = c.get("function") if isinstance(c.get("function"), dict) else {}
        if fn or c.get("type") in (None, "function"):
            out.append(tool_call(c.get("id"), fn.get("name") or c.get("name"),
                                 fn.get("arguments", c.get("arguments"))))
        else:  # a non-function tool call (custom tools): kept as it is
            out.append(dict(c))
    return out or None


def chat_message(m: dict) -> dict[str, Any]:
    """One chat-completions message in ``Message`` fields."""
    out: dict[str, Any] = {"role": str(m.get("role") or "user"), "content": content_text(m.get("content"))}
    for k in ("name", "tool_call_id"):
        if m.get(k) is not None:
            out[k] = str(m[k])
    calls = tool_calls(m.get("tool_calls"))
    if calls:
        out["tool_calls"] = calls
    return out


def chat_tools(tools: Any, other: list[str] | None = None) -> list[dict[str, Any]] | None:
    """The offered function tools in the chat-completions shape (``{"type": "function", "function": {...}}``);
    Responses-API flat function tools are converted. Other tool types (built-in web search, ...) are
    not function tools: their types are appended to ``other``."""
    out = []
    for t in tools or ():
        if not isinstance(t, dict):
            continue
        if t.get("type") == "function" and isinstance(t.get("function"), dict):
            out.append(dict(t))
        elif t.get("type") == "function" and t.get("name"):  # Responses-API flat shape
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
            out.append({"type": "function", "function": fn})
        elif other is not None:
            other.append(str(t.get("type")))
    return out or None


def chat_tool_choice(choice: Any) -> str | dict[str, Any] | None:
    """``tool_choice`` in the chat-completions shape (``"auto"``, ``"none"``, ``"required"``, a named function)."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict):
        if choice.get("type") == "function" and "function" not in choice and choice.get("name"):
            return {"type": "function", "function": {"name": str(choice["name"])}}
        return dict(choice)
    return str(choice)


def responses_messages(instructions: Any, items: Any, unknown: list[str] | None = None) -> list[dict[str, Any]]:
    """A ``/responses`` request's instructions and input as chat messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": content_text(instructions)})
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    for item in items or ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "function_call":
            call = tool_call(item.get("call_id") or item.get("id"), item.get("name"), item.get("arguments"))
            prev = out[-1] if out else None
            if prev is not None and prev["role"] == "assistant":  # text + calls of one turn: one chat message
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else content_text(output) if isinstance(output, list) \
                else json.dumps(output, default=str)
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id")), "content": text})
        elif kind in (None, "message") and item.get("role"):
            out.append({"role": str(item["role"]), "content": content_text(item.get("content"))})
        else:
            if unknown is not None:
                unknown.append(str(kind))
            out.append({"role": str(item.get("role") or "user"), "content": json.dumps(item, default=str)})
    return out


def responses_output(response: dict, unknown: list[str] | None = None) -> dict[str, Any]:
    """Output text, tool calls and finish reason of a Responses-API response (``Output`` fields)."""
    texts, calls = [], []
    for item in response.get("output") or ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            texts.append(content_text(item.get("content")) or "")
        elif kind == "function_call":
            calls.append(tool_call(item.get("call_id") or item.get("id"), item.get("name"), item.get("arguments")))
        elif kind != "reasoning" and unknown is not None:
            unknown.append(str(kind))
    status = response.get("status")
    incomplete = (response.get("incomplete_details") or {}).get("reason") if isinstance(
        response.get("incomplete_details"), dict) else None
    finish = "tool_calls" if calls else ("length" if incomplete == "max_output_tokens" else
                                         incomplete or ("stop" if status == "completed" else status))
    return {"text": "".join(texts), "tool_calls": calls or None, "finish_reason": finish}


def chat_output(response: dict) -> dict[str, Any]:
    """Output text, tool calls and finish reason of the first choice of a chat completion."""
    choice = (response.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    return {"text": content_text(msg.get("content")) or "", "tool_calls": tool_calls(msg.get("tool_calls")),
            "finish_reason": choice.get("finish_reason")}


@functools.lru_cache(maxsize=4096)  # each call matches every earlier output of its episode again
def output_forms(text: str) -> tuple[str, ...]:
    """The forms an action's output text may take in a later input: the text itself and, for a
    JSON object or array, its compact and spaced dumps (an app passing a structured output on
    re-serialises it: pydantic's ``model_dump_json`` is compact, ``json.dumps`` spaced)."""
    text = text.strip()
    if text[:1] not in ("{", "[") or len(text) < 2:
        return (text,) if text else ()
    try:
        value = json.loads(text)
    except ValueError:
        return (text,)
    forms = [text]
    for sep in ((",", ":"), (", ", ": ")):
        for ascii_only in (False, True):
            f = json.dumps(value, separators=sep, ensure_ascii=ascii_only)
            if f not in forms:
                forms.append(f)
    return tuple(forms)


def occurs_in(forms: tuple[str, ...], texts: Any) -> bool:
    """Whether one of an output's ``forms`` occurs in one of ``texts``."""
    return any(f in t for f in forms for t in texts)


__all__ = ["arguments_json", "chat_message", "chat_output", "chat_tool_choice", "chat_tools", "content_text",
           "occurs_in", "output_forms", "responses_messages", "responses_output", "tool_call", "tool_calls"]
