"""What a cross-process request carries: the caller's episode and call step in the request's
``_meta`` / metadata (``marft/caller``, and a W3C ``traceparent`` for OpenTelemetry), and the ids
derived from it."""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CALLER_KEY = "marft/caller"
# Request: "reply" (the caller can take the callee's half back in the reply); reply: the half.
HALF_KEY = "marft/half"
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


@dataclass(frozen=True)
class CallerRef:
    """Which action of which episode a request came from."""

    episode_id: str
    action_id: str | None = None
    step: int = 0


def trace_id(episode_id: str) -> str:
    """The W3C trace id of an episode (the id itself when it is 32 hex digits)."""
    return episode_id if _HEX32.match(episode_id) else hashlib.sha256(episode_id.encode()).hexdigest()[:32]


def span_id(action_id: str) -> str:
    """The W3C span id of a call step: the last 16 hex digits of a 32-hex id (the random ones: the
    recorder's ids start with the time), else a hash of the id."""
    return action_id[-16:] if _HEX32.match(action_id) else hashlib.sha256(action_id.encode()).hexdigest()[:16]


def inject(carrier: dict[str, Any], ref: CallerRef) -> None:
    """Write the caller's trace context into a ``_meta`` / metadata dict (in place).

    An existing ``traceparent`` (the app's own OpenTelemetry trace) is left as it is.
    """
    if ref.action_id is None:
        return
    carrier.setdefault("traceparent", f"00-{trace_id(ref.episode_id)}-{span_id(ref.action_id)}-01")
    carrier[CALLER_KEY] = f"{ref.episode_id} {ref.action_id} {ref.step}"


def extract(carrier: Mapping[str, Any] | None) -> CallerRef | None:
    """The caller a request names, or None. A bare W3C ``traceparent`` (a caller that marft_bridge
    does not capture) gives the episode id and no caller action."""
    if not carrier:
        return None
    raw = carrier.get(CALLER_KEY)
    if isinstance(raw, str):
        parts = raw.split(" ")
        if len(parts) == 3 and parts[0] and parts[1] and parts[2].isdigit():
            return CallerRef(parts[0], parts[1], int(parts[2]))
    tp = carrier.get("traceparent")
    if isinstance(tp, str):
        m = _TRACEPARENT.match(tp.strip().lower())
        if m and m.group(1) != "0" * 32:
            return CallerRef(m.group(1))
    return None


def conversation_episode_id(context_id: str) -> str:
    """A stable episode id for an A2A conversation that arrives without a caller."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"a2a-context:{context_id}").hex
