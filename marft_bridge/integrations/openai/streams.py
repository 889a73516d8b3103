"""Streamed OpenAI-API responses folded into one response of the non-streaming shape, while the app
gets every chunk unchanged: the app's ``Stream`` comes back behind a ``wrapt`` proxy whose iteration
runs through ``tap`` / ``atap`` (nothing of the client's is reassigned; see ``integrations.openai``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import wrapt

from ...capture_errors import capture_error, guarded

# Key of the assembled stream response that carries what only the chunks showed.
STREAM_KEY = "marft_stream"


# -- chat-completion chunks -------------------------------------------------------------------------------------


class StreamAccumulator:
    """Folds chat-completion chunks (first choice) into one response of the non-streaming shape.

    Token ids and log-probs are concatenated per chunk; if any chunk carries a different number
    of each (while the stream as a whole has both), the pairing is unreliable and the assembled
    response says so under ``STREAM_KEY`` so that ``completion_fields`` drops both.
    """

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.role = "assistant"
        self.text: list[str] = []
        self.tool_calls: dict[int, dict] = {}
        self.token_ids: list[int] | None = None
        self.logprobs: list[dict] | None = None
        self.counts: list[tuple[int, int]] = []  # (token ids, log-probs) per chunk that had either
        self.finish_reason: str | None = None
        self.prompt_token_ids: list[int] | None = None
        self.adapter: dict | None = None
        self.usage: dict | None = None
        self.chunks = 0
        self.failed = False
        self.final_ready = False  # chat streams are complete only at their end

    def add(self, chunk: Any) -> None:
        c = chunk.model_dump(mode="json") if hasattr(chunk, "model_dump") else chunk
        if not isinstance(c, dict):
            return
        self.chunks += 1
        for k in ("id", "model", "created", "system_fingerprint"):
            if c.get(k) is not None:
                self.head.setdefault(k, c[k])
        if isinstance(c.get("adapter"), dict):
            self.adapter = c["adapter"]
        if c.get("usage"):
            self.usage = c["usage"]
        if self.prompt_token_ids is None and c.get("prompt_token_ids") is not None:
            self.prompt_token_ids = list(c["prompt_token_ids"])
        for choice in c.get("choices") or []:
            if isinstance(choice, dict) and (choice.get("index") or 0) == 0:
                self._add_choice(choice)

    def _add_choice(self, ch: dict) -> None:
        delta = ch.get("delta") or {}
        if delta.get("role"):
            self.role = delta["role"]
        if delta.get("content"):
            self.text.append(delta["content"])
        for tc in delta.get("tool_calls") or []:
            slot = self.tool_calls.setdefault(
                tc.get("index", len(self.tool_calls)), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            slot["id"] = tc.get("id") or slot["id"]
            slot["type"] = tc.get("type") or slot["type"]
            fn = tc.get("function") or {}
            slot["function"]["name"] += fn.get("name") or ""
            slot["function"]["arguments"] += fn.get("arguments") or ""
        if self.prompt_token_ids is None and ch.get("prompt_token_ids") is not None:
            self.prompt_token_ids = list(ch["prompt_token_ids"])
        ids = ch.get("token_ids")
        content = (ch.get("logprobs") or {}).get("content") if isinstance(ch.get("logprobs"), dict) else None
        if ids is not None:
            self.token_ids = self.token_ids or []
            self.token_ids.extend(ids)
        if content is not None:
            self.logprobs = self.logprobs or []
            self.logprobs.extend(content)
        if ids or content:
            self.counts.append((len(ids or ()), len(content or ())))
        if ch.get("finish_reason"):
            self.finish_reason = ch["finish_reason"]

    def problem(self) -> str | None:
        if self.token_ids is None or self.logprobs is None:
            return None
        for n, (n_ids, n_lps) in enumerate(self.counts):
            if n_ids != n_lps:
                return f"stream chunk {n + 1} with tokens: {n_lps} log-probs for {n_ids} token ids"
        return None

    def response(self) -> dict[str, Any] | None:
        message: dict[str, Any] = {"role": self.role, "content": "".join(self.text)}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": self.finish_reason,
            "logprobs": {"content": self.logprobs} if self.logprobs is not None else None,
            "token_ids": self.token_ids,
        }
        out: dict[str, Any] = {**self.head, "object": "chat.completion", "choices": [choice]}
        for k in ("adapter", "usage", "prompt_token_ids"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        out[STREAM_KEY] = {"chunks": self.chunks, "token_data_dropped": self.problem()}
        return out


class ResponsesStreamAccumulator:
    """Responses-API stream events: the terminal event (``response.completed``, ``.incomplete`` or
    ``.failed``) carries the whole response, delivered as soon as it arrives (a reader such as the
    Agents SDK may stop there); without one the stream records nothing."""

    _TERMINAL = ("response.completed", "response.incomplete", "response.failed")

    def __init__(self) -> None:
        self.final: dict | None = None
        self.chunks = 0
        self.failed = False
        self.final_ready = False

    def add(self, event: Any) -> None:
        e = event.model_dump(mode="json") if hasattr(event, "model_dump") else event
        if not isinstance(e, dict):
            return
        self.chunks += 1
        if e.get("type") in self._TERMINAL and isinstance(e.get("response"), dict):
            self.final = e["response"]
            self.final_ready = True

    def response(self) -> dict[str, Any] | None:
        if self.final is None:
            return None
        return {**self.final, STREAM_KEY: {"chunks": self.chunks}}


def _fold(acc: Any, chunk: Any) -> None:
    """Add one chunk; the first failure stops this stream's capture (the app still gets every chunk)."""
    if acc.failed:
        return
    try:
        acc.add(chunk)
    except Exception as e:  # noqa: BLE001 - capture must not break the stream
        acc.failed = True
        capture_error("openai.stream", e)


def _finish(acc: Any, deliver: Callable[[dict], None]) -> None:
    if acc.failed:
        return
    with guarded("openai.capture"):
        response = acc.response()
        if response is not None:
            deliver(response)


def tap(source: Iterator, acc: Any, deliver: Callable[[dict], None]) -> Iterator:
    delivered = False
    try:
        for chunk in source:
            _fold(acc, chunk)
            if acc.final_ready and not delivered:  # before the app sees the end: it may stop reading there
                delivered = True
                _finish(acc, deliver)
            yield chunk
    finally:
        source.close()
    if not delivered:
        _finish(acc, deliver)


async def atap(source: AsyncIterator, acc: Any, deliver: Callable[[dict], None]) -> AsyncIterator:
    delivered = False
    try:
        async for chunk in source:
            _fold(acc, chunk)
            if acc.final_ready and not delivered:
                delivered = True
                _finish(acc, deliver)
            yield chunk
    finally:
        await source.aclose()
    if not delivered:
        _finish(acc, deliver)



class TappedStream(wrapt.ObjectProxy):
    """A sync ``Stream`` whose chunks pass through ``tap`` (``with`` and ``next()`` included)."""

    def __init__(self, stream: Any, acc: Any, deliver: Callable[[dict], None]) -> None:
        super().__init__(stream)
        self._self_chunks = tap(iter(stream), acc, deliver)

    def __iter__(self) -> Iterator:
        return self._self_chunks

    def __next__(self) -> Any:
        return next(self._self_chunks)

    def __enter__(self) -> TappedStream:
        self.__wrapped__.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.__wrapped__.__exit__(*exc)


class TappedAsyncStream(wrapt.ObjectProxy):
    """An ``AsyncStream`` whose chunks pass through ``atap``."""

    def __init__(self, stream: Any, acc: Any, deliver: Callable[[dict], None]) -> None:
        super().__init__(stream)
        self._self_chunks = atap(stream.__aiter__(), acc, deliver)

    def __aiter__(self) -> AsyncIterator:
        return self._self_chunks

    async def __anext__(self) -> Any:
        return await self._self_chunks.__anext__()

    async def __aenter__(self) -> TappedAsyncStream:
        await self.__wrapped__.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> Any:
        return await self.__wrapped__.__aexit__(*exc)


class TappedResponse(wrapt.ObjectProxy):
    """A raw response (``with_raw_response`` / ``with_streaming_response``) whose ``parse()`` gives the
    tapped stream."""

    def __init__(self, response: Any, stream: Any) -> None:
        super().__init__(response)
        self._self_stream = stream

    def parse(self, *args: Any, **kwargs: Any) -> Any:
        return self.__wrapped__.parse(*args, **kwargs) if args or kwargs else self._self_stream


class TappedAsyncResponse(TappedResponse):
    async def parse(self, *args: Any, **kwargs: Any) -> Any:
        return await self.__wrapped__.parse(*args, **kwargs) if args or kwargs else self._self_stream


def tapped(result: Any, stream: Any, acc: Any, deliver: Callable[[dict], None]) -> Any:
    """What the app gets in place of ``result`` (a stream, or the raw response ``stream`` was parsed
    from): the same object behind a tapping proxy; ``result`` itself when ``stream`` is no stream."""
    from openai import AsyncStream, Stream

    if isinstance(stream, Stream):
        proxy = TappedStream(stream, acc, deliver)
    elif isinstance(stream, AsyncStream):
        proxy = TappedAsyncStream(stream, acc, deliver)
    else:
        return result
    if stream is result:
        return proxy
    return (TappedAsyncResponse if isinstance(proxy, TappedAsyncStream) else TappedResponse)(result, proxy)


__all__ = ["STREAM_KEY", "ResponsesStreamAccumulator", "StreamAccumulator", "atap", "tap", "tapped"]
