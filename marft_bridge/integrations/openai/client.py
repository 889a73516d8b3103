"""Capture from OpenAI-compatible clients (the ``openai`` package, and ``langchain_openai`` on top of it).

The hook sits on the ``openai`` client's ``request`` for ``/chat/completions`` and ``/responses``
(the Responses API, the OpenAI Agents SDK's default), so it sees the request body and the full
response JSON, including fields that ``langchain_openai.ChatOpenAI`` drops: vLLM's
``choices[].token_ids`` and ``prompt_token_ids`` (``return_token_ids``), the sampled tokens'
``logprobs``, and our server's top-level ``"adapter": {"name", "version"}``. Token ids and
log-probs are stored exactly (``token_source="server"``); without them the action keeps its text
and is marked for re-tokenisation (``token_source="retokenize"``). Messages, tools and outputs are
parsed by ``marft_bridge.capture.messages``: a ``/responses`` request's ``instructions`` become the system
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
out (``marft_bridge.registry_state.RegistryStateReader``); ``metadata["adapter_version_source"]`` records
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
from datetime import datetime
from typing import Any

from ...capture_errors import capture_error, guarded
from ...capture.episode_context import CaptureState, Instrumentor, current_episode, in_framework_task, record_in_framework_task
from ...registry_state import live_versions
from ...schema import utcnow
from ...seams import RegistryRef
from ..hooks import Hooks
from .calls import call_inputs, note_response, note_tool_calls
from .fields import PATHS, RAW_SINK, REGISTRY_END_KEY, REGISTRY_KEY, RESPONSES_PATH, call_fields, response_dict
from .streams import ResponsesStreamAccumulator, StreamAccumulator, tapped
from .. import checked_range

# openai versions the ``request`` hook was checked against: [low, high).
SUPPORTED = checked_range("openai")  # the range in integrations.INTEGRATIONS


# -- adapter version from the registry -----------------------------------------------------------

# The process-wide default the user sets (``use_registry``): a setting, kept while no hook is.
_default_live: Any = None


def use_registry(registry: RegistryRef | None) -> None:
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


def _handle(path: str | None, body: Any, extra: Any, result: Any, started: datetime, live: int | None,
            parsed: Any = None) -> Any:
    """Record the call; returns what the app gets: ``result``, or for a stream the same stream behind
    a tapping proxy (``streams.tapped``). ``live``: the registry's version of the adapter when the
    request went out; ``parsed``: an async raw response already parsed."""
    if path not in PATHS or not isinstance(body, dict):
        return result
    # ``extra_body`` (vLLM's top_k, return_token_ids, ...) travels apart and is merged into the JSON.
    body = {**body, **extra} if isinstance(extra, dict) else dict(body)
    if not body.get("stream"):
        _deliver(path, body, _stamped(response_dict(result if parsed is None else parsed), live, body), started)
        return result
    from openai._legacy_response import LegacyAPIResponse
    from openai._response import APIResponse

    stream = parsed
    if stream is None:  # raw responses: parse() caches the stream the proxy stands for
        stream = result.parse() if isinstance(result, (LegacyAPIResponse, APIResponse)) else result
    # The tap delivers in a copy of this context, where the episode/node/sink of the call are current.
    ctx = contextvars.copy_context()
    acc = ResponsesStreamAccumulator() if path == RESPONSES_PATH else StreamAccumulator()

    def deliver(response: dict) -> None:
        ctx.run(lambda: _deliver(path, body, _stamped(response, live, body), started))

    return tapped(result, stream, acc, deliver)


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
    if url not in PATHS or not _active():
        return wrapped(*args, **kwargs)
    from ...capture.routing import route

    with guarded("openai.routing"):  # a canary episode's calls go to its release's served names
        routed = route(body, current_episode(), _default_live)
        if routed is not None:
            options.json_data = routed  # sent; ``body`` (the app's model name) is what is recorded
    started, live = utcnow(), _registry_version(body)
    result = wrapped(*args, **kwargs)
    with guarded("openai.capture"):
        return _handle(url, body, extra, result, started, live)
    return result


async def _arequest(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    options = args[1] if len(args) > 1 else kwargs.get("options")
    url, body, extra = _request_parts(options)
    if url not in PATHS or not _active():
        return await wrapped(*args, **kwargs)
    from ...capture.routing import route

    with guarded("openai.routing"):  # as in ``_request``
        routed = route(body, current_episode(), _default_live)
        if routed is not None:
            options.json_data = routed
    started, live = utcnow(), _registry_version(body)
    result = await wrapped(*args, **kwargs)
    with guarded("openai.capture"):
        return _handle(url, body, extra, result, started, live, parsed=await _parsed(result))
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
