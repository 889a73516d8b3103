"""The embedded OpenAI-compatible HTTP server (FastAPI) in front of an ``AdapterEngine``.

Same surface as vLLM's multi-LoRA server: ``model`` = adapter name, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` for hot-swap, ``return_token_ids``. On top of it every response carries
``"adapter": {"name", "version"}`` (the registry version that produced it) and
``"logprobs_mode": "processed"`` (log-probs after temperature/top-k/top-p).

FastAPI is imported at module level because it resolves the endpoints' ``Request`` annotations by
name; only ``marft serve`` imports this module.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .adapter_files import AdapterError
from .engine import AdapterEngine, GenerationRequest, RequestError, UnknownAdapter

LOGPROBS_MODE = "processed"
DEFAULT_MAX_TOKENS = 256


# -- request bodies (unknown fields are ignored, as OpenAI-compatible servers do) --------------------
class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)  # vLLM uses -1 for "off"; so does 0 here
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    return_token_ids: bool = False
    n: int = Field(default=1, ge=1, le=1)


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False


class LoadAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadAdapterRequest(BaseModel):
    lora_name: str


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error_body(e: APIError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def create_app(engine: AdapterEngine, *, api_key: str | None = None, max_request_bytes: int = 1 << 20):
    """The FastAPI application. With ``api_key`` every ``/v1`` endpoint needs ``Authorization: Bearer
    <key>``; without one the admin endpoints are disabled altogether."""
    app = FastAPI(title="marft serve", docs_url=None, redoc_url=None, openapi_url=None)
    tok = engine.tokenizer

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(_error_body(e), status_code=e.status)

    def check_key(request: Request, admin: bool = False) -> None:
        if api_key is None:
            if admin:
                raise APIError(403, "admin endpoints are disabled: start the server with --api-key", "permission_error")
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")

    async def parse(request: Request, model: type[BaseModel]):
        if int(request.headers.get("content-length") or 0) > max_request_bytes:
            raise APIError(413, f"request body exceeds {max_request_bytes} bytes", "invalid_request_error")
        body = await request.body()
        if len(body) > max_request_bytes:
            raise APIError(413, f"request body exceeds {max_request_bytes} bytes", "invalid_request_error")
        try:
            return model.model_validate_json(body)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], "invalid_request_error", param) from None

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

    def gen_request(body: _Sampling, prompt_ids: list[int], top_logprobs: int) -> GenerationRequest:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        max_tokens = body.max_completion_tokens or body.max_tokens or min(DEFAULT_MAX_TOKENS, engine.max_tokens_limit)
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
            raise APIError(400, str(e), "invalid_request_error") from None
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

    def envelope(kind: str, cid: str, created: int, body: _Sampling, choices: list, adapter, **extra) -> dict:
        """The fields every response and stream chunk carries, ours (adapter, logprobs_mode) included."""
        return {"id": cid, "object": kind, "created": created, "model": body.model, "choices": choices, **extra,
                "adapter": adapter, "logprobs_mode": LOGPROBS_MODE}

    def whole(kind: str, cid: str, created: int, body: _Sampling, choice: dict, adapter, res) -> dict:
        """A non-streamed response; ``return_token_ids`` adds the reply's and the prompt's ids, as vLLM does."""
        out = envelope(kind, cid, created, body, [choice], adapter, usage=usage(res))
        if body.return_token_ids:
            choice["token_ids"] = res.token_ids
            out["prompt_token_ids"] = res.prompt_ids
        return out

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    # -- endpoints -------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok"}

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

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        check_key(request)
        body = await parse(request, ChatRequest)
        messages = [{"role": m.get("role", "user"), "content": _text_content(m.get("content"))} for m in body.messages]
        try:
            prompt_ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
        except Exception as e:  # noqa: BLE001 - a template error is the client's input
            raise APIError(400, f"messages do not fit the chat template: {e}", "invalid_request_error", "messages") from None
        top_n = (body.top_logprobs or 0) if body.logprobs else 0
        req = gen_request(body, prompt_ids, top_n)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return StreamingResponse(chat_stream(submit(req), req, body, cid, created), media_type="text/event-stream")
        adapter, res = await run(req)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": res.text},
            "finish_reason": res.finish_reason,
            "logprobs": {"content": [content_entry(*x) for x in zip(res.token_ids, res.logprobs, res.top_logprobs)]}
            if body.logprobs
            else None,
        }
        return whole("chat.completion", cid, created, body, choice, adapter, res)

    async def chat_stream(events, req, body: ChatRequest, cid: str, created: int):
        adapter = None

        def chunk(delta, finish=None, logprobs=None, token_ids=None):
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            if token_ids is not None:
                choice["token_ids"] = token_ids
            return envelope("chat.completion.chunk", cid, created, body, [choice], adapter)

        try:
            while True:
                kind, payload = await next_event(events)
                if kind == "start":
                    adapter = {"name": payload[0], "version": payload[1]}
                    first = chunk({"role": "assistant", "content": ""})
                    if body.return_token_ids:
                        first["prompt_token_ids"] = req.prompt_ids
                    yield sse(first)
                elif kind == "token":
                    lp = {"content": [content_entry(payload.token_id, payload.logprob, payload.top)]} if body.logprobs else None
                    yield sse(chunk({"content": payload.text_delta}, logprobs=lp,
                                    token_ids=[payload.token_id] if body.return_token_ids else None))
                else:
                    yield sse(chunk({}, finish=payload.finish_reason))
                    if (body.stream_options or {}).get("include_usage"):
                        yield sse(envelope("chat.completion.chunk", cid, created, body, [], adapter, usage=usage(payload)))
                    break
        except APIError as e:
            yield sse(_error_body(e))
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        body = await parse(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            prompt_ids = list(prompt)
            if any(not 0 <= p < len(tok) for p in prompt_ids):
                raise APIError(400, "prompt token id out of the vocabulary", "invalid_request_error", "prompt")
        else:
            if isinstance(prompt, list):
                if len(prompt) != 1:
                    raise APIError(400, "exactly one prompt per request is supported", "invalid_request_error", "prompt")
                prompt = prompt[0]
            prompt_ids = list(tok(prompt)["input_ids"])
        top_n = body.logprobs or 0
        req = gen_request(body, prompt_ids, top_n)
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

            async def stream():
                adapter = None
                try:
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
                        yield sse(out)
                        if kind == "done":
                            break
                except APIError as e:
                    yield sse(_error_body(e))
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")
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


def _text_content(content) -> str:
    """OpenAI message content may be a string or a list of parts; the template wants text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise APIError(400, "message content must be a string or a list of text parts", "invalid_request_error", "messages")
