"""One OpenAI-API request/response pair as record fields (chat completions and ``/responses``), and
the raw call the LangGraph capture hands the client hook."""

from __future__ import annotations

import contextvars
import math
from datetime import datetime
from typing import Any

from ...capture import messages as msgs
from .streams import STREAM_KEY

CHAT_PATH, RESPONSES_PATH = "/chat/completions", "/responses"
PATHS = (CHAT_PATH, RESPONSES_PATH)
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


# -- parsing -------------------------------------------------------------------------------------

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


def response_dict(result: Any) -> dict | None:
    if hasattr(result, "parse") and hasattr(result, "http_response"):  # with_raw_response
        result = result.parse()
    if hasattr(result, "model_dump"):  # quiet: a parse() result's typed field warns when dumped
        return result.model_dump(mode="json", warnings=False)
    return result if isinstance(result, dict) else None
