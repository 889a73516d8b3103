"""What callers hand the generation engine and what it hands back: requests, token events,
results, and the errors a request can meet."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ...errors import MarftError

MAX_SEED = 2**63 - 1  # the seed range vLLM and OpenAI accept
DEFAULT_MAX_QUEUED = 256  # requests waiting for a batch slot


class UnknownAdapter(MarftError):
    """A request named an adapter that is not loaded."""


class RequestError(MarftError):
    """A request the engine cannot serve as asked (too long, bad settings); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class QueueFull(MarftError):
    """The engine's queue of waiting requests is full (``max_queued``); try again shortly."""


class WorkerFault(MarftError):
    """The engine's worker failed while this request was in flight; the worker was restarted."""


@dataclass
class GenerationRequest:
    """One completion to generate. ``adapter`` None means the base model."""

    prompt_ids: list[int]
    adapter: str | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    top_logprobs: int = 0
    # Sampling only among these token ids (vLLM's ``allowed_token_ids``): every other token is masked
    # to -inf before temperature, top-k and top-p, so the reported log-probs are under the mask too.
    allowed_token_ids: list[int] | None = None
    # Called from the worker thread with ("start", (name, version)), ("token", TokenEvent),
    # ("done", GenerationResult) or ("error", exception).
    sink: Callable[[str, Any], None] | None = None
    # Set by ``AdapterEngine.cancel``: the request leaves the queue or the batch before the next step.
    cancelled: bool = field(default=False, init=False, repr=False)


@dataclass
class TokenEvent:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    text_delta: str


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: str  # "stop" or "length"
    adapter: str
    version: int | None
