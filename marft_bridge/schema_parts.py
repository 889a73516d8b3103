"""The parts of a Flex-POMDP record (``schema.py`` holds Action, Reward and Episode): chat messages,
observations, outputs, sampling parameters and policies, the base model every record shares, its
field bounds, and the record-limits plumbing of validation (``limits.RecordLimits`` passed as
validation context, ``STORED`` to skip it). ``marft_bridge.schema`` re-exports every name here.
"""

from __future__ import annotations

import functools
import math
import uuid
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .limits import RecordLimits, default_limits, first_over_limits

# Limits that keep one runaway record from filling the store ("oversized fields"); the depth and
# size of free-form JSON (task, metadata, tool calls) are RecordLimits (limits.py), checked below.
MAX_TEXT_CHARS = 2_000_000
MAX_TOKENS = 262_144
MAX_NAME_CHARS = 256
MAX_ACTIONS = 100_000
MAX_REWARDS = 100_000

ActionKind = Literal["llm", "tool", "message", "env"]
EpisodeStatus = Literal["running", "completed", "failed"]
TokenSource = Literal["server", "retokenize"]

Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS)]


def new_id() -> str:
    return uuid.uuid4().hex


# datetime.now(timezone.utc) without a Python frame of ours: capture takes several timestamps per call.
utcnow = functools.partial(datetime.now, timezone.utc)


def invariant(field: str, reason: str) -> PydanticCustomError:
    return PydanticCustomError("invariant", "{field}: {reason}", {"field": field, "reason": reason})


# Validation context of records the store already holds: they were checked against the limits
# when written (a later, lower limit must not make them unreadable), so reads skip that check.
STORED = {"limits": None}


def context_limits(info: ValidationInfo) -> RecordLimits | None:
    """The limits a validation checks free-form fields against: the context's, else the defaults."""
    ctx = info.context
    return ctx["limits"] if isinstance(ctx, dict) and "limits" in ctx else default_limits()


def check_within(limits: RecordLimits, fields: list[tuple[str, Any]]) -> None:
    if found := first_over_limits(fields, limits):
        raise invariant(*found)


class RecordModel(BaseModel):
    # Unknown fields are refused rather than dropped: a typo must not silently lose data.
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


class Message(RecordModel):
    """One chat message of an observation (OpenAI shape)."""

    role: str = Field(min_length=1, max_length=64)
    content: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    name: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = Field(default=None, max_length=MAX_NAME_CHARS)


class Observation(RecordModel):
    """What the agent saw: chat messages, the tools it was offered and, when the server reported
    them, the prompt token ids.

    ``tools`` are OpenAI function tools (``{"type": "function", "function": {"name", "description",
    "parameters"}}``), the chat template renders them into the prompt; ``tool_choice`` is the
    request's (``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function", "function": {"name"}}``).
    """

    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    prompt: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)  # completions-API prompt
    prompt_token_ids: list[int] | None = Field(default=None, max_length=MAX_TOKENS)

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for k, tool in enumerate(v or ()):
            if tool.get("type") != "function":
                raise invariant(f"{k}.type", f"a tool must have type 'function', not {tool.get('type')!r}")
            fn = tool.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str) or not name:
                raise invariant(f"{k}.function.name", "a function tool needs a name (function.name)")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _short_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, str) and not 0 < len(v) <= 64:
            raise ValueError("tool_choice must be 1-64 characters (auto, none, required) or a dict")
        return v


class Output(RecordModel):
    """What the agent produced. ``logprobs[i]`` is the behaviour log-prob of ``token_ids[i]``."""

    text: str = Field(default="", max_length=MAX_TEXT_CHARS)
    token_ids: list[int] | None = Field(default=None, max_length=MAX_TOKENS)
    logprobs: list[float] | None = Field(default=None, max_length=MAX_TOKENS)
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str | None = Field(default=None, max_length=64)

    @field_validator("token_ids")
    @classmethod
    def _non_negative_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and min(v) < 0:
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("logprobs")
    @classmethod
    def _finite_logprobs(cls, v: list[float] | None) -> list[float] | None:
        # Non-finite behaviour log-probs silently poison PPO ratios (see notes/PEERS.md #6).
        # C-level scans first (this runs for every stored action); the loop only names the culprit.
        # A nan or inf anywhere makes the sum non-finite (a sum that merely overflows sends finite
        # values to the loop, which then finds nothing).
        if v and not (math.isfinite(sum(v)) and max(v) <= 1e-4):
            for i, x in enumerate(v):
                if not math.isfinite(x):
                    raise ValueError(f"log-prob {i} is {x}; log-probs must be finite")
                if x > 1e-4:
                    raise ValueError(f"log-prob {i} is {x} > 0; a log-probability is at most 0")
        return v

    @model_validator(mode="after")
    def _lengths_match(self) -> Output:
        if self.token_ids is not None and self.logprobs is not None and len(self.token_ids) != len(self.logprobs):
            raise PydanticCustomError(
                "invariant",
                "{field}: {reason}",
                {"field": "logprobs", "reason": f"{len(self.logprobs)} log-probs for {len(self.token_ids)} token ids"},
            )
        return self


class SamplingParams(RecordModel):
    """The sampling parameters actually used; the trainer recomputes log-probs under them."""

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    max_tokens: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: list[str] | None = None
    # True when the server's log-probs are after temperature/top-k/top-p (vLLM processed_logprobs).
    logprobs_processed: bool | None = None
    # vLLM's allowed_token_ids: every token was sampled from this set (the trainer masks its log-probs alike).
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1,
                                                                        max_length=MAX_TOKENS)


class Policy(RecordModel):
    """The adapter that produced an action (the model name is the adapter name, vLLM-style)."""

    name: Name
    version: int | None = Field(default=None, ge=0)
    base_model: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
