"""From an HTTP request to what the engine generates: the API key, the body (size-limited, validated
by ``requests.py``), the prompt's token ids and the ``GenerationRequest``. Every refusal is an
``APIError``."""

from __future__ import annotations

import secrets

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from ...chat_template import template_tool
from ..engine.types import GenerationRequest
from .errors import APIError, client_gone, validation_error
from .requests import ChatRequest, CompletionRequest, MessageError, SamplingBody, template_messages

DEFAULT_MAX_TOKENS = 256


def check_key(request: Request, api_key: str | None, admin: bool = False) -> None:
    """With ``api_key`` every ``/v1`` endpoint needs ``Authorization: Bearer <key>``; without one the
    admin endpoints are disabled altogether."""
    if api_key is None:
        if admin:
            raise APIError(403, "admin endpoints are disabled: start the server with --api-key", "permission_error")
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
        raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, read as it arrives and refused (413) as soon as it passes ``max_bytes``, declared or
    not (a chunked body has no Content-Length): at most ``max_bytes`` and one chunk are ever held."""
    try:
        declared = int(request.headers.get("content-length") or 0)
    except ValueError:
        raise APIError(400, "content-length is not a number", "invalid_request_error") from None
    if declared > max_bytes:
        raise _too_large(max_bytes)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise _too_large(max_bytes)
    except ClientDisconnect:
        raise client_gone() from None
    return bytes(body)


def _too_large(max_bytes: int) -> APIError:
    # The rest of the body is never read: the connection closes after the answer.
    return APIError(413, f"request body exceeds {max_bytes} bytes", "invalid_request_error",
                    headers={"Connection": "close"})


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int):
    """The body validated as ``model``; a body over ``max_bytes`` is a 413."""
    body = await read_body(request, max_bytes)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


def chat_prompt(tokenizer, body: ChatRequest) -> list[int]:
    """The prompt as the base model's chat template renders it, with the request's tools."""
    import jinja2

    kwargs = {"tools": [template_tool(t.model_dump()) for t in body.tools]} if body.tools else {}
    try:
        messages = template_messages(body.messages)
    except MessageError as e:
        raise APIError(400, str(e), "invalid_request_error", e.param) from None
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    except (jinja2.TemplateError, ValueError) as e:  # the template refused these messages
        raise APIError(400, f"messages do not fit the chat template: {e}", "invalid_request_error", "messages") from None
    except RecursionError:  # deeply nested tool-call arguments or tool parameters, rendered recursively
        raise APIError(400, "messages or tools are nested too deeply for the chat template",
                       "invalid_request_error", "messages") from None
    return list(out["input_ids"])


def completion_prompt(tokenizer, vocab_size: int, body: CompletionRequest) -> list[int]:
    """The prompt's token ids: given as ids (each inside the vocabulary), or one string tokenised."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        if any(not 0 <= p < min(len(tokenizer), vocab_size) for p in prompt):
            raise APIError(400, "prompt token id out of the vocabulary", "invalid_request_error", "prompt")
        return list(prompt)
    if isinstance(prompt, list):  # of strings (an empty list is neither kind: refused here)
        if len(prompt) != 1:
            raise APIError(400, "exactly one prompt per request is supported", "invalid_request_error", "prompt")
        prompt = prompt[0]
    return list(tokenizer(prompt)["input_ids"])


def generation_request(engine, body: SamplingBody, prompt_ids: list[int], top_logprobs: int,
                       param: str) -> GenerationRequest:
    """What the engine is asked to generate; ``param`` names the prompt's field in errors."""
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
        allowed_token_ids=body.allowed_token_ids,
    )
