"""Which adapter an action trains, and the registry-safe adapter name of an agent (path).

Shared by the trainer (which adapter a sample updates), ``marft train`` / ``marft sft``'s agent
selection, the service and ``marft adapters``. Only record attributes are read, so no record type is
imported (``schema`` re-exports these names).

The rule: an action's adapter is the model name its call sent (an app selects an adapter by model
name, vLLM-style) only when *our* adapter served it; otherwise it is its agent's. Two agents that both
called a hosted ``gpt-4.1-mini`` train two adapters, one per agent, never one named ``gpt-4.1-mini``.
A call was served by our adapter when the record says so — ``marft serve`` or the registry reported
the adapter's version (``policy.version``) — or when the caller knows the name as one of its adapters
(``ours``: a trainer's adapters, a registry's, the names a user gave). Token ids alone are no such
mark: a teacher served by vLLM returns them too, from its own tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

from .errors import MarftError
from .registry_state import AGENT_NAME as ADAPTER_NAME  # noqa: F401 - the registry's pattern, re-exported
from .registry_state import is_agent_name


class RecordedPolicy(Protocol):
    name: str
    version: int | None


class RecordedAction(Protocol):
    """What naming reads of ``schema.Action``."""

    agent: str
    kind: str
    policy: RecordedPolicy | None


class RecordedEpisode(Protocol):
    actions: Sequence[RecordedAction]


def agent_adapter_name(agent: str) -> str:
    """The registry-safe adapter name of an agent (path): ``supervisor/agent`` -> ``supervisor.agent``.

    Path segments are joined with ``.``; characters other than letters, digits, ``_``, ``-`` and
    ``.`` become ``_``; empty segments and leading punctuation are dropped. A name longer than 64
    characters keeps its first 55 and a hash of the whole, so distinct agents keep distinct names.
    """
    parts = [re.sub(r"[^A-Za-z0-9_.-]", "_", p).strip(".") for p in agent.split("/")]
    name = re.sub(r"\.{2,}", ".", ".".join(p for p in parts if p)).lstrip("._-") or "agent"
    if len(name) > 64:
        import hashlib

        name = name[:55].rstrip(".") + "-" + hashlib.sha256(agent.encode()).hexdigest()[:8]
    return name


def served_by_ours(action: RecordedAction, ours: Collection[str] = ()) -> bool:
    """Whether one of our adapters served ``action``: its model name is an adapter name, and the record
    carries an adapter version or ``ours`` holds the name."""
    policy = action.policy
    if policy is None or not is_agent_name(policy.name):
        return False
    return policy.name in ours or getattr(policy, "version", None) is not None


def hosted_model(action: RecordedAction, ours: Collection[str] = ()) -> str | None:
    """The model name of a call our adapters did not serve, when it is a name an adapter could have
    (``gpt-4.1-mini``; not a base model id like ``Qwen/Qwen2.5-0.5B``), else None."""
    policy = action.policy
    if policy is None or not is_agent_name(policy.name) or served_by_ours(action, ours):
        return None
    return policy.name


def adapter_name(action: RecordedAction, ours: Collection[str] = ()) -> str:
    """The adapter an action trains: the model name that served it when our adapter served it
    (``served_by_ours``), else its agent's registry-safe name (``agent_adapter_name``)."""
    if served_by_ours(action, ours):
        return action.policy.name  # type: ignore[union-attr] - served_by_ours checked it
    return agent_adapter_name(action.agent)


def adapters_by_agent(episodes: Iterable[RecordedEpisode], ours: Collection[str] = ()) -> dict[str, list[str]]:
    """Recorded agent -> the adapters its model calls (``llm`` actions) trained, in order of first use."""
    out: dict[str, list[str]] = {}
    for ep in episodes:
        for a in ep.actions:
            if a.kind == "llm":
                names = out.setdefault(a.agent, [])
                if (name := adapter_name(a, ours)) not in names:
                    names.append(name)
    return out


def hosted_models_by_agent(episodes: Iterable[RecordedEpisode], ours: Collection[str] = ()) -> dict[str, dict[str, int]]:
    """Recorded agent -> {model name: llm actions} of its calls that our adapters did not serve."""
    out: dict[str, dict[str, int]] = {}
    for ep in episodes:
        for a in ep.actions:
            if a.kind == "llm" and (model := hosted_model(a, ours)) is not None:
                counts = out.setdefault(a.agent, {})
                counts[model] = counts.get(model, 0) + 1
    return out


def resolve_adapters(names: list[str], known: dict[str, list[str]]) -> list[str]:
    """Adapter names for ``names``, each an adapter or an agent (path) of ``known`` (``adapters_by_agent``).

    An adapter name stays; an agent maps to the adapters its calls used (or its registry-safe name).
    Anything else raises MarftError listing the known adapters and agents.
    """
    adapters = list(dict.fromkeys(n for ns in known.values() for n in ns))
    out: list[str] = []
    for name in names:
        if name in adapters:
            out.append(name)
        elif name in known:
            out += known[name]
        elif agent_adapter_name(name) in adapters:
            out.append(agent_adapter_name(name))
        else:
            listing = ", ".join(f"{a} ({' '.join(known[a])})" if known[a] != [a] else a for a in known) or "none"
            raise MarftError(f"unknown agent or adapter {name!r}; the episodes have adapters "
                             f"{', '.join(adapters) or 'none'} (agent (adapters): {listing})")
    return list(dict.fromkeys(out))
