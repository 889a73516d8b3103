"""Which adapter an action trains, and the registry-safe adapter name of an agent (path).

Shared by the trainer (which adapter a sample updates), ``marft train``'s agent selection, the
service and ``marft adapters``. Only record attributes are read, so no record type is imported
(``schema`` re-exports these names).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Protocol

from .errors import MarftError
from .registry_state import AGENT_NAME as ADAPTER_NAME  # noqa: F401 - the registry's pattern, re-exported
from .registry_state import is_agent_name


class RecordedPolicy(Protocol):
    name: str


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


def adapter_name(action: RecordedAction) -> str:
    """The adapter an action trains: the one that served it.

    That is ``action.policy.name``, the model name the call sent (an app selects an adapter by model
    name, vLLM-style), when it is an adapter name (a base model id like ``Qwen/Qwen2.5-0.5B`` is
    not); else the agent's registry-safe name (``agent_adapter_name``).
    """
    name = action.policy.name if action.policy is not None else None
    if name and is_agent_name(name):
        return name
    return agent_adapter_name(action.agent)


def adapters_by_agent(episodes: Iterable[RecordedEpisode]) -> dict[str, list[str]]:
    """Recorded agent -> the adapters its model calls (``llm`` actions) trained, in order of first use."""
    out: dict[str, list[str]] = {}
    for ep in episodes:
        for a in ep.actions:
            if a.kind == "llm":
                names = out.setdefault(a.agent, [])
                if (name := adapter_name(a)) not in names:
                    names.append(name)
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
