"""The embedded OpenAI-compatible HTTP server (FastAPI) in front of an ``AdapterEngine``.

Same surface as vLLM's multi-LoRA server: ``model`` = adapter name, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` for hot-swap, ``return_token_ids``. On top of it every response carries
``"adapter": {"name", "version"}`` (the registry version that produced it) and
``"logprobs_mode": "processed"`` (log-probs after temperature/top-k/top-p).

Bodies are validated completely at the boundary (``requests.py``); every refusal, and any
unexpected exception, answers an OpenAI-shaped JSON error. Chat requests with ``tools`` render
them through the base model's chat template and parse Hermes ``<tool_call>`` output into
``tool_calls`` (``tool_calls.py``), as vLLM with ``--tool-call-parser hermes`` does.

FastAPI is imported at module level because it resolves the endpoints' ``Request`` annotations by
name; only ``marft serve`` imports this module.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .adapter_files import AdapterError
from .engine import AdapterEngine
from .engine_types import GenerationRequest, RequestError, UnknownAdapter
from .requests import (ChatRequest, CompletionRequest, LoadAdapterRequest, NamedToolChoice, SamplingBody,
                       UnloadAdapterRequest, template_messages)
from .tool_calls import HermesParser

log = logging.getLogger(__name__)
LOGPROBS_MODE = "processed"
DEFAULT_MAX_TOKENS = 256


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error_body(e: APIError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def _internal_error(rid: str) -> APIError:
    """The answer to an unexpected fault: its details stay in the log, under the request id."""
    return APIError(500, f"internal server error (request id {rid})", "server_error", code="internal_error")


def _log_server_error(rid: str, e: APIError) -> None:
    if e.status >= 500:
        log.error("request %s: %s", rid, e.message)


def _validation_error(e: ValidationError) -> APIError:
    """The most specific failure (the deepest location), named by its field path, e.g.
    ``messages.0.content.0.text``; union branch and discriminator tags are left out of the path."""
    err = max(e.errors(), key=lambda x: len(x["loc"]))
    parts: list[str] = []
    loc = err["loc"]
    for i, item in enumerate(loc):
        after_index = bool(parts) and parts[-1].isdigit()
        if isinstance(item, str) and ("[" in item or item in _UNION_TAGS
                                      or (after_index and item in _ROLES)
                                      or (after_index and item in _PART_TYPES and i < len(loc) - 1)):
            continue
        parts.append(str(item))
    param = ".".join(parts) or None
    return APIError(400, f"{param}: {err['msg']}" if param else err["msg"], "invalid_request_error", param)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}
_PART_TYPES = {"text", "refusal"}


def create_app(engine: AdapterEngine, *, api_key: str | None = None, max_request_bytes: int = 1 << 20):
    """The FastAPI application. With ``api_key`` every ``/v1`` endpoint needs ``Authorization: Bearer
    <key>``; without one the admin endpoints are disabled altogether. Every refusal is an
    OpenAI-shaped error body; an unexpected exception is a 500 with the same shape, logged with the
    request id that the response's ``x-request-id`` header carries."""
    app = FastAPI(title="marft serve", docs_url=None, redoc_url=None, openapi_url=None)
    tok = engine.tokenizer
    tool_stats = {"tool_calls_parsed": 0, "tool_calls_malformed": 0, "tool_calls_dropped": 0, "tool_choice_unmet": 0}

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        rid = f"req-{uuid.uuid4().hex[:16]}"
        request.state.request_id = rid
        try:
            response = await call_next(request)
        except Exception:  # noqa: BLE001 - any fault in a request answers JSON, never a bare 500
            log.exception("request %s (%s %s) failed", rid, request.method, request.url.path)
            response = JSONResponse(_error_body(_internal_error(rid)), status_code=500)
        response.headers["x-request-id"] = rid
        return response

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        _log_server_error(getattr(request.state, "request_id", "?"), e)
        return JSONResponse(_error_body(e), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        type_ = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(_error_body(APIError(e.status_code, str(e.detail), type_)), status_code=e.status_code)

    def check_key(request: Request, admin: bool = False) -> None:
        if api_key is None:
            if admin:
                raise APIError(403, "admin endpoints are disabled: start the server with --api-key", "permission_error")
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")

    async def parse(request: Request, model: type[BaseModel]):
        try:
            declared = int(request.headers.get("content-length") or 0)
        except ValueError:
            raise APIError(400, "content-length is not a number", "invalid_request_error") from None
        if declared > max_request_bytes:
            raise APIError(413, f"request body exceeds {max_request_bytes} bytes", "invalid_request_error")
        body = await request.body()
        if len(body) > max_request_bytes:
            raise APIError(413, f"request body exceeds {max_request_bytes} bytes", "invalid_request_error")
        try:
            return model.model_validate_json(body)
        except ValidationError as e:
            raise _validation_error(e) from None

    def token_text(tid: int) -> str:
        return tok.decode([tid], skip_special_tokens=False)

    def content_entry(tid: int, lp: float, top: list[tuple[int, float]]) -> dict:
        text = token_text(tid)
        return {
            "token": text,
            "logprob": lp,
            "bytes": list(text.encode()),
            "top_logprobs": [{"token": token_text(t), "logprob": v, "bytes": list(token_text(t).encode())} for t, v in top],
        }

    def gen_request(body: SamplingBody, prompt_ids: list[int], top_logprobs: int, param: str) -> GenerationRequest:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        room = engine.max_positions - len(prompt_ids)
        if room < 1:
            raise APIError(400, f"the prompt is {len(prompt_ids)} tokens; the model's context is "
                           f"{engine.max_positions} tokens, with room for at least one generated token",
                           "invalid_request_error", param, "context_length_exceeded")
        # Not given: as much as fits, up to the default (vLLM fills the context the same way).
        max_tokens = body.max_completion_tokens or body.max_tokens or min(DEFAULT_MAX_TOKENS, engine.max_tokens_limit, room)
        return GenerationRequest(
            prompt_ids=prompt_ids,
            adapter=body.model,
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            stop=stop,
            top_logprobs=top_logprobs,
        )

    def submit(req: GenerationRequest) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req.sink = lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
        try:
            engine.submit(req)
        except UnknownAdapter as e:
            raise APIError(404, str(e), "NotFoundError", "model", "model_not_found") from None
        except RequestError as e:
            raise APIError(400, str(e), "invalid_request_error", e.param, e.code) from None
        return events

    async def next_event(events: asyncio.Queue):
        kind, payload = await events.get()
        if kind == "error":
            if isinstance(payload, UnknownAdapter):
                raise APIError(404, str(payload), "NotFoundError", "model", "model_not_found")
            raise APIError(500, f"generation failed: {type(payload).__name__}: {payload}", "server_error")
        return kind, payload

    async def run(req: GenerationRequest):
        events = submit(req)
        adapter = None
        while True:
            kind, payload = await next_event(events)
            if kind == "start":
                adapter = {"name": payload[0], "version": payload[1]}
            elif kind == "done":
                return adapter, payload

    def usage(res) -> dict:
        n_prompt, n_out = len(res.prompt_ids), len(res.token_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    def envelope(kind: str, cid: str, created: int, body: SamplingBody, choices: list, adapter, **extra) -> dict:
        """The fields every response and stream chunk carries, ours (adapter, logprobs_mode) included."""
        return {"id": cid, "object": kind, "created": created, "model": body.model, "choices": choices, **extra,
                "adapter": adapter, "logprobs_mode": LOGPROBS_MODE}

    def whole(kind: str, cid: str, created: int, body: SamplingBody, choice: dict, adapter, res) -> dict:
        """A non-streamed response; ``return_token_ids`` adds the reply's and the prompt's ids, as vLLM does."""
        out = envelope(kind, cid, created, body, [choice], adapter, usage=usage(res))
        if body.return_token_ids:
            choice["token_ids"] = res.token_ids
            out["prompt_token_ids"] = res.prompt_ids
        return out

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def sse_stream(chunks, rid: str):
        """A streamed response: each chunk as an event, then ``[DONE]``. A failure after the stream
        has started (its 200 is sent) goes in the stream as an OpenAI-shaped error event."""
        try:
            async for obj in chunks:
                yield sse(obj)
        except APIError as e:
            _log_server_error(rid, e)
            yield sse(_error_body(e))
        except Exception:  # noqa: BLE001 - the stream has started: the error goes in it, as JSON
            log.exception("request %s: stream failed", rid)
            yield sse(_error_body(_internal_error(rid)))
        yield "data: [DONE]\n\n"

    # -- endpoints -------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        """200 while the engine's worker runs; its restarts after faults and the last fault are shown."""
        state = {**engine.health(), **tool_stats}
        if not state["worker_alive"]:
            return JSONResponse({"status": "worker down", **state}, status_code=503)
        return {"status": "ok", **state}

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        now = int(time.time())
        data = [{"id": engine.base_name, "object": "model", "created": now, "owned_by": "marft", "root": engine.base_name, "parent": None}]
        for name, (version, path) in sorted(engine.adapters().items()):
            data.append(
                {"id": name, "object": "model", "created": now, "owned_by": "marft", "root": path,
                 "parent": engine.base_name, "version": version}
            )
        return {"object": "list", "data": data}

    def chat_prompt(body: ChatRequest) -> list[int]:
        """The prompt as the base model's chat template renders it, with the request's tools."""
        import jinja2

        kwargs = {"tools": [t.model_dump(exclude_none=True) for t in body.tools]} if body.tools else {}
        try:
            out = tok.apply_chat_template(template_messages(body.messages), add_generation_prompt=True,
                                          tokenize=True, **kwargs)
        except (jinja2.TemplateError, ValueError) as e:  # the template refused these messages
            raise APIError(400, f"messages do not fit the chat template: {e}", "invalid_request_error", "messages") from None
        return list(out["input_ids"])

    def tool_parser(body: ChatRequest) -> HermesParser | None:
        """Tool calls are parsed when tools are given and tool_choice is not "none"."""
        if not body.tools or body.tool_choice == "none":
            return None
        return HermesParser(max_calls=None if body.parallel_tool_calls else 1)

    def count_tools(body: ChatRequest, parser: HermesParser) -> None:
        tool_stats["tool_calls_parsed"] += len(parser.calls)
        tool_stats["tool_calls_malformed"] += parser.malformed
        tool_stats["tool_calls_dropped"] += parser.dropped
        choice = body.tool_choice
        wanted = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if (choice == "required" and not parser.calls) or (wanted and wanted not in {c.name for c in parser.calls}):
            tool_stats["tool_choice_unmet"] += 1

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        check_key(request)
        body = await parse(request, ChatRequest)
        prompt_ids = chat_prompt(body)
        top_n = (body.top_logprobs or 0) if body.logprobs else 0
        req = gen_request(body, prompt_ids, top_n, "messages")
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return StreamingResponse(sse_stream(chat_chunks(submit(req), req, body, cid, created),
                                                request.state.request_id), media_type="text/event-stream")
        adapter, res = await run(req)
        message = {"role": "assistant", "content": res.text}
        finish = res.finish_reason
        parser = tool_parser(body)
        if parser is not None:
            text, _ = parser.feed(res.text)
            rest, _ = parser.finish()
            count_tools(body, parser)
            if parser.calls:
                message = {"role": "assistant", "content": (text + rest) or None,
                           "tool_calls": [c.openai() for c in parser.calls]}
                finish = "tool_calls"
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": finish,
            "logprobs": {"content": [content_entry(*x) for x in zip(res.token_ids, res.logprobs, res.top_logprobs)]}
            if body.logprobs
            else None,
        }
        return whole("chat.completion", cid, created, body, choice, adapter, res)

    async def chat_chunks(events, req, body: ChatRequest, cid: str, created: int):
        adapter = None
        parser = tool_parser(body)
        n_calls = 0

        def chunk(delta, finish=None, logprobs=None, token_ids=None):
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            if token_ids is not None:
                choice["token_ids"] = token_ids
            return envelope("chat.completion.chunk", cid, created, body, [choice], adapter)

        def delta_of(text: str, calls) -> dict:
            nonlocal n_calls
            delta = {"content": text} if text or not calls else {}
            if calls:  # each call whole, in one delta: clients accumulate deltas by index either way
                delta["tool_calls"] = [c.openai(index=n_calls + i) for i, c in enumerate(calls)]
                n_calls += len(calls)
            return delta

        while True:
            kind, payload = await next_event(events)
            if kind == "start":
                adapter = {"name": payload[0], "version": payload[1]}
                first = chunk({"role": "assistant", "content": ""})
                if body.return_token_ids:
                    first["prompt_token_ids"] = req.prompt_ids
                yield first
            elif kind == "token":
                # Every sampled token gets its chunk (its id and log-prob), text held inside a call or not.
                delta = delta_of(*parser.feed(payload.text_delta)) if parser else {"content": payload.text_delta}
                lp = {"content": [content_entry(payload.token_id, payload.logprob, payload.top)]} if body.logprobs else None
                yield chunk(delta, logprobs=lp, token_ids=[payload.token_id] if body.return_token_ids else None)
            else:
                finish = payload.finish_reason
                if parser:
                    text, calls = parser.finish()
                    if text or calls:
                        yield chunk(delta_of(text, calls))
                    count_tools(body, parser)
                    finish = "tool_calls" if parser.calls else finish
                yield chunk({}, finish=finish)
                if body.stream_options and body.stream_options.include_usage:
                    yield envelope("chat.completion.chunk", cid, created, body, [], adapter, usage=usage(payload))
                break

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        body = await parse(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            prompt_ids = list(prompt)
            if any(not 0 <= p < min(len(tok), engine.vocab_size) for p in prompt_ids):
                raise APIError(400, "prompt token id out of the vocabulary", "invalid_request_error", "prompt")
        else:
            if isinstance(prompt, list):  # of strings (an empty list is neither kind: refused here)
                if len(prompt) != 1:
                    raise APIError(400, "exactly one prompt per request is supported", "invalid_request_error", "prompt")
                prompt = prompt[0]
            prompt_ids = list(tok(prompt)["input_ids"])
        top_n = body.logprobs or 0
        req = gen_request(body, prompt_ids, top_n, "prompt")
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def legacy_logprobs(ids, lps, tops):
            offsets, pos = [], 0
            for t in ids:
                offsets.append(pos)
                pos += len(token_text(t))
            return {"tokens": [token_text(t) for t in ids], "token_logprobs": lps,
                    "top_logprobs": [{token_text(t): v for t, v in top} for top in tops], "text_offset": offsets}

        if body.stream:
            events = submit(req)  # before the response starts, so a bad model name still gets its 404

            async def chunks():
                adapter = None
                while True:
                    kind, payload = await next_event(events)
                    if kind == "start":
                        adapter = {"name": payload[0], "version": payload[1]}
                        if not body.return_token_ids:
                            continue
                    choice = {"index": 0, "text": "", "finish_reason": None, "logprobs": None}
                    if kind == "token":
                        choice["text"] = payload.text_delta
                        if body.logprobs is not None:
                            choice["logprobs"] = legacy_logprobs([payload.token_id], [payload.logprob], [payload.top])
                        if body.return_token_ids:
                            choice["token_ids"] = [payload.token_id]
                    elif kind == "done":
                        choice["finish_reason"] = payload.finish_reason
                    out = envelope("text_completion", cid, created, body, [choice], adapter)
                    if kind == "start":  # vLLM sends the prompt's token ids once, first
                        out["prompt_token_ids"] = req.prompt_ids
                    yield out
                    if kind == "done":
                        break

            return StreamingResponse(sse_stream(chunks(), request.state.request_id), media_type="text/event-stream")
        adapter, res = await run(req)
        choice = {"index": 0, "text": res.text, "finish_reason": res.finish_reason,
                  "logprobs": legacy_logprobs(res.token_ids, res.logprobs, res.top_logprobs) if body.logprobs is not None else None}
        return whole("text_completion", cid, created, body, choice, adapter, res)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        check_key(request, admin=True)
        body = await parse(request, LoadAdapterRequest)
        try:
            version = await asyncio.to_thread(
                engine.load_adapter, body.lora_name, body.lora_path, load_inplace=body.load_inplace
            )
        except AdapterError as e:
            raise APIError(400, str(e), "BadRequestError", "lora_path") from None
        return {"status": "ok", "lora_name": body.lora_name, "version": version,
                "message": f"Success: LoRA adapter '{body.lora_name}' added successfully."}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        check_key(request, admin=True)
        body = await parse(request, UnloadAdapterRequest)
        try:
            await asyncio.to_thread(engine.unload_adapter, body.lora_name)
        except UnknownAdapter as e:
            raise APIError(404, str(e), "NotFoundError", "lora_name", "model_not_found") from None
        return {"status": "ok", "lora_name": body.lora_name,
                "message": f"Success: LoRA adapter '{body.lora_name}' removed successfully."}

    return app
