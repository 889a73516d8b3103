"""A scripted OpenAI-compatible server for the Responses API (``POST /v1/responses``, plain JSON or
SSE events) and chat completions, on 127.0.0.1: what the OpenAI Agents SDK and pydantic-ai talk to
in the capture tests. Each model follows a script keyed by how many tool results its input holds:

- ``triage-model`` (Responses API or chat completions): no tool result yet -> calls ``lookup(city="Paris")``; one -> calls
  ``transfer_to_billing`` (a handoff); more -> answers text;
- ``billing-model``: answers ``"billed: <the lookup result>"``;
- ``echo-model``: answers ``"echo: <last user text>"``; ``plan-json-model`` answers
  ``{"city": "Paris", "days": 3}`` (Responses API);
- ``lead-model`` (Responses API): no tool result yet -> calls ``ask_helper(input="capital of France?")``
  (an agent used as a tool); then answers ``"lead: <the tool result>"``; ``helper-model`` answers
  ``"helper says <its user text>"``;
- ``boss-model`` / ``helper-model`` (chat completions, for pydantic-ai): the boss calls the
  ``ask_helper`` tool (an agent as a tool) then ``add(a=2, b=3)``, then answers with both results;
  the helper answers ``"helper says <its user text>"``.

``requests`` keeps every request body, in order.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

USAGE = {"input_tokens": 11, "output_tokens": 5, "total_tokens": 16,
         "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}


def _output_text(output: Any) -> str:
    if isinstance(output, list):  # content parts (an MCP tool's result through the Agents SDK)
        return "".join(str(p.get("text", "")) for p in output if isinstance(p, dict))
    return str(output)


def _tool_outputs(items: Any) -> list[str]:
    return [_output_text(i.get("output")) for i in items or ()
            if isinstance(i, dict) and i.get("type") == "function_call_output"]


def _last_user_text(items: Any) -> str:
    if isinstance(items, str):
        return items
    for i in reversed(list(items or ())):
        if isinstance(i, dict) and i.get("role") == "user":
            c = i.get("content")
            return c if isinstance(c, str) else "".join(p.get("text", "") for p in c or () if isinstance(p, dict))
    return ""


def function_call(call_id: str, name: str, arguments: dict) -> dict:
    return {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
            "arguments": json.dumps(arguments), "status": "completed"}


def message(text: str) -> dict:
    return {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def responses_output(req: dict) -> list[dict]:
    model, items = req["model"], req.get("input")
    done = _tool_outputs(items)
    if model == "triage-model":
        if not done:
            return [function_call("call_lookup", "lookup", {"city": "Paris"})]
        if len(done) == 1:
            return [message("Handing over."), function_call("call_handoff", "transfer_to_billing", {})]
        return [message("done")]
    if model == "billing-model":
        return [message(f"billed: {done[0] if done else '?'}")]
    if model == "lead-model":
        if not done:
            return [function_call("call_helper", "ask_helper", {"input": "capital of France?"})]
        return [message(f"lead: {done[0]}")]
    if model == "helper-model":
        return [message(f"helper says {_last_user_text(items)}")]
    if model in ("planner-mcp", "solver-mcp"):  # each asks one calc tool, then answers from its result
        if not done:
            return [function_call("call_add", "add", {"a": 2, "b": 3}) if model == "planner-mcp"
                    else function_call("call_mul", "multiply", {"a": 4, "b": 5})]
        return [message(f"{model} result={done[0]}")]
    if model == "forecast-model":  # one tool asked three times at once, twice with the same arguments
        if not done:
            return [function_call("call_p", "weather", {"city": "Paris"}),
                    function_call("call_r", "weather", {"city": "Rome"}),
                    function_call("call_p2", "weather", {"city": "Paris"})]
        return [message(" / ".join(done))]
    if model == "plan-json-model":  # a structured answer, spaced as models write JSON
        return [message('{"city": "Paris", "days": 3}')]
    return [message(f"echo: {_last_user_text(items)}")]


LOGPROBS = [-0.25, -1.5, -0.125]


def responses_reply(req: dict) -> dict:
    output = responses_output(req)
    if "message.output_text.logprobs" in (req.get("include") or ()):  # tokens named by id, vLLM-style
        for item in output:
            if item["type"] == "message":
                item["content"][0]["logprobs"] = [{"token": f"token_id:{40 + i}", "logprob": lp, "bytes": [],
                                                   "top_logprobs": []} for i, lp in enumerate(LOGPROBS)]
    return {"id": f"resp_{len(req.get('input') or ())}", "object": "response", "created_at": 1, "model": req["model"],
            "status": "completed", "output": output, "parallel_tool_calls": True,
            "tool_choice": req.get("tool_choice", "auto"), "tools": req.get("tools", []), "usage": USAGE,
            "error": None, "incomplete_details": None, "instructions": req.get("instructions")}


def responses_events(req: dict) -> list[dict]:
    """The reply as the Responses API streams it (created, text deltas, items done, completed)."""
    full = responses_reply(req)
    events: list[dict] = [{"type": "response.created", "sequence_number": 0,
                           "response": {**full, "status": "in_progress", "output": []}}]
    for n, item in enumerate(full["output"]):
        events.append({"type": "response.output_item.added", "output_index": n, "item": item,
                       "sequence_number": len(events)})
        if item["type"] == "message":
            text = item["content"][0]["text"]
            for piece in (text[: len(text) // 2], text[len(text) // 2:]):
                events.append({"type": "response.output_text.delta", "output_index": n, "content_index": 0,
                               "item_id": item["id"], "delta": piece, "logprobs": [], "sequence_number": len(events)})
        events.append({"type": "response.output_item.done", "output_index": n, "item": item,
                       "sequence_number": len(events)})
    events.append({"type": "response.completed", "response": full, "sequence_number": len(events)})
    return events


def chat_reply(req: dict) -> dict:
    model, msgs = req["model"], req["messages"]
    results = [m["content"] for m in msgs if m.get("role") == "tool"]
    user = next((m["content"] for m in reversed(msgs) if m.get("role") == "user"), "")
    user = user if isinstance(user, str) else "".join(p.get("text", "") for p in user)
    calls, text = None, None
    if model in ("triage-model", "billing-model"):  # the Responses script, in chat-completions shape
        items = [{"type": "function_call_output", "output": r} for r in results]
        out = responses_output({"model": model, "input": items})
        text = "".join(i["content"][0]["text"] for i in out if i["type"] == "message") or None
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in out if i["type"] == "function_call"] or None
    elif model == "boss-model" and not results:
        calls = [{"id": "call_helper", "type": "function",
                  "function": {"name": "ask_helper", "arguments": json.dumps({"question": "capital of France?"})}}]
    elif model == "boss-model" and len(results) == 1:
        calls = [{"id": "call_add", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]
    elif model == "boss-model":
        text = "boss: " + " | ".join(results)
    else:
        text = f"helper says {user}"
    msg = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(req)
        if self.path.endswith("/responses"):
            if req.get("stream"):
                data = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in responses_events(req)).encode()
                kind = "text/event-stream"
            else:
                data, kind = json.dumps(responses_reply(req)).encode(), "application/json"
        else:
            data, kind = json.dumps(chat_reply(req)).encode(), "application/json"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class FakeServer:
    """``with FakeServer() as srv:`` serves on a free 127.0.0.1 port; ``srv.url`` ends in ``/v1``."""

    def __enter__(self) -> FakeServer:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.requests = []
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        return self

    @property
    def requests(self) -> list[dict]:
        return self.httpd.requests

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
