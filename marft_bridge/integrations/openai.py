"""Capture from OpenAI-compatible clients (the ``openai`` package, and ``langchain_openai`` on top of it).

The hook sits on the ``openai`` client's ``request`` for ``/chat/completions`` and ``/responses``
(the Responses API, the OpenAI Agents SDK's default), so it sees the request body and the full
response JSON, including fields that ``langchain_openai.ChatOpenAI`` drops: vLLM's
``choices[].token_ids`` and ``prompt_token_ids`` (``return_token_ids``), the sampled tokens'
``logprobs``, and our server's top-level ``"adapter": {"name", "version"}``. Token ids and
log-probs are stored exactly (``token_source="server"``); without them the action keeps its text
and is marked for re-tokenisation (``token_source="retokenize"``). Messages, tools and outputs are
parsed by ``marft_bridge.messages``: a ``/responses`` request's ``instructions`` become the system
message, its input items messages (``function_call`` -> assistant ``tool_calls``,
``function_call_output`` -> tool message with ``tool_call_id``), its output items the output text
and tool calls; the offered ``tools`` and ``tool_choice`` go to the observation (chat shape).

Where a call lands:
- inside a LangChain chat-model call that the LangGraph capture is recording: the raw response is
  handed to that call (one action, with exact token data);
- inside a captured framework task (a LangGraph node, an OpenAI Agents SDK run: an active
  integration state's ``record_call``, see ``episode_context``): an action of that task's agent;
- inside ``marft_bridge.episode(...)``: an action whose agent is the model name (= adapter
  name), depending on every earlier action whose output its messages hold: output text, and by
  tool-call id the model call that emitted an assistant turn's tool call and the action a tool
  message answers (the tool step that ran call X when one was recorded, else the model call that
  emitted X; ``call_dependencies``).
Outside all of these the hook does nothing.

Which adapter version answered: our server says so in ``"adapter"``; vLLM does not. A response
without a version gets the live version of the requested model (the adapter name = registry
agent) from the registry of the episode it lands in (``EpisodeRecorder.registry``, set by
``episode(registry=...)`` / ``instrument(app, registry=...)``), else from the process-wide default
``use_registry(root)`` (for code that sets one registry for everything), read when the request goes
out (``marft_bridge.registry_state.LiveVersions``); ``metadata["adapter_version_source"]`` records
``"server"`` or ``"registry"``. The registry is read again when the response is complete: vLLM swaps
an adapter in place under requests in flight, so where another version went live meanwhile the
action keeps the version it went out with and says ``metadata["adapter_version_changed"] = True``
and ``metadata["adapter_version_end"]`` (its later tokens may come from that version).

Streams (``stream=True``; ``ChatOpenAI(streaming=True)``, ``.stream()``, ``Runner.run_streamed``)
are tapped: the app gets the very same chunk objects, while capture folds them into one response
of the non-streaming shape (chat chunks by ``StreamAccumulator``: ``delta``, ``token_ids``,
``logprobs.content``, ``prompt_token_ids``, ``adapter``, ``finish_reason``; Responses events by
``ResponsesStreamAccumulator``: the final ``response.completed`` event's response), delivered as
above when the stream ends, in the context of the call that opened it. A stream abandoned or failed
before its end records nothing.

``instrument(holder=None)`` / ``uninstrument(holder=None)`` hook and restore the client's
``request`` through ``integrations.hooks`` (pass-through ``wrapt`` wrappers, only on ``openai``
versions in ``SUPPORTED``; both idempotent): the hooks exist while any holder does
(``marft_bridge.episode``/``capture`` blocks while open, the LangGraph capture while an app is
instrumented, the app itself for ``instrument()``; ``OPENAI`` is the instrumentor). ``completion_fields(request,
response)`` / ``responses_fields(request, response)`` turn one request/response pair into the
keyword arguments of ``EpisodeRecorder.record_action``.
"""

from __future__ import annotations

import contextvars
import math
import os
from datetime import datetime
from typing import Any

from .. import messages as msgs
from ..capture_errors import capture_error, guarded
from ..episode_context import CaptureState, Instrumentor, current_episode, in_framework_task, record_in_framework_task
from ..registry_state import LiveVersions, live_versions
from ..schema import utcnow
from .hooks import Hooks
from .openai_streams import STREAM_KEY, ResponsesStreamAccumulator, StreamAccumulator, atap, tap

CHAT_PATH, RESPONSES_PATH = "/chat/completions", "/responses"
_PATHS = (CHAT_PATH, RESPONSES_PATH)
# Keys the hook adds to a response: the registry's live version of the requested adapter when the
# request went out, and when its response was complete (only where the two differ).
REGISTRY_KEY = "marft_registry_version"
REGISTRY_END_KEY = "marft_registry_version_end"


class RawCall:
    """The request and response of one OpenAI-API call, filled in by the client hook."""

    __slots__ = ("request", "response", "started_at", "ended_at", "done", "path")

    def __init__(self) -> None:
        self.request: dict | None = None
        self.response: dict | None = None
        self.started_at: datetime | None = None
        self.ended_at: datetime | None = None
        self.done = False
        self.path: str | None = None


# Set by the LangGraph capture while a LangChain chat-model call runs: the hook fills it (per call
# context, like every context variable of the capture).
RAW_SINK: contextvars.ContextVar[RawCall | None] = contextvars.ContextVar("marft_raw_sink", default=None)
# openai versions the ``request`` hook was checked against: [low, high).
SUPPORTED = ((1, 40), (4, 0))


# -- parsing -------------------------------------------------------------------------------------

_text = msgs.content_text  # kept for the LangGraph integration until it calls marft_bridge.messages


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
    if lps and not (math.isfinite(sum(lps)) and max(lps) <= 1e-4):  # the record model's rule
        return None, None, "log-probs not finite or above 0: token data kept out, the text recorded"
    return ids, (lps if ids is not None else None), None


def _observation(messages: list[dict], request: dict, prompt_ids: Any, metadata: dict) -> dict[str, Any]:
    other: list[str] = []
    obs: dict[str, Any] = {"messages": messages, "tools": msgs.chat_tools(request.get("tools"), other),
                           "tool_choice": msgs.chat_tool_choice(request.get("tool_choice")),
                           "prompt_token_ids": list(prompt_ids) if prompt_ids is not None else None}
    if other:  # built-in tools (web search, ...) are not function tools: named, not in ``tools``
        metadata["other_tools"] = other
    return obs


def _policy_and_meta(request: dict, response: dict) -> tuple[dict, dict]:
    adapter = response.get("adapter") if isinstance(response.get("adapter"), dict) else {}
    model = str(adapter.get("name") or request.get("model") or response.get("model") or "unknown")
    version, source = adapter.get("version"), "server"  # the server's word wins over the registry's
    if version is None and response.get(REGISTRY_KEY) is not None:
        version, source = response[REGISTRY_KEY], "registry"
    metadata: dict[str, Any] = {"response_model": response.get("model"), "response_id": response.get("id"),
                                "adapter_version_source": source if version is not None else None}
    if source == "registry" and response.get(REGISTRY_END_KEY) is not None:
        metadata["adapter_version_changed"], metadata["adapter_version_end"] = True, response[REGISTRY_END_KEY]
    return {"name": model, "version": version}, metadata


def _sampling(request: dict, names: dict[str, tuple[str, ...]]) -> dict[str, Any] | None:
    """Sampling parameters from the request (``extra_body`` holds vLLM's, e.g. ``top_k``); per field
    the first of its request keys that is set."""
    extra = request.get("extra_body") or {}
    out = {}
    for field, keys in names.items():
        v = next((x for x in (request.get(k, extra.get(k)) for k in keys) if x is not None), None)
        if v is not None:
            out[field] = [v] if field == "stop" and isinstance(v, str) else v
    return out or None


_CHAT_SAMPLING = {"temperature": ("temperature",), "top_p": ("top_p",), "top_k": ("top_k",),
                  "max_tokens": ("max_completion_tokens", "max_tokens"), "seed": ("seed",), "stop": ("stop",),
                  "allowed_token_ids": ("allowed_token_ids",)}
_RESPONSES_SAMPLING = {"temperature": ("temperature",), "top_p": ("top_p",), "top_k": ("top_k",),
                       "max_tokens": ("max_output_tokens",), "seed": ("seed",)}


def completion_fields(request: dict, response: dict) -> dict[str, Any]:
    """``record_action`` keyword arguments for one chat-completions request/response pair."""
    choice = (response.get("choices") or [{}])[0]
    ids, lps, problem = token_data(choice.get("logprobs"), choice.get("token_ids"))
    stream = response.get(STREAM_KEY) if isinstance(response.get(STREAM_KEY), dict) else None
    if problem is None and stream and stream.get("token_data_dropped"):  # misaligned chunks, equal totals
        ids, lps, problem = None, None, stream["token_data_dropped"]
    policy, metadata = _policy_and_meta(request, response)
    if problem:
        metadata["token_data_dropped"] = problem
    if stream:
        metadata["stream_chunks"] = stream.get("chunks")
    prompt_ids = response.get("prompt_token_ids") or choice.get("prompt_token_ids")
    messages = [msgs.chat_message(m) for m in request.get("messages") or [] if isinstance(m, dict)]
    return {
        "observation": _observation(messages, request, prompt_ids, metadata),
        "output": {**msgs.chat_output(response), "token_ids": ids, "logprobs": lps},
        "sampling": _sampling(request, _CHAT_SAMPLING),
        "policy": policy,
        "token_source": "server" if ids is not None else "retokenize",
        "metadata": {k: v for k, v in metadata.items() if v is not None},
    }


def responses_fields(request: dict, response: dict) -> dict[str, Any]:
    """``record_action`` keyword arguments for one ``/responses`` request/response pair.

    Token ids and log-probs come from the output text parts' ``logprobs`` when the server names
    the tokens by id (``"token_id:N"``); otherwise the action is re-tokenised. Input/output items that are neither messages nor function calls (reasoning is skipped) are
    kept as text and listed in ``metadata["unknown_items"]``.
    """
    unknown: list[str] = []
    messages = msgs.responses_messages(request.get("instructions"), request.get("input"), unknown)
    output = msgs.responses_output(response, unknown)
    policy, metadata = _policy_and_meta(request, response)
    # include=["message.output_text.logprobs"]: per-token log-probs on the output text parts; token
    # ids only where the server names them ("token_id:N", vLLM's return_tokens_as_token_ids)
    lps = [lp for item in response.get("output") or () if isinstance(item, dict) and item.get("type") == "message"
           for part in item.get("content") or () if isinstance(part, dict) for lp in part.get("logprobs") or ()]
    ids, lps, problem = token_data({"content": lps}, None) if lps else (None, None, None)
    if problem:
        metadata["token_data_dropped"] = problem
    stream = response.get(STREAM_KEY) if isinstance(response.get(STREAM_KEY), dict) else None
    if stream:
        metadata["stream_chunks"] = stream.get("chunks")
    if isinstance(response.get("usage"), dict):
        metadata["usage"] = {k: v for k, v in response["usage"].items() if isinstance(v, int)}
    if unknown:
        metadata["unknown_items"] = unknown
    if request.get("previous_response_id"):  # the server holds the earlier turns: the observation lacks them
        metadata["previous_response_id"] = request["previous_response_id"]
    return {
        "observation": _observation(messages, request, None, metadata),
        "output": {**output, "token_ids": ids, "logprobs": lps},
        "sampling": _sampling(request, _RESPONSES_SAMPLING),
        "policy": policy,
        "token_source": "server" if ids is not None else "retokenize",
        "metadata": {k: v for k, v in metadata.items() if v is not None},
    }


def call_fields(path: str | None, request: dict, response: dict) -> dict[str, Any]:
    """The fields of one call to ``path`` (chat completions unless it is ``/responses``)."""
    return responses_fields(request, response) if path == RESPONSES_PATH else completion_fields(request, response)


def _response_dict(result: Any) -> dict | None:
    if hasattr(result, "parse") and hasattr(result, "http_response"):  # with_raw_response
        result = result.parse()
    if hasattr(result, "model_dump"):  # quiet: a parse() result's typed field warns when dumped
        return result.model_dump(mode="json", warnings=False)
    return result if isinstance(result, dict) else None


# -- dependencies by tool-call id ----------------------------------------------------------------


class _CallIndex:
    """Per episode: which action emitted each tool call id, and what each stored response depended on
    (which tool step ran a call the recorder knows: ``EpisodeRecorder.tool_step_of``)."""

    def __init__(self) -> None:
        self.emitted: dict[str, str] = {}
        # Responses API: response id -> (the action, what it depended on), for a call continuing it
        self.responses: dict[str, tuple[str, list[str]]] = {}


_INDEX_KEY = "openai.calls"  # the recorder's ``integration_data`` key


def _index(rec: Any) -> _CallIndex:
    data = rec.integration_data
    idx = data.get(_INDEX_KEY)
    if idx is None:
        idx = data.setdefault(_INDEX_KEY, _CallIndex())  # setdefault: one index if two threads race
    return idx


def note_tool_calls(rec: Any, action_id: str, calls: Any) -> None:
    """Remember that ``action_id`` (a model call of episode ``rec``) emitted these tool calls."""
    idx = _index(rec)
    for c in calls or ():
        if isinstance(c, dict) and c.get("id"):
            idx.emitted.setdefault(str(c["id"]), action_id)


def emitter_of(rec: Any, call_id: str) -> str | None:
    """The model call that emitted tool call ``call_id`` in episode ``rec``."""
    return _index(rec).emitted.get(str(call_id))


def call_dependencies(rec: Any, messages: list[dict]) -> list[str]:
    """Actions a conversation depends on through tool-call ids: for an assistant turn's tool call,
    the model call that emitted it (its message is in the input); for a tool result, the tool step
    that ran it when one was recorded, else the model call that emitted it."""
    idx = _index(rec)
    out = []
    for m in messages:
        cid = m.get("tool_call_id")
        if cid:  # the tool step that ran it (any capture's: SDK, MCP, ...), else the asking call
            aid = rec.tool_step_of(str(cid)) or idx.emitted.get(str(cid))
            if aid is not None:
                out.append(aid)
        for c in m.get("tool_calls") or ():
            aid = idx.emitted.get(str(c.get("id"))) if isinstance(c, dict) and c.get("id") else None
            if aid is not None:
                out.append(aid)
    return list(dict.fromkeys(out))


def message_dependencies(rec: Any, messages: list[dict]) -> list[str]:
    """Message flow (earlier output text in these messages) plus tool-call ids."""
    texts = [m.get("content") or "" for m in messages]
    return list(dict.fromkeys([*rec.producers_of(texts), *call_dependencies(rec, messages)]))


def call_inputs(rec: Any, fields: dict[str, Any]) -> list[str]:
    """What a recorded call depends on: its messages' (``message_dependencies``) and, for a Responses
    call that continues a stored one (``previous_response_id``: the server holds the earlier turns,
    the request does not), that call and what it depended on."""
    deps = message_dependencies(rec, fields["observation"]["messages"])
    prev = (fields.get("metadata") or {}).get("previous_response_id")
    earlier = _index(rec).responses.get(str(prev)) if prev else None
    return list(dict.fromkeys([*earlier[1], earlier[0], *deps])) if earlier else deps


def note_response(rec: Any, action_id: str, fields: dict[str, Any], deps: list[str]) -> None:
    """Remember the response id of a recorded call and what it depended on (``call_inputs``)."""
    rid = (fields.get("metadata") or {}).get("response_id")
    if rid:
        _index(rec).responses[str(rid)] = (action_id, list(deps))


# -- adapter version from the registry -----------------------------------------------------------

# The process-wide default the user sets (``use_registry``): a setting, kept while no hook is.
_default_live: Any = None


def use_registry(registry: str | os.PathLike | Any | None) -> None:
    """Process-wide default registry for responses that carry no adapter version (vLLM's), used where
    the episode names none (``episode(registry=...)`` / ``instrument(app, registry=...)`` do, per
    app): a root directory, an ``AdapterRegistry`` or an object with ``live_version(agent)``; None
    clears it."""
    global _default_live
    _default_live = live_versions(registry)


def _registry_version(body: Any) -> int | None:
    """The live version of the requested adapter; None without a registry or on failure (counted)."""
    if not isinstance(body, dict) or not isinstance(model := body.get("model"), str):
        return None
    rec = current_episode()
    live = _default_live
    try:
        own = getattr(rec, "registry", None) if rec is not None else None
        if own is not None:
            live = live_versions(own)
        return live.live_version(model) if live is not None else None
    except Exception as e:  # noqa: BLE001 - a broken registry must not break the app
        capture_error("openai.registry", e, rec)  # the episode records it too
        return None


def _stamped(response: dict | None, version: int | None, body: Any) -> dict | None:
    """The response with the registry's version at its start, and at its end where that differs."""
    if response is None or version is None:
        return response
    out = {**response, REGISTRY_KEY: version}
    end = _registry_version(body)
    if end is not None and end != version:
        out[REGISTRY_END_KEY] = end
    return out


# -- recording -----------------------------------------------------------------------------------


def _deliver(path: str, body: dict, response: dict | None, started: datetime) -> None:
    sink = RAW_SINK.get()
    if sink is not None and not sink.done:
        sink.request, sink.response, sink.path = dict(body), response, path
        sink.started_at, sink.ended_at = started, utcnow()
        return
    if response is None:
        return
    fields = call_fields(path, dict(body), response)
    if record_in_framework_task(fields, started):
        return
    rec = current_episode()
    if rec is None:
        return
    deps = call_inputs(rec, fields)
    aid = rec.record_action(fields["policy"]["name"], depends_on=deps, started_at=started, **fields)
    note_tool_calls(rec, aid, fields["output"].get("tool_calls"))
    note_response(rec, aid, fields, deps)


def _handle(path: str | None, body: Any, extra: Any, result: Any, started: datetime, live: int | None) -> None:
    """Record the call; ``live``: the registry's version of the adapter when the request went out."""
    if path not in _PATHS or not isinstance(body, dict):
        return
    # ``extra_body`` (vLLM's top_k, return_token_ids, ...) travels apart and is merged into the JSON.
    body = {**body, **extra} if isinstance(extra, dict) else dict(body)
    if not body.get("stream"):
        _deliver(path, body, _stamped(_response_dict(result), live, body), started)
        return
    from openai import AsyncStream, Stream
    from openai._legacy_response import LegacyAPIResponse

    from openai._response import APIResponse

    if isinstance(result, (LegacyAPIResponse, APIResponse)):  # raw responses: parse() caches, the app gets our Stream
        result = result.parse()
    # Swap the stream's iterator for a tap: the app keeps its Stream object and gets the same chunks.
    # The tap delivers in a copy of this context, where the episode/node/sink of the call are current.
    ctx = contextvars.copy_context()
    acc = ResponsesStreamAccumulator() if path == RESPONSES_PATH else StreamAccumulator()

    def deliver(response: dict) -> None:
        ctx.run(lambda: _deliver(path, body, _stamped(response, live, body), started))

    if isinstance(result, Stream):
        result._iterator = tap(result._iterator, acc, deliver)
    elif isinstance(result, AsyncStream):
        result._iterator = atap(result._iterator, acc, deliver)


def _active() -> bool:
    sink = RAW_SINK.get()
    if sink is not None and not sink.done:
        return True
    return current_episode() is not None or in_framework_task()


async def _parsed(result: Any) -> Any:
    """An ``AsyncAPIResponse`` (``with_raw_response`` / ``with_streaming_response`` on the async
    client, as the Agents SDK streams) parsed; ``parse()`` caches, so the app later gets this very
    object (a stream: the one we tap)."""
    from openai._response import AsyncAPIResponse

    return await result.parse() if isinstance(result, AsyncAPIResponse) else result


def _request_parts(options: Any) -> tuple[str | None, Any, Any]:
    return getattr(options, "url", None), getattr(options, "json_data", None), getattr(options, "extra_json", None)


def _request(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    options = args[1] if len(args) > 1 else kwargs.get("options")
    url, body, extra = _request_parts(options)
    if url not in _PATHS or not _active():
        return wrapped(*args, **kwargs)
    started, live = utcnow(), _registry_version(body)
    result = wrapped(*args, **kwargs)
    with guarded("openai.capture"):
        _handle(url, body, extra, result, started, live)
    return result


async def _arequest(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    options = args[1] if len(args) > 1 else kwargs.get("options")
    url, body, extra = _request_parts(options)
    if url not in _PATHS or not _active():
        return await wrapped(*args, **kwargs)
    started, live = utcnow(), _registry_version(body)
    result = await wrapped(*args, **kwargs)
    with guarded("openai.capture"):
        _handle(url, body, extra, await _parsed(result), started, live)
    return result


def _targets() -> list:
    # ``request`` is looked up on the client at call time, so clients built before the hook are
    # covered too (``post`` is bound into each resource when the client is built).
    from openai._base_client import AsyncAPIClient, SyncAPIClient

    return [(SyncAPIClient, "request", _request), (AsyncAPIClient, "request", _arequest)]


class OpenAIState(CaptureState):
    """What the client capture keeps while instrumented: its hooks on ``request``."""

    def __init__(self) -> None:
        self.hooks = Hooks("openai", SUPPORTED, _targets, "the openai client's calls are not captured")

    def start(self) -> None:
        import importlib.util

        if importlib.util.find_spec("openai") is not None:  # optional: without it there is nothing to hook
            self.hooks.install()

    def stop(self) -> None:
        self.hooks.uninstall()


OPENAI = Instrumentor(OpenAIState)


def instrument(holder: Any = None) -> bool:
    """Hook the openai client's ``request`` (sync and async) for ``holder`` (None: the process);
    idempotent; False when ``openai`` is missing or outside ``SUPPORTED``."""
    return OPENAI.instrument(holder).hooks.installed


def uninstrument(holder: Any = None) -> None:
    """Drop ``holder``; with the last one the client's original methods are back."""
    OPENAI.uninstrument(holder)


def instrumented() -> bool:
    state = OPENAI.state
    return state is not None and state.hooks.installed


__all__ = ["CHAT_PATH", "OPENAI", "RAW_SINK", "REGISTRY_KEY", "RESPONSES_PATH", "STREAM_KEY", "SUPPORTED",
           "LiveVersions", "RawCall", "ResponsesStreamAccumulator", "StreamAccumulator", "call_dependencies",
           "call_fields", "call_inputs", "completion_fields", "emitter_of", "instrument", "instrumented",
           "message_dependencies", "note_response", "note_tool_calls", "responses_fields", "token_data",
           "uninstrument", "use_registry"]
