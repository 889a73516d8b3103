"""The embedded server's endpoints, each a thin handler: check the key, parse the body, hand the
request to the engine, shape the answer. The server's state (``ServerContext``) is on
``app.state.marft``, set by ``create_app``.

FastAPI is imported at module level because it resolves the endpoints' ``Request`` annotations by
name.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..adapter_files import AdapterError
from ..engine.engine import AdapterEngine
from ..engine.types import UnknownAdapter
from . import responses
from .errors import APIError
from .generation import Generation
from .request_parsing import check_key, chat_prompt, completion_prompt, generation_request, parse_body
from .requests import ChatRequest, CompletionRequest, LoadAdapterRequest, UnloadAdapterRequest
from .tool_calls import ToolCallStats, parser_for

router = APIRouter()


@dataclass
class ServerContext:
    engine: AdapterEngine
    api_key: str | None
    max_request_bytes: int
    tool_stats: ToolCallStats = field(default_factory=ToolCallStats)


def _context(request: Request) -> ServerContext:
    return request.app.state.marft


@router.get("/health")
async def health(request: Request):
    """200 while the engine's worker runs; its restarts after faults and the last fault are shown."""
    ctx = _context(request)
    state = {**ctx.engine.health(), **ctx.tool_stats.counts}
    if not state["worker_alive"]:
        return JSONResponse({"status": "worker down", **state}, status_code=503)
    return {"status": "ok", **state}


@router.get("/v1/models")
async def models(request: Request):
    ctx = _context(request)
    check_key(request, ctx.api_key)
    return responses.models_list(ctx.engine.base_name, ctx.engine.adapters(), int(time.time()))


@router.post("/v1/chat/completions")
async def chat(request: Request):
    ctx = _context(request)
    check_key(request, ctx.api_key)
    body = await parse_body(request, ChatRequest, ctx.max_request_bytes)
    tok = ctx.engine.tokenizer
    top_n = (body.top_logprobs or 0) if body.logprobs else 0
    req = generation_request(ctx.engine, body, chat_prompt(tok, body), top_n, "messages")
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    gen = Generation(ctx.engine, req)
    parser = parser_for(body)
    if body.stream:
        on_parsed = lambda p: ctx.tool_stats.count(body, p)  # noqa: E731
        chunks = responses.chat_chunks(tok, gen.events(), req, body, cid, created, parser, on_parsed)
        return gen.stream(chunks, request.state.request_id)
    res = await gen.result(request)
    out = responses.chat_completion(tok, cid, created, body, gen.adapter, res, parser)
    if parser is not None:
        ctx.tool_stats.count(body, parser)
    return out


@router.post("/v1/completions")
async def completions(request: Request):
    ctx = _context(request)
    check_key(request, ctx.api_key)
    body = await parse_body(request, CompletionRequest, ctx.max_request_bytes)
    tok = ctx.engine.tokenizer
    prompt_ids = completion_prompt(tok, ctx.engine.vocab_size, body)
    req = generation_request(ctx.engine, body, prompt_ids, body.logprobs or 0, "prompt")
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    gen = Generation(ctx.engine, req)
    if body.stream:
        chunks = responses.completion_chunks(tok, gen.events(), req, body, cid, created)
        return gen.stream(chunks, request.state.request_id)
    res = await gen.result(request)
    return responses.completion(tok, cid, created, body, gen.adapter, res)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    ctx = _context(request)
    check_key(request, ctx.api_key, admin=True)
    body = await parse_body(request, LoadAdapterRequest, ctx.max_request_bytes)
    try:
        version = await asyncio.to_thread(ctx.engine.load_adapter, body.lora_name, body.lora_path,
                                          load_inplace=body.load_inplace)
    except AdapterError as e:
        raise APIError(400, str(e), "BadRequestError", "lora_path") from None
    return {"status": "ok", "lora_name": body.lora_name, "version": version,
            "message": f"Success: LoRA adapter '{body.lora_name}' added successfully."}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    ctx = _context(request)
    check_key(request, ctx.api_key, admin=True)
    body = await parse_body(request, UnloadAdapterRequest, ctx.max_request_bytes)
    try:
        await asyncio.to_thread(ctx.engine.unload_adapter, body.lora_name)
    except UnknownAdapter as e:
        raise APIError(404, str(e), "NotFoundError", "lora_name", "model_not_found") from None
    return {"status": "ok", "lora_name": body.lora_name,
            "message": f"Success: LoRA adapter '{body.lora_name}' removed successfully."}
