"""Capture from OpenAI-compatible clients (the ``openai`` package, and ``langchain_openai`` on top of it).

The hook sits on the ``openai`` client's ``request`` for ``/chat/completions``, so it sees the
request body and the full response JSON, including fields that ``langchain_openai.ChatOpenAI``
drops: vLLM's ``choices[].token_ids`` and ``prompt_token_ids`` (``return_token_ids``), the sampled
tokens' ``logprobs``, and our server's top-level ``"adapter": {"name", "version"}``. Token ids and
log-probs are stored exactly (``token_source="server"``); without them the action keeps its text
and is marked for re-tokenisation (``token_source="retokenize"``).

Where a call lands:
- inside a LangChain chat-model call that the LangGraph capture is recording: the raw response is
  handed to that call (one action, with exact token data);
- inside a captured LangGraph node (a direct ``client.chat.completions.create``): an action of
  that node's agent, with the node's dependencies;
- inside ``marft_bridge.episode(...)``: an action whose agent is the model name (= adapter
  name), depending on earlier actions whose output text appears in its messages.
Outside all of these the hook does nothing.

Which adapter version answered: our server says so in ``"adapter"``; vLLM does not. With
``use_registry(root)`` set (``instrument(..., registry=root)`` sets it), a response without a
version gets the registry's live version of the requested model (the adapter name = registry
agent), read when the request goes out (see ``LiveVersions``);
``metadata["adapter_version_source"]`` records ``"server"`` or ``"registry"``.

Streams (``stream=True``; ``ChatOpenAI(streaming=True)`` and ``.stream()``) are tapped: the app
gets the very same chunk objects, while capture folds each chunk's ``delta``, ``token_ids``,
``logprobs.content``, ``prompt_token_ids``, ``adapter`` and ``finish_reason`` into one response of
the non-streaming shape (``StreamAccumulator``), delivered as above when the stream ends, in the
context of the call that opened it. A stream abandoned or failed before its end records nothing.

``install()`` / ``uninstall()`` patch and restore the client (``install`` is idempotent and is
called by ``marft_bridge.instrument``/``capture``). ``completion_fields(request, response)``
turns one request/response pair into the keyword arguments of ``EpisodeRecorder.record_action``.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from ..recording import capture_error, current_episode, guarded, in_framework_task, record_in_framework_task
from ..schema import utcnow

_PATHS = ("/chat/completions",)
# Key of the assembled stream response that carries what only the chunks showed.
STREAM_KEY = "marft_stream"
# Key the hook adds to a response: the registry's live version of the requested adapter.
REGISTRY_KEY = "marft_registry_version"


class RawCall:
    """The request and response of one OpenAI-API call, filled in by the client hook."""

    __slots__ = ("request", "response", "started_at", "ended_at", "done")

    def __init__(self) -> None:
        self.request: dict | None = None
        self.response: dict | None = None
        self.started_at: datetime | None = None
        self.ended_at: datetime | None = None
        self.done = False


# Set by the LangGraph capture while a LangChain chat-model call runs: the hook fills it.
RAW_SINK: contextvars.ContextVar[RawCall | None] = contextvars.ContextVar("marft_raw_sink", default=None)

_originals: dict[str, Any] = {}


# -- parsing -------------------------------------------------------------------------------------


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _message(m: dict) -> dict:
    out: dict[str, Any] = {"role": str(m.get("role") or "user"), "content": _text(m.get("content"))}
    for k in ("name", "tool_call_id"):
        if m.get(k) is not None:
            out[k] = str(m[k])
    if m.get("tool_calls"):
        out["tool_calls"] = [dict(tc) for tc in m["tool_calls"]]
    return out


def token_data(logprobs: Any, token_ids: list[int] | None) -> tuple[list[int] | None, list[float] | None, str | None]:
    """(token ids, log-probs, problem) from a choice's ``logprobs`` and ``token_ids``.

    Token ids come from ``token_ids`` or, with vLLM's ``return_tokens_as_token_ids``, from
    ``"token_id:N"`` token strings. Mismatched lengths drop both (the problem says why).
    """
    content = (logprobs or {}).get("content") if isinstance(logprobs, dict) else None
    lps = [float(c["logprob"]) for c in content] if content else None
    ids = list(token_ids) if token_ids is not None else None
    if ids is None and content and all(str(c.get("token", "")).startswith("token_id:") for c in content):
        ids = [int(str(c["token"])[len("token_id:"):]) for c in content]
    if ids is not None and lps is not None and len(ids) != len(lps):
        return None, None, f"{len(lps)} log-probs for {len(ids)} token ids"
    return ids, (lps if ids is not None else None), None


def completion_fields(request: dict, response: dict) -> dict[str, Any]:
    """``record_action`` keyword arguments for one chat-completions request/response pair."""
    choice = (response.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    ids, lps, problem = token_data(choice.get("logprobs"), choice.get("token_ids"))
    stream = response.get(STREAM_KEY) if isinstance(response.get(STREAM_KEY), dict) else None
    if problem is None and stream and stream.get("token_data_dropped"):  # misaligned chunks, equal totals
        ids, lps, problem = None, None, stream["token_data_dropped"]
    extra = request.get("extra_body") or {}

    def param(name: str) -> Any:
        return request.get(name, extra.get(name))

    stop = param("stop")
    sampling = {
        "temperature": param("temperature"),
        "top_p": param("top_p"),
        "top_k": param("top_k"),
        "max_tokens": param("max_completion_tokens") or param("max_tokens"),
        "seed": param("seed"),
        "stop": [stop] if isinstance(stop, str) else stop,
    }
    adapter = response.get("adapter") if isinstance(response.get("adapter"), dict) else {}
    model = str(adapter.get("name") or request.get("model") or response.get("model") or "unknown")
    version, source = adapter.get("version"), "server"  # the server's word wins over the registry's
    if version is None and response.get(REGISTRY_KEY) is not None:
        version, source = response[REGISTRY_KEY], "registry"
    metadata: dict[str, Any] = {"response_model": response.get("model"), "response_id": response.get("id"),
                                "adapter_version_source": source if version is not None else None}
    if problem:
        metadata["token_data_dropped"] = problem
    if stream:
        metadata["stream_chunks"] = stream.get("chunks")
    prompt_ids = response.get("prompt_token_ids") or choice.get("prompt_token_ids")
    return {
        "observation": {
            "messages": [_message(m) for m in request.get("messages") or [] if isinstance(m, dict)],
            "prompt_token_ids": list(prompt_ids) if prompt_ids is not None else None,
        },
        "output": {
            "text": _text(msg.get("content")) or "",
            "token_ids": ids,
            "logprobs": lps,
            "tool_calls": [dict(tc) for tc in msg["tool_calls"]] if msg.get("tool_calls") else None,
            "finish_reason": choice.get("finish_reason"),
        },
        "sampling": {k: v for k, v in sampling.items() if v is not None} or None,
        "policy": {"name": model, "version": version},
        "token_source": "server" if ids is not None else "retokenize",
        "metadata": {k: v for k, v in metadata.items() if v is not None},
    }


def _response_dict(result: Any) -> dict | None:
    if hasattr(result, "parse") and hasattr(result, "http_response"):  # with_raw_response
        result = result.parse()
    if hasattr(result, "model_dump"):
        return result.model_dump(mode="json")
    return result if isinstance(result, dict) else None


# -- adapter version from the registry -----------------------------------------------------------


class LiveVersions:
    """The live version of each agent in one adapter registry, re-read only when its state file changes.

    Race: the capture reads the version when the request goes out. ``promote`` (and ``rollback``)
    loads into the server first and writes the state file after, so a version read there is already
    being served; a request sent between the load and the state write is labelled with the previous
    version although the new one may answer it. The window is that gap (milliseconds) per swap,
    not a request's latency; in-flight requests keep the version they were sent under.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser().resolve()
        self._cache: dict[str, tuple[tuple[int, int, int], int | None]] = {}

    def get(self, agent: str) -> int | None:
        """``agent``'s live version; None for a name the registry does not manage. Raises if the
        registry is missing or its state unreadable."""
        from ..serving.registry import AGENT_NAME, read_state, state_file

        if not AGENT_NAME.match(agent):  # e.g. "org/base-model": not an adapter of ours
            return None
        path = state_file(self.root, agent)
        try:
            st = path.stat()
        except FileNotFoundError:
            if not self.root.is_dir():
                raise FileNotFoundError(f"adapter registry {self.root} does not exist") from None
            return None  # never promoted, or not an agent of this registry
        # Size and inode too: two writes within one timestamp tick still differ in them
        # (every promote appends to the history, every rollback drops from it; each write is a new file).
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        hit = self._cache.get(agent)
        if hit is None or hit[0] != key:
            hit = self._cache[agent] = (key, read_state(path)["current"])
        return hit[1]


_live: LiveVersions | None = None


def use_registry(registry: str | os.PathLike | Any | None) -> None:
    """Resolve the adapter version of responses that do not carry one (vLLM's) from this adapter
    registry: a root directory or an ``AdapterRegistry``; None stops it. Process-wide."""
    global _live
    if registry is None:
        _live = None
    else:  # (a Path has a ``root`` attribute too: "/")
        _live = LiveVersions(registry if isinstance(registry, (str, os.PathLike)) else registry.root)


def _registry_version(body: Any) -> int | None:
    """The live version of the requested adapter; None without a registry or on failure (counted)."""
    live = _live
    if live is None or not isinstance(body, dict) or not isinstance(model := body.get("model"), str):
        return None
    try:
        return live.get(model)
    except Exception as e:  # noqa: BLE001 - a broken registry must not break the app
        capture_error("openai.registry", e, current_episode())  # the episode records it too
        return None


def _stamped(response: dict | None, version: int | None) -> dict | None:
    if response is None or version is None:
        return response
    return {**response, REGISTRY_KEY: version}


# -- streams -------------------------------------------------------------------------------------


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

    def response(self) -> dict[str, Any]:
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


def _fold(acc: StreamAccumulator, chunk: Any) -> None:
    """Add one chunk; the first failure stops this stream's capture (the app still gets every chunk)."""
    if acc.failed:
        return
    try:
        acc.add(chunk)
    except Exception as e:  # noqa: BLE001 - capture must not break the stream
        acc.failed = True
        capture_error("openai.stream", e)


def _finish(acc: StreamAccumulator, deliver: Callable[[dict], None]) -> None:
    if acc.failed:
        return
    with guarded("openai.capture"):
        deliver(acc.response())


def _tap(source: Iterator, deliver: Callable[[dict], None]) -> Iterator:
    acc = StreamAccumulator()
    try:
        for chunk in source:
            _fold(acc, chunk)
            yield chunk
    finally:
        source.close()
    _finish(acc, deliver)


async def _atap(source: AsyncIterator, deliver: Callable[[dict], None]) -> AsyncIterator:
    acc = StreamAccumulator()
    try:
        async for chunk in source:
            _fold(acc, chunk)
            yield chunk
    finally:
        await source.aclose()
    _finish(acc, deliver)


# -- recording -----------------------------------------------------------------------------------


def _deliver(body: dict, response: dict | None, started: datetime) -> None:
    sink = RAW_SINK.get()
    if sink is not None and not sink.done:
        sink.request, sink.response = dict(body), response
        sink.started_at, sink.ended_at = started, utcnow()
        return
    if response is None:
        return
    fields = completion_fields(dict(body), response)
    if record_in_framework_task(fields, started):
        return
    rec = current_episode()
    if rec is None:
        return
    texts = [m.get("content") or "" for m in fields["observation"]["messages"]]
    rec.record_action(
        fields["policy"]["name"],
        depends_on=rec.producers_of(texts),
        started_at=started,
        **fields,
    )


def _handle(path: str | None, body: Any, extra: Any, result: Any, started: datetime, live: int | None) -> None:
    """Record the call; ``live``: the registry's version of the adapter when the request went out."""
    if path not in _PATHS or not isinstance(body, dict):
        return
    # ``extra_body`` (vLLM's top_k, return_token_ids, ...) travels apart and is merged into the JSON.
    body = {**body, **extra} if isinstance(extra, dict) else dict(body)
    if not body.get("stream"):
        _deliver(body, _stamped(_response_dict(result), live), started)
        return
    from openai import AsyncStream, Stream
    from openai._legacy_response import LegacyAPIResponse

    if isinstance(result, LegacyAPIResponse):  # with_raw_response: parse() caches, the app gets our Stream
        result = result.parse()
    # Swap the stream's iterator for a tap: the app keeps its Stream object and gets the same chunks.
    # The tap delivers in a copy of this context, where the episode/node/sink of the call are current.
    ctx = contextvars.copy_context()

    def deliver(response: dict) -> None:
        ctx.run(_deliver, body, _stamped(response, live), started)

    if isinstance(result, Stream):
        result._iterator = _tap(result._iterator, deliver)
    elif isinstance(result, AsyncStream):
        result._iterator = _atap(result._iterator, deliver)


def _active() -> bool:
    sink = RAW_SINK.get()
    if sink is not None and not sink.done:
        return True
    return current_episode() is not None or in_framework_task()


def _request_parts(options: Any) -> tuple[str | None, Any, Any]:
    return getattr(options, "url", None), getattr(options, "json_data", None), getattr(options, "extra_json", None)


def install() -> None:
    """Patch the openai client's ``request`` (sync and async). Idempotent.

    ``request`` is looked up on the client at call time, so clients built before this call are
    covered too (``post`` is bound into each resource when the client is built).
    """
    if _originals:
        return
    try:
        from openai._base_client import AsyncAPIClient, SyncAPIClient
    except ImportError:  # openai is optional
        return
    sync_request, async_request = SyncAPIClient.request, AsyncAPIClient.request

    def request(self: Any, cast_to: Any, options: Any, *args: Any, **kwargs: Any) -> Any:
        url, body, extra = _request_parts(options)
        if url not in _PATHS or not _active():
            return sync_request(self, cast_to, options, *args, **kwargs)
        started, live = utcnow(), _registry_version(body)
        result = sync_request(self, cast_to, options, *args, **kwargs)
        with guarded("openai.capture"):
            _handle(url, body, extra, result, started, live)
        return result

    async def arequest(self: Any, cast_to: Any, options: Any, *args: Any, **kwargs: Any) -> Any:
        url, body, extra = _request_parts(options)
        if url not in _PATHS or not _active():
            return await async_request(self, cast_to, options, *args, **kwargs)
        started, live = utcnow(), _registry_version(body)
        result = await async_request(self, cast_to, options, *args, **kwargs)
        with guarded("openai.capture"):
            _handle(url, body, extra, result, started, live)
        return result

    _originals["sync"], _originals["async"] = sync_request, async_request
    SyncAPIClient.request, AsyncAPIClient.request = request, arequest


def uninstall() -> None:
    """Restore the openai client's original methods."""
    if not _originals:
        return
    from openai._base_client import AsyncAPIClient, SyncAPIClient

    SyncAPIClient.request, AsyncAPIClient.request = _originals.pop("sync"), _originals.pop("async")


__all__ = ["RAW_SINK", "REGISTRY_KEY", "STREAM_KEY", "LiveVersions", "RawCall", "StreamAccumulator", "completion_fields",
           "install", "token_data", "uninstall", "use_registry"]
