"""What values carry between a Pregel loop's tasks (precision tier; no LangGraph import): the parts of
a subgraph's input, a ``Send``'s packet, the values a task that ran subgraphs hands on, and a node
cache hit. ``st`` is ``precision``'s loop state (``loop``, ``run``, ``prov``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import provenance as pv
from .provenance import Task

PACKET_ITEMS = 64  # a longer list in a Send packet is data the sender built, not a wrapper


def output_keys(loop: Any) -> list[str]:
    keys = loop.output_keys
    return [keys] if isinstance(keys, str) else list(keys)


def key_provenance(parent: Task, sub_input: Any) -> dict[str, frozenset[str]] | None:
    """Per key of a subgraph's input, the provenance of that part of its parent task's input: the
    channels a node read, or for a ``Send`` the channels each value came from (else the sender).
    None when the graph runs on something else (a node that invokes a graph on its own input)."""
    if parent.reads is None:
        return None
    pst, task_input, chans = parent.reads
    if sub_input is not task_input or not isinstance(task_input, Mapping):
        return None
    if chans is not None:
        return {k: pst.prov.get(k, pv.EMPTY) for k in task_input}
    values = {c: ch.get() for c, ch in pst.loop.channels.items() if ch.is_available()}
    return {k: pv.value_provenance(v, values, pst.prov, parent.deps) for k, v in task_input.items()}


def packet_provenance(st: Any, packet: Any, values: dict[str, Any]) -> frozenset[str]:
    """What a ``Send``'s packet carries besides its sender's decision: the provenance of each value
    in it that a channel holds (``values``: the channels' values; by identity — a value the sender
    computed is its own output), looked for a few containers deep: ``create_agent`` sends each tool
    call as ``[ToolCallWithContext(tool_call=..., state=<the graph state>)]``, and a tool handed that
    state (``ToolRuntime``) reads those values."""
    out, todo = pv.EMPTY, [(packet, 0)]
    while todo:
        v, depth = todo.pop()
        hit = pv.value_provenance(v, values, st.prov, None)
        if hit is not None:
            out |= hit
        elif depth < 3 and isinstance(v, Mapping):
            todo.extend((x, depth + 1) for x in v.values())
        elif depth < 3 and isinstance(v, (list, tuple)) and len(v) <= PACKET_ITEMS:
            todo.extend((x, depth + 1) for x in v)
    return out


def cache_key(task: Any) -> tuple | None:
    """The node cache key of a task (``CachePolicy``), None for a node without a cache."""
    key = getattr(task, "cache_key", None)
    return (tuple(key.ns), key.key) if key is not None else None


def cache_hit(st: Any, key: tuple, t: Task) -> frozenset[str] | None:
    """A node cache hit (``CachePolicy``: LangGraph hands back the writes a run saved, the node does
    not run): what those writes carried when a run of this episode filled the cache (``key``:
    ``cache_key``). None: not a hit this episode saw filled."""
    if t.calls or t.actions or t.children or t.pushed:
        return None
    return st.run.cache.get(key)


def fill_cache(st: Any, key: tuple, out: frozenset[str]) -> None:
    st.run.cache[key] = out


def held_values(children: list[Any]) -> list[tuple[dict[str, Any], dict[str, frozenset[str]]]]:
    """Per subgraph a task ran: its channels' final values and their provenance; none when one of
    them handed off (a ParentCommand: what it handed back is not in its channels)."""
    if any(c.bubbled for c in children):
        return []
    return [({k: ch.get() for k, ch in c.loop.channels.items() if ch.is_available()}, c.prov) for c in children]


def returned_provenance(held: list[tuple[dict[str, Any], dict[str, frozenset[str]]]], value: Any,
                         fallback: frozenset[str]) -> frozenset[str]:
    """Where a value a task writes came from when the task ran subgraphs (one added as a node, or
    invoked by hand): the provenance of the subgraph channels holding that very object, else
    ``fallback`` (all the subgraphs handed back: a value the node computed from them, or a handoff)."""
    hits = [p for values, prov in held if (p := pv.value_provenance(value, values, prov, None)) is not None]
    return pv.EMPTY.union(*hits) if hits else fallback
