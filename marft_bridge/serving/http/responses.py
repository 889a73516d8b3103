"""OpenAI response shapes of the embedded server, built from the engine's results and events.

Pure: no engine, no HTTP. Beside OpenAI's fields every response and chunk carries
``"adapter": {"name", "version"}`` and ``"logprobs_mode": "processed"``; with ``return_token_ids`` a
response carries ``choices[].token_ids`` and the prompt's ids where vLLM puts them: a chat response's
``prompt_token_ids`` at the top (streamed: in the role chunk), a completion's in ``choices[0]``
(streamed: in the first token's chunk).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from ..engine.types import GenerationRequest, GenerationResult
from .requests import ChatRequest, CompletionRequest, SamplingBody
from .tool_calls import HermesParser

LOGPROBS_MODE = "processed"


def token_text(tokenizer, tid: int) -> str:
    return tokenizer.decode([tid], skip_special_tokens=False)


def content_entry(tokenizer, tid: int, lp: float, top: list[tuple[int, float]]) -> dict:
    """One token of a chat response's ``logprobs.content``."""
    text = token_text(tokenizer, tid)
    return {
        "token": text,
        "logprob": lp,
        "bytes": list(text.encode()),
        "top_logprobs": [{"token": token_text(tokenizer, t), "logprob": v, "bytes": list(token_text(tokenizer, t).encode())}
                         for t, v in top],
    }


def legacy_logprobs(tokenizer, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]) -> dict:
    """A completion's ``logprobs`` in the legacy (pre-chat) shape."""
    offsets, pos = [], 0
    for t in ids:
        offsets.append(pos)
        pos += len(token_text(tokenizer, t))
    return {"tokens": [token_text(tokenizer, t) for t in ids], "token_logprobs": lps,
            "top_logprobs": [{token_text(tokenizer, t): v for t, v in top} for top in tops], "text_offset": offsets}


def usage(res: GenerationResult) -> dict:
    n_prompt, n_out = len(res.prompt_ids), len(res.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def envelope(kind: str, cid: str, created: int, body: SamplingBody, choices: list, adapter, **extra) -> dict:
    """The fields every response and stream chunk carries, ours (adapter, logprobs_mode) included."""
    return {"id": cid, "object": kind, "created": created, "model": body.model, "choices": choices, **extra,
            "adapter": adapter, "logprobs_mode": LOGPROBS_MODE}


def whole(kind: str, cid: str, created: int, body: SamplingBody, choice: dict, adapter, res: GenerationResult) -> dict:
    """A non-streamed response; ``return_token_ids`` adds the reply's and the prompt's ids, as vLLM does
    (a completion's prompt ids in its choice, a chat response's at the top)."""
    out = envelope(kind, cid, created, body, [choice], adapter, usage=usage(res))
    if body.return_token_ids:
        choice["token_ids"] = res.token_ids
        (choice if kind == "text_completion" else out)["prompt_token_ids"] = res.prompt_ids
    return out


def models_list(base_name: str, adapters: dict[str, tuple[int | None, str]], now: int) -> dict:
    """``/v1/models``: the base model, then each adapter (its version, and its path as ``root``)."""
    data = [{"id": base_name, "object": "model", "created": now, "owned_by": "marft", "root": base_name, "parent": None}]
    for name, (version, path) in sorted(adapters.items()):
        data.append({"id": name, "object": "model", "created": now, "owned_by": "marft", "root": path,
                     "parent": base_name, "version": version})
    return {"object": "list", "data": data}


# -- chat -------------------------------------------------------------------------------------------
def chat_completion(tokenizer, cid: str, created: int, body: ChatRequest, adapter, res: GenerationResult,
                    parser: HermesParser | None) -> dict:
    """A whole chat response; with a parser, Hermes tool-call blocks become ``tool_calls``."""
    message = {"role": "assistant", "content": res.text}
    finish = res.finish_reason
    if parser is not None:
        text, _ = parser.feed(res.text)
        rest, _ = parser.finish()
        if parser.calls:
            message = {"role": "assistant", "content": (text + rest) or None,
                       "tool_calls": [c.openai() for c in parser.calls]}
            finish = "tool_calls"
    logprobs = None
    if body.logprobs:
        logprobs = {"content": [content_entry(tokenizer, *x) for x in zip(res.token_ids, res.logprobs, res.top_logprobs)]}
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}
    return whole("chat.completion", cid, created, body, choice, adapter, res)


async def chat_chunks(tokenizer, events: AsyncIterator, req: GenerationRequest, body: ChatRequest, cid: str,
                      created: int, parser: HermesParser | None,
                      on_parsed: Callable[[HermesParser], None]) -> AsyncIterator[dict]:
    """A streamed chat response's chunks from the engine's events; ``on_parsed`` gets the parser
    once the last token is in."""
    adapter = None
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

    async for kind, payload in events:
        if kind == "start":
            adapter = {"name": payload[0], "version": payload[1]}
            first = chunk({"role": "assistant", "content": ""})
            if body.return_token_ids:
                first["prompt_token_ids"] = req.prompt_ids
            yield first
        elif kind == "token":
            # Every sampled token gets its chunk (its id and log-prob), text held inside a call or not.
            delta = delta_of(*parser.feed(payload.text_delta)) if parser else {"content": payload.text_delta}
            lp = {"content": [content_entry(tokenizer, payload.token_id, payload.logprob, payload.top)]} if body.logprobs else None
            yield chunk(delta, logprobs=lp, token_ids=[payload.token_id] if body.return_token_ids else None)
        else:
            finish = payload.finish_reason
            if parser:
                text, calls = parser.finish()
                if text or calls:
                    yield chunk(delta_of(text, calls))
                on_parsed(parser)
                finish = "tool_calls" if parser.calls else finish
            yield chunk({}, finish=finish)
            if body.stream_options and body.stream_options.include_usage:
                yield envelope("chat.completion.chunk", cid, created, body, [], adapter, usage=usage(payload))


# -- completions ------------------------------------------------------------------------------------
def completion(tokenizer, cid: str, created: int, body: CompletionRequest, adapter, res: GenerationResult) -> dict:
    logprobs = None
    if body.logprobs is not None:
        logprobs = legacy_logprobs(tokenizer, res.token_ids, res.logprobs, res.top_logprobs)
    choice = {"index": 0, "text": res.text, "finish_reason": res.finish_reason, "logprobs": logprobs}
    return whole("text_completion", cid, created, body, choice, adapter, res)


async def completion_chunks(tokenizer, events: AsyncIterator, req: GenerationRequest, body: CompletionRequest,
                            cid: str, created: int) -> AsyncIterator[dict]:
    adapter = None
    prompt_ids = req.prompt_ids if body.return_token_ids else None  # sent once, in the first chunk after start
    async for kind, payload in events:
        if kind == "start":
            adapter = {"name": payload[0], "version": payload[1]}
            continue
        choice = {"index": 0, "text": "", "finish_reason": None, "logprobs": None}
        if prompt_ids is not None:  # vLLM puts them in the first token's choice
            choice["prompt_token_ids"], prompt_ids = prompt_ids, None
        if kind == "token":
            choice["text"] = payload.text_delta
            if body.logprobs is not None:
                choice["logprobs"] = legacy_logprobs(tokenizer, [payload.token_id], [payload.logprob], [payload.top])
            if body.return_token_ids:
                choice["token_ids"] = [payload.token_id]
        elif kind == "done":
            choice["finish_reason"] = payload.finish_reason
        yield envelope("text_completion", cid, created, body, [choice], adapter)
