"""Cross-process joins: the trace context a call carries, and the callee's half of an episode.

A caller (an MCP client, an A2A client) records one *call step* per request: an action of the
calling agent whose id is reserved before the request goes out. The request carries

- ``traceparent`` (W3C): ``00-<trace id>-<span id>-01``; the trace id is the episode id (a
  32-hex id as the recorder makes; other ids are hashed) and the span id is the last 16 hex
  digits of the call step's id (its random part);
- ``marft/caller``: ``<episode id> <call step id> <call step's Flex-POMDP step>``, the exact
  values, because an OpenTelemetry SDK in the app may rewrite ``traceparent``.

The callee (an MCP server middleware, an A2A executor wrapper) records what it does in its own
``EpisodeRecorder`` under the caller's episode id: its *half*. The halves meet in the store,
which merges actions written under one episode id (``TraceStore.add_episode``).

Why the callee writes second: the store validates ``depends_on`` against the actions stored so
far, and the caller's recorder only accepts dependencies on its own actions. So every
cross-process edge points from the callee to the caller's call step (the callee's work depends
on the request; the call step holds the reply, and the caller's next actions depend on the call
step), and the callee's half is written once the call step is stored. ``JoinWriter``
(join_writer.py) does that in a background thread: it writes a half as soon as the caller's call
step is in the store, and after ``join_timeout`` seconds writes it without the edge
(``metadata["unresolved_caller"]``) so nothing is lost when the caller never writes its half.

In the callee's half, steps are shifted to start after the call step, its first action depends
on the call step, its other actions that depend on nothing captured depend on that first action
(they started from the request), and agents recorded inside an A2A agent are nested under it.

When both halves live in one process (``mcp.Client(server)`` on an in-process ``MCPServer``, an
A2A agent calling another one served by the same process) the callee's half skips the store: it
is recorded straight into the caller's recorder right after the call step, so the episode is
written once, with no merge and no join writer. The caller's recorder then holds the callee's
actions while the episode runs (a model call whose prompt quotes a tool result may depend on
the server's tool action too). A half that arrives after the call step was recorded goes
through the join writer as usual.

A caller may also ask for the half in the reply (MCP: ``marft/half: "reply"`` in the request's
``_meta``; the server puts its finished half in the result's ``_meta["marft/half"]`` and the
client takes it out before the app sees the result): then the callee writes nothing, and the
caller records the half (validated, and only if it starts from that call step) after the call
step, so the episode is written once, by the caller. A half that cannot go in a reply (the
call raised, an intermediate round) goes through the join writer.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from ...capture_errors import capture_error, guarded
from ...capture.episode_context import CaptureState, FrameworkTask, Instrumentor, ToolStep, current_framework_task
from ...capture.recording import EpisodeRecorder
from ...schema import MAX_NAME_CHARS
from ...seams import EpisodeSink
from .carrier import (CALLER_KEY, HALF_KEY, CallerRef, conversation_episode_id, extract,  # noqa: F401 - public here
                      inject, span_id, trace_id)
from .join_writer import JoinWriter, combine_halves


# -- the caller's side ---------------------------------------------------------------------------


@dataclass
class CallStep:
    """A call step being made: its reserved id, its step, what it depends on."""

    recorder: EpisodeRecorder
    action_id: str
    step: int
    depends_on: list[str]
    task: FrameworkTask | None = None  # the framework task (a LangGraph node) it runs in, if any
    agent: str | None = None  # whose action it is: the asking model call's agent, where known
    # The tool step it is part of (a LangChain tool run around the MCP call): not recorded apart.
    host: ToolStep | None = None
    call_id: str | None = None  # the tool call it answers, where a recorded model call asked for it
    # Callee halves served in this process, recorded after the call step (see the module doc).
    halves: list[tuple[dict, JoinWriter, bool]] = field(default_factory=list)
    settled: bool = False

    @property
    def ref(self) -> CallerRef:
        return CallerRef(self.recorder.id, self.action_id, self.step)

    def record(self, agent: str, kind: str, *, extra_deps: Any = (), started_at: Any = None,
               metadata: dict[str, Any] | None = None, validate: bool = True, **fields: Any) -> str:
        """Record the step (after the call) with the given fields, then the in-process callee halves.
        Part of a tool step (``host``): that step takes the ``mcp.*``/``a2a.*`` metadata and the extra
        dependencies, and the halves are recorded once it is."""
        deps = [*self.depends_on, *extra_deps]
        if self.host is not None:
            own = {k: v for k, v in (metadata or {}).items() if k.startswith(("mcp.", "a2a."))}
            try:
                self.host.enrich(own, extra_deps, self.settle)
            except BaseException:
                self.settle(False)
                raise
            return self.action_id
        t = self.task
        recorded = False
        try:
            if t is not None and not t.finished:
                # Inside a LangGraph node: the step is one of the node's actions, so the data the node
                # writes (the tool result) carries it to the next model call.
                fields = {**fields, "action_id": self.action_id, "metadata": metadata or {}}
                aid = t.record(kind, fields, deps, started_at, agent=agent)
            else:
                aid = self.recorder.record_action(agent, kind=kind, step=self.step, depends_on=deps,
                                                  started_at=started_at, metadata=metadata, action_id=self.action_id,
                                                  validate=validate, **fields)
            recorded = True
            return aid
        finally:
            self.settle(recorded)

    def settle(self, recorded: bool) -> None:
        """The step is recorded (its in-process callee halves follow it) or not (they go to the join writer)."""
        calls = _calls()
        with calls.lock:
            self.settled = True
            halves, self.halves = self.halves, []
            calls.in_flight.pop(self.action_id, None)
        for data, writer, validate in halves:
            if recorded:
                _record_half(self.recorder, data, writer, validate)
            else:  # the call step is not in the recorder: the join writer resolves or times out
                writer.write(data, self.action_id)


def begin_call(recorder: EpisodeRecorder, agent: str | None, tool: str | None = None,
               arguments: Any = None) -> CallStep:
    """Reserve a call step in ``recorder``. Inside a LangGraph node: when a tool step is running
    there (a LangChain tool making the call), the call is part of it; else, for a tool call
    (``tool``, ``arguments``) a model call of the run asked for, it is that agent's step and
    depends on that call; else it depends on the node's inputs and earlier actions. Outside a
    node: on the model call of the episode that asked for this tool call (by name and arguments:
    its agent's step, answering its tool_call_id), else on the latest model call of ``agent`` (or
    of anyone)."""
    t = current_framework_task()
    if t is not None and t.recorder is recorder:
        host = t.tool_step()
        if host is not None:
            return _in_flight(CallStep(recorder, host.action_id, t.step if host.step is None else host.step,
                                       host.depends_on(), t, host.agent or t.agent, host))
        owner = t.tool_owner(tool, arguments) if tool is not None else None
        if owner is not None:
            return _in_flight(CallStep(recorder, recorder.new_action_id(), t.step, [owner[0]], t, owner[1]))
        return _in_flight(CallStep(recorder, recorder.new_action_id(), t.step, t.depends_on(), t, t.agent))
    asker = recorder.tool_call_asker(tool, arguments) if tool is not None else None
    if asker is not None:  # a model call of the episode asked for exactly this call (a raw client's loop)
        aid, who, step, call_id = asker
        return _in_flight(CallStep(recorder, recorder.new_action_id(), step, [aid], None, who, call_id=call_id))
    acts = recorded(recorder)[::-1]  # newest first
    llms = [a for a in acts if a[0] == "llm"]
    dep = next((a for a in llms if agent is None or a[1] == agent), llms[0] if llms else None)
    step = dep[2] if dep is not None else (max((a[2] for a in acts), default=-1) + 1)
    return _in_flight(CallStep(recorder, recorder.new_action_id(), step, [dep[3]] if dep is not None else [], None,
                               agent or (dep[1] if dep is not None else None)))


class CallState(CaptureState):
    """What the protocol captures (MCP, A2A) share while one of their clients or servers is
    instrumented: the call steps made in this process and not yet recorded, by id (a callee served
    here finds its caller), and one ``JoinWriter`` per store object."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight: weakref.WeakValueDictionary[str, CallStep] = weakref.WeakValueDictionary()
        self.writers: dict[int, JoinWriter] = {}


# Holders: the instrumented MCP clients and servers, A2A interceptors and executors.
CALLS = Instrumentor(CallState, weak=True)


def _calls() -> CallState:
    """The shared state; a capture object made without its ``instrument_*`` call holds it for the process."""
    return CALLS.state or CALLS.instrument()


# Per caller recorder (``integration_data``), the ids of actions that came from callee halves (in
# process or in a reply): ``begin_call`` and ``recorded`` skip them, as if written apart.
_HALF_IDS = "propagation.half_ids"


def _in_flight(step: CallStep) -> CallStep:
    calls = _calls()
    with calls.lock:
        calls.in_flight[step.action_id] = step
    return step


def join_writer(store: EpisodeSink) -> JoinWriter:
    """The one JoinWriter of a store object in this process."""
    calls = _calls()
    with calls.lock:
        w = calls.writers.get(id(store))
        if w is None or w.store is not store:
            w = calls.writers[id(store)] = JoinWriter(store)
        return w


def flush_joins(store: EpisodeSink | None = None, timeout: float | None = None) -> bool:
    """Wait for the callee halves this process has to write (all stores, or one)."""
    calls = CALLS.state
    if calls is None:
        return True
    with calls.lock:
        writers = [w for w in calls.writers.values() if store is None or w.store is store]
    return all(w.flush(timeout) for w in writers)


def _attach_in_process(data: dict, caller: CallerRef, writer: JoinWriter) -> bool:
    """Hand a callee half to its caller's call step in this process (same store); False: not
    here, too late, or the caller writes to another store."""
    calls = _calls()
    with calls.lock:
        step = calls.in_flight.get(caller.action_id)
        if step is None or step.settled or step.recorder.id != caller.episode_id or step.recorder.closed:
            return False
        target = step.recorder.store
        if isinstance(target, CalleeHalfStore):  # the caller is itself a callee half in this process
            target = target.store
        if target is not writer.store:
            return False
        step.halves.append((data, writer, False))
        return True


def reply_half(recorder: EpisodeRecorder) -> str | None:
    """The finished half of a callee ``recorder`` that asked to send it back in its reply, as JSON
    text (None when there is none: it went to an in-process caller, or nothing was recorded)."""
    store = recorder.store
    halves = store.reply or []
    store.reply = None
    if not halves:
        return None
    return json.dumps(combine_halves(halves), default=lambda o: o.isoformat() if hasattr(o, "isoformat") else str(o))


def write_reply_half(recorder: EpisodeRecorder, half: str | None) -> None:
    """A half meant for the reply that cannot go in it: write it through the join writer."""
    store = recorder.store
    halves = [json.loads(half)] if half is not None else (store.reply or [])
    store.reply = None
    for h in halves:
        store.writer.write(h, store.caller.action_id)


def accept_reply_half(step: CallStep, half: Any) -> bool:
    """Take a callee half that came back in a reply: it is recorded into the caller's recorder
    right after the call step (as an in-process half is). Only a half of this episode that starts
    from this call step is taken."""
    if isinstance(half, str):
        try:
            half = json.loads(half)
        except ValueError:
            return False
    if not isinstance(half, dict):
        return False
    acts = half.get("actions")
    if half.get("id") != step.recorder.id or not isinstance(acts, list) or not acts:
        return False
    first = acts[0]
    if not isinstance(first, dict) or (first.get("depends_on") or [None])[0] != step.action_id:
        return False
    target = step.recorder.store
    writer = target.writer if isinstance(target, CalleeHalfStore) else join_writer(target)
    with _calls().lock:
        if step.settled:
            return False
        step.halves.append((half, writer, True))
    return True


def _record_half(recorder: EpisodeRecorder, data: dict, writer: JoinWriter, validate: bool) -> None:
    """Record a callee half into the caller's recorder (``validate``: a half from another process;
    one recorded here was checked when recorded); what the recorder no longer takes (it was
    finished meanwhile) goes to the join writer."""
    acts = data["actions"]
    ids = recorder.integration_data.setdefault(_HALF_IDS, set())
    target = recorder.store
    foreign = target.foreign if isinstance(target, CalleeHalfStore) else set()
    for k, a in enumerate(acts):
        try:
            recorder.record_action(
                a["agent"], kind=a["kind"], step=a["step"], observation=a.get("observation"),
                output=a.get("output"), sampling=a.get("sampling"), policy=a.get("policy"),
                depends_on=a["depends_on"], error=a.get("error"), started_at=a.get("started_at"),
                ended_at=a.get("ended_at"), metadata=a.get("metadata"), token_source=a.get("token_source"),
                action_id=a["id"], validate=validate)
        except RuntimeError:  # finished meanwhile
            writer.write({**data, "actions": acts[k:]}, acts[0]["depends_on"][0])
            return
        except Exception as e:  # noqa: BLE001 - a malformed action of a reply half: refused alone
            capture_error("join.reply_half", e, recorder)
            continue
        ids.add(a["id"])
        foreign.add(a["id"])
    # As the store's merge would: the half's episode metadata over the caller's, its rewards added.
    meta = data.get("metadata")
    if isinstance(meta, dict):
        recorder.metadata.update(meta)
    for r in data.get("rewards") or ():
        with guarded("join.reply_half", recorder):
            recorder.reward(r["value"], agent=r.get("agent"), action_id=r.get("action_id"),
                            source=r.get("source", "unknown"), metadata=r.get("metadata"))


def needs_validation(agent: str, *texts: str | None) -> bool:
    """Whether ``record_action`` should validate an action a protocol hook built: only the agent's
    name or texts from the app can break the record's limits. The store validates the finished
    episode anyway, and validating each action on the call path costs about as much as the rest."""
    if not agent or len(agent) > MAX_NAME_CHARS:
        return True
    for t in texts:
        if t is not None and len(t) > 1_000_000:
            return True
    return False


def recorded(recorder: EpisodeRecorder) -> list[tuple[str, str, int, str, list[str]]]:
    """(kind, agent, step, id, depends_on) of each action recorded so far, unvalidated, leaving
    out the halves of further callees recorded into it (they would have been written apart)."""
    skip = recorder.integration_data.get(_HALF_IDS) or ()
    return [a for a in recorder.action_links() if a[3] not in skip]


# -- the callee's side ---------------------------------------------------------------------------


class CalleeHalfStore:
    """The store an ``EpisodeRecorder`` of a callee's half writes through: on ``submit`` the half
    is joined to the caller (see the module docstring) and handed to the ``JoinWriter``."""

    def __init__(self, store: EpisodeSink, caller: CallerRef | None, writer: JoinWriter, nest_under: str | None = None):
        self.store = store
        self.caller = caller
        self.writer = writer
        self.nest_under = nest_under
        # A list when the half goes back to the caller in the reply (see ``reply_half``).
        self.reply: list[dict] | None = None
        # Actions of further callees' halves recorded into this one: already named and joined.
        self.foreign: set[str] = set()

    def submit(self, episode: Any) -> None:
        if hasattr(episode, "model_dump"):
            data = episode.model_dump(mode="json")
        else:  # the recorder's raw record: copy what is changed below, never the recorder's own dicts
            data = dict(episode)
            data["actions"] = [dict(a, depends_on=list(a.get("depends_on") or ())) for a in data.get("actions") or ()]
        caller = self.caller
        acts = data["actions"]
        if acts:
            base = caller.step + 1 if caller is not None and caller.action_id else 0
            shift = max(0, base - min(a["step"] for a in acts))
            first = acts[0]["id"]
            top = self.nest_under
            foreign = self.foreign
            for k, a in enumerate(acts):
                a["step"] += shift
                if a["id"] in foreign:
                    continue
                if top is not None and a["agent"] != top and not a["agent"].startswith(top + "/"):
                    a["agent"] = f"{top}/{a['agent']}"
                if k > 0 and not a["depends_on"]:
                    a["depends_on"] = [first]
        if caller is not None and caller.action_id and acts:
            acts[0]["depends_on"] = [caller.action_id, *acts[0]["depends_on"]]
            if _attach_in_process(data, caller, self.writer):
                return
            if self.reply is not None:
                self.reply.append(data)
            else:
                self.writer.write(data, caller.action_id)
        else:
            self.writer.write(data, None)

    def flush(self, timeout: float | None = None) -> bool:
        return self.writer.flush(timeout)

    def add_reward(self, *args: Any, **kw: Any) -> Any:
        self.writer.flush()
        return self.store.add_reward(*args, **kw)


def callee_recorder(store: EpisodeSink, caller: CallerRef | None, *, episode_id: str | None = None, source: str,
                    metadata: dict[str, Any] | None = None, nest_under: str | None = None) -> EpisodeRecorder:
    """An ``EpisodeRecorder`` for a callee's half of the caller's episode (or of ``episode_id``).

    ``nest_under``: the callee agent; other agents recorded in the half (the nodes of a LangGraph
    app inside it) are renamed ``"<callee>/<agent>"``."""
    from ...capture.recording import resolve_store

    real = resolve_store(store)
    eid = caller.episode_id if caller is not None else episode_id
    return EpisodeRecorder(CalleeHalfStore(real, caller, join_writer(real), nest_under), episode_id=eid, source=source,
                           metadata=metadata)
