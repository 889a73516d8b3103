"""Which recorded actions reached which task's input: the dependency rules, as pure code.

No LangGraph import: the precision tier (``precision.py``) reads the loop and calls these with
plain values (channel names, writes, versions), so the rules are unit-tested on their own.

Provenance of a channel = the ids of the actions whose output its current value came from.
- A task depends on the provenance of the channels its node reads and of its triggers.
- A write to an accumulating channel adds the writer's provenance; a write to a replace channel
  replaces it (two writes to one channel in one step both count: the reducer saw both).
- A cleared channel (no value after the step) loses its provenance.
- On a checkpointed thread, a replace channel written outside the captured runs since (its
  version moved) loses its old provenance; an accumulating one still holds what was written.

``Task`` is one node execution (or functional-API ``@task`` call); ``seen(t)`` is what its next
action starts from and ``result(t)`` what it hands back to its caller.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from itertools import filterfalse, repeat
from typing import Any

from ...schema import utcnow

Provenance = frozenset  # of action ids
EMPTY: frozenset[str] = frozenset()


class Task:
    """One task of a captured run: agent, step, inputs' provenance and the actions it recorded."""

    __slots__ = ("id", "run", "agent", "node", "step", "lg_steps", "ns", "deps", "actions", "children", "internal",
                 "calls", "started", "pushed", "pusher", "received", "reads", "attempt", "handed", "state_tools",
                 "state_deps", "graph_name")

    def __init__(self, id: str, run: Any, agent: str, node: str, step: int | None, lg_steps: list[int], ns: str,
                 deps: frozenset[str], internal: bool = False):
        self.id = id
        self.run = run
        self.agent = agent
        self.node = node
        self.step = step
        self.lg_steps = lg_steps
        self.ns = ns
        self.deps = deps
        self.actions: list[str] = []
        self.children: list[Any] = []  # loop states of subgraphs it ran (``output_provenance()``)
        self.internal = internal
        self.calls = 0  # model/tool calls seen, recorded or not
        self.started: datetime = utcnow()
        self.pushed: list[Task] = []  # functional-API tasks this task started (``@task`` calls)
        self.pusher: Task | None = None
        self.received: set[Task] = set()  # those of them whose result it has read
        # What its input was made of, for a subgraph it runs (``key_provenance``): (the loop state
        # that scheduled it, its input, the channels it read or None for a ``Send``).
        self.reads: tuple[Any, Any, Any] | None = None
        self.attempt = 1  # LangGraph's node attempt its actions are of (a RetryPolicy runs a node again)
        # What its tool steps returned (a ToolMessage, a Command's update values): id -> (value, the
        # actions that made it), so each value it writes carries those (``written``). None: no tool step.
        self.handed: dict[int, tuple[Any, frozenset[str]]] | None = None
        # The tools of its node (a tool node) that are handed graph state (``tools.state_readers``).
        self.state_tools: frozenset[str] = EMPTY
        # What those tools read: the state its node is handed. None: its inputs (``deps``); a node run
        # by a ``Send`` of tool calls (``create_agent``) is handed the graph's channels besides the packet.
        self.state_deps: frozenset[str] | None = None
        self.graph_name: str | None = None  # the name of the agent graph it runs in (``agent_path``)


def agent_path(parent: Task | None, graph_name: Any, node: str) -> str:
    """An agent's name (the naming rule, most specific first): ``node`` is the node's own
    ``metadata["agent_name"]`` or the node's name; a graph that carries its own agent name
    (``create_agent(name=...)``: ``lc_agent_name`` in its run metadata) different from the graph
    around it starts the path, ``<name>/<node>``, wherever it runs (the root, a subgraph node, inside a
    tool); else the path of the enclosing nodes, ``team/researcher``."""
    if graph_name and graph_name != (parent.graph_name if parent is not None else None):
        return f"{graph_name}/{node}"
    return f"{parent.agent}/{node}" if parent is not None else node


def seen(t: Task) -> frozenset[str]:
    """What a task's next action starts from: its inputs, its own actions, the results it read and
    what the graphs it ran (by hand) handed back."""
    deps = t.deps | frozenset(t.actions)
    if t.received:
        deps = deps.union(*(result(r) for r in t.received))
    return deps.union(*(c.output_provenance() for c in t.children)) if t.children else deps


def result(t: Task) -> frozenset[str]:
    """What a ``@task`` (or an entrypoint) hands back: its own actions, the results it read and
    the output of graphs it ran; its inputs when none of these could be recorded."""
    out = frozenset(t.actions).union(*(result(r) for r in t.received),
                                     *(c.output_provenance() for c in t.children))
    return t.deps if not out and (t.calls or t.children) else out


def task_output(t: Task) -> frozenset[str] | None:
    """What a finished task's writes carry; None when it recorded nothing and must be recorded as
    an env step first (then its own action is the answer)."""
    if t.internal:
        return t.deps
    if t.pushed:
        return result(t)  # an entrypoint: the results it read and its own model calls
    if t.children:  # and its own model calls, made on what they handed back
        return EMPTY.union(frozenset(t.actions), *(c.output_provenance() for c in t.children)) or t.deps
    if not t.actions and t.calls:
        return t.deps  # its calls could not be recorded (counted): pass the inputs on
    if not t.actions:
        return None
    return frozenset(t.actions)


def inputs(prov: Mapping[str, frozenset[str]], channels: Iterable[str]) -> frozenset[str]:
    """Provenance of what a task reads: the union over the channels it reads or is triggered by."""
    return EMPTY.union(*map(prov.get, channels, repeat(EMPTY)))  # in C: it runs for every task


def apply_writes(prov: dict[str, frozenset[str]], writes: Iterable[tuple[frozenset[str], Iterable[str]]],
                 accumulates: Callable[[str], bool]) -> None:
    """Update ``prov`` in place with one step's writes: ``(writer provenance, channels written)``
    per task, in task order."""
    written: set[str] = set()
    for out, channels in writes:
        for ch in channels:
            if ch in written or accumulates(ch):
                prov[ch] = prov.get(ch, EMPTY) | out
            else:
                prov[ch] = out
            written.add(ch)


def drop_cleared(prov: dict[str, frozenset[str]], available: Callable[[str], bool]) -> None:
    for ch in list(filterfalse(available, prov)):
        del prov[ch]


def restore(prov_then: Mapping[str, frozenset[str]], versions_then: Mapping[str, Any],
            versions_now: Mapping[str, Any], accumulates: Callable[[str], bool]) -> dict[str, frozenset[str]]:
    """The provenance a later run on a checkpointed thread starts from (see the module docstring)."""
    return {ch: p for ch, p in prov_then.items()
            if versions_now.get(ch) == versions_then.get(ch) or accumulates(ch)}


_SCALARS = (type(None), bool, int, float)


def value_provenance(value: Any, channel_values: Mapping[str, Any], prov: Mapping[str, frozenset[str]],
                     fallback: frozenset[str]) -> frozenset[str]:
    """Where a value came from (a ``Send``'s argument, a value a subgraph hands back): the channels
    holding it as their value or as one of its items (by identity), else ``fallback`` (the task that
    computed it)."""
    if isinstance(value, _SCALARS):
        return fallback
    hits = [c for c, v in channel_values.items()
            if v is value or (isinstance(v, (list, tuple)) and any(x is value for x in v))]
    return EMPTY.union(*(prov.get(c, EMPTY) for c in hits)) if hits else fallback


def hand_on(t: Task, values: Iterable[Any], made_by: frozenset[str]) -> None:
    """Note that these values (by identity), returned by a tool step of task ``t``, carry ``made_by``
    (the step and the model calls made inside it)."""
    handed = t.handed if t.handed is not None else {}
    for v in values:
        if not isinstance(v, _SCALARS):  # small ints and the like are shared objects: no identity
            handed[id(v)] = (v, made_by)
    t.handed = handed


def written(t: Task, value: Any, fallback: frozenset[str]) -> frozenset[str]:
    """What a value task ``t`` writes carries: what made it (or, for a list, what made its items: a
    tool node's messages), else ``fallback`` (all the task's output)."""
    handed = t.handed or {}
    items = value if isinstance(value, (list, tuple)) and value else (value,)
    out = EMPTY
    for x in items:
        hit = handed.get(id(x))
        if hit is None or hit[0] is not x:
            return fallback
        out = out | hit[1]
    return out


def subgraph_writes(key_prov: Mapping[str, frozenset[str]], channels: Iterable[str]) -> list[tuple[frozenset[str], list[str]]]:
    """A subgraph's start task's writes, channel by channel: each input key carries the provenance of
    the part of the parent task's input it came from (the keys its input schema drops carry nothing);
    the other channels it writes (its triggers) carry those keys' provenance together."""
    channels = list(channels)
    own = EMPTY.union(*(key_prov[c] for c in channels if c in key_prov))
    return [(key_prov.get(c, own), [c]) for c in channels]


def public_deps(tasks: Iterable[Task], task: Task) -> frozenset[str]:
    """Dependencies without channel provenance (public tier only): every action of the run's tasks
    at an earlier step, and the task's own. An extra edge beats a lost one."""
    step = task.step
    out = set(task.actions)
    for t in tasks:
        if t is not task and (step is None or t.step is None or t.step < step):
            out.update(t.actions)
    return frozenset(out)
