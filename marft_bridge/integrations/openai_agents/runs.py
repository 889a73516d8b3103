"""One captured OpenAI Agents SDK trace (``Run``): the spans seen, the tool calls not yet run, the
handoffs not yet recorded, and what was recorded inside each function span (an agent used as a
tool); and the tool steps recorded from them (``integrations.openai_agents`` says what becomes what)."""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import datetime
from typing import Any

from ...capture.messages import arguments_json, canonical_arguments, tool_call
from ...capture.recording import EpisodeRecorder
from .. import openai as oa


def ts(value: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return None


def handoff_tool_name(agent: str) -> str:
    # What ``agents.Handoff.default_tool_name`` makes of an agent name.
    return re.sub(r"[^a-zA-Z0-9_]", "_", re.sub(r"\s", "_", f"transfer_to_{agent}")).lower()


class FunctionStep:
    """A function span in flight as ``episode_context.ToolStep`` (and, for a protocol call made in
    it, the ``FrameworkTask`` it runs in): an MCP call inside a function tool is that tool step."""

    def __init__(self, run: Run, span_id: str, agent: str | None) -> None:
        self.run, self.span_id, self.agent = run, span_id, agent
        self.step = (run.rec.max_step() if run.rec.max_step() is not None else -1) + 1  # where it will land
        self.finished = False
        self._id: str | None = None
        self.extra: dict[str, Any] = {}
        self.deps: list[str] = []
        self.waiting: list[Any] = []

    @property
    def recorder(self) -> EpisodeRecorder:
        return self.run.rec

    @property
    def action_id(self) -> str:
        if self._id is None:
            self._id = self.run.rec.new_action_id()
        return self._id

    @property
    def reserved_id(self) -> str | None:
        """The id a call inside it reserved for the step (None: record it under a new one)."""
        return self._id

    def depends_on(self) -> list[str]:
        span = self.run.spans[self.span_id][3]
        call = self.run.call_of(self.span_id, self.agent, span.span_data.name, span.span_data.input)
        return [call["llm"]] if call is not None else []

    def enrich(self, metadata: dict[str, Any], depends_on: Any, on_recorded: Any) -> None:
        with self.run.lock:
            self.extra.update(metadata)
            self.deps.extend(depends_on)
            self.waiting.append(on_recorded)

    def settle(self, recorded: bool) -> None:
        waiting, self.waiting = self.waiting, []
        for fn in waiting:
            fn(recorded)

    # as the FrameworkTask a call inside it runs in
    def tool_step(self) -> FunctionStep:
        return self

    def tool_owner(self, name: str, arguments: Any) -> None:
        return None

    def record(self, kind: str, fields: dict[str, Any], depends_on: Any, started: Any = None,
               agent: str | None = None) -> str:
        return self.run.rec.record_action(agent or self.agent or "agent", kind=kind, depends_on=list(depends_on),
                                          started_at=started, **fields)


class Run:
    """One captured SDK trace: its recorder, spans seen, tool calls not yet run."""

    def __init__(self, rec: EpisodeRecorder, owned: bool, capture: Any) -> None:
        self.rec, self.owned, self.capture = rec, owned, capture
        self.lock = threading.Lock()
        self.spans: dict[str, tuple[str, str | None, str | None, Any]] = {}  # id -> (type, name, parent id, span)
        self.t0: dict[str, float] = {}
        self.ended: set[str] = set()
        self.pending: list[dict[str, Any]] = []  # tool calls asked for: id, name, args, llm, agent
        self.handoffs: list[dict[str, Any]] = []  # handoff spans ended, not yet recorded
        self.fn_calls: dict[str, dict | None] = {}  # function span -> the tool call it runs (matched once)
        self.under: dict[str, list[str]] = {}  # function span -> model calls recorded inside it
        self.called: set[str] = set()  # agent spans that made a model call
        self.functions: dict[str, FunctionStep] = {}  # function spans a protocol call was made in
        self.error: str | None = None

    # -- spans ---------------------------------------------------------------------------------

    def start(self, span: Any) -> None:
        data = span.span_data
        with self.lock:
            if span.span_id in self.spans:
                return  # the processor is registered twice: the event counts once
            self.spans[span.span_id] = (data.type, getattr(data, "name", None), span.parent_id, span)
            self.t0[span.span_id] = time.perf_counter()

    def end(self, span_id: str) -> float | None | bool:
        """The span's start time; False when its end was handled already."""
        with self.lock:
            if span_id in self.ended:
                return False
            self.ended.add(span_id)
            return self.t0.pop(span_id, None)

    def _chain(self, span_id: str | None) -> list[tuple[str, str, str | None]]:
        """(id, type, name) of the span and its ancestors, nearest first."""
        out = []
        with self.lock:
            while span_id is not None and len(out) < 1000:
                kind, name, parent, _ = self.spans.get(span_id, (None, None, None, None))
                if kind is None:
                    break
                out.append((span_id, kind, name))
                span_id = parent
        return out

    def agent_of(self, span_id: str | None) -> str | None:
        return next((name for _, kind, name in self._chain(span_id) if kind == "agent"), None)

    def function_step(self, span_id: str | None) -> FunctionStep | None:
        """The function span the code at ``span_id`` runs in (its nearest span, not a nested agent's)."""
        chain = self._chain(span_id)
        if not chain or chain[0][1] != "function" or chain[0][0] in self.ended:
            return None
        sid = chain[0][0]
        with self.lock:
            step = self.functions.get(sid)
            if step is None:
                step = self.functions[sid] = FunctionStep(self, sid, None)
        step.agent = self.agent_of(self.spans[sid][2])
        return step

    # -- tool calls ----------------------------------------------------------------------------

    def take_call(self, agent: str | None, name: str, args: Any, fn_span: str | None = None) -> dict | None:
        """The pending tool call of ``agent`` this execution answers (first by name and arguments).
        Calls alike in both (the same tool asked twice with the same arguments) go to the function
        spans in the order they started, whatever order they end in: the SDK starts them in call order."""
        key = canonical_arguments(args) if args is not None else None
        with self.lock:
            mine = [c for c in self.pending if agent is None or c["agent"] == agent]
            for exact, ok in ((True, lambda c: c["name"] == name and (key is None or c["key"] == key)),
                              (False, lambda c: c["name"] == name)):
                hits = [c for c in mine if ok(c)]
                if hits:
                    rank = self._earlier_alike(fn_span, name, key) if exact and len(hits) > 1 else 0
                    hit = hits[min(rank, len(hits) - 1)]
                    self.pending.remove(hit)
                    return hit
        return None

    def _earlier_alike(self, fn_span: str | None, name: str, key: str | None) -> int:
        """How many function spans of the same tool and arguments, not matched yet, started before
        ``fn_span`` (spans are kept in the order they started; under the run's lock)."""
        n = 0
        for sid, (kind, sname, _, span) in self.spans.items():
            if sid == fn_span:
                return n
            if kind == "function" and sname == name and sid not in self.fn_calls:
                given = getattr(span.span_data, "input", None)
                n += key is None or given is None or canonical_arguments(given) == key
        return 0

    def take_transfer(self, agent: str) -> dict | None:
        with self.lock:
            call = next((c for c in self.pending if c["agent"] == agent and str(c["name"]).startswith("transfer_to_")),
                        None)
            if call is not None:
                self.pending.remove(call)
        return call

    def call_of(self, fn_span: str, agent: str | None, name: str, args: Any) -> dict | None:
        """The tool call a function span runs, matched the first time it is asked."""
        if fn_span in self.fn_calls:
            return self.fn_calls[fn_span]
        call = self.take_call(agent, name, args, fn_span)
        self.fn_calls[fn_span] = call
        return call

    def asking_call(self, span_id: str | None) -> str | None:
        """For the first model call of an agent used as a tool (its agent span inside a function
        span): the model call that asked for that tool."""
        chain = self._chain(span_id)
        at = next((i for i, (_, kind, _) in enumerate(chain) if kind == "agent"), None)
        if at is None or chain[at][0] in self.called:
            return None
        self.called.add(chain[at][0])
        fn = next(((sid, name) for sid, kind, name in chain[at + 1:] if kind == "function"), None)
        if fn is None:
            return None
        span = self.spans[fn[0]][3]
        call = self.call_of(fn[0], self.agent_of(self.spans[fn[0]][2]), fn[1], span.span_data.input)
        return call["llm"] if call is not None else None

    def note(self, span_id: str | None, action_id: str, agent: str, calls: list[dict]) -> None:
        """A model call was recorded: the function spans around it hold it, its tool calls are pending."""
        for sid, kind, _ in self._chain(span_id):
            if kind == "function":
                self.under.setdefault(sid, []).append(action_id)
        oa.note_tool_calls(self.rec, action_id, calls)
        with self.lock:
            for c in calls:
                fn = c.get("function") or {}
                self.pending.append({"id": c.get("id"), "name": fn.get("name"), "args": fn.get("arguments"),
                                     "key": canonical_arguments(fn.get("arguments")), "llm": action_id, "agent": agent})

    def nested_answer(self, fn_span: str, result: str) -> list[str]:
        """What an agent used as a tool handed back: its model calls whose output the tool's result
        holds, else its last one (none for a plain function tool)."""
        nested = self.under.pop(fn_span, None)
        self.fn_calls.pop(fn_span, None)
        if not nested:
            return []
        inside = set(nested)
        return [a for a in self.rec.producers_of([result]) if a in inside] or [nested[-1]]

    # -- handoffs ------------------------------------------------------------------------------

    def flush_handoffs(self, messages: list[dict] | None) -> list[tuple[str | None, str]]:
        """Record the handoffs seen so far; their result is the tool message answering the call (if
        given). Returns (the agent handed to, the handoff step) of each."""
        with self.lock:
            todo, self.handoffs = self.handoffs, []
        out = []
        for h in todo:
            text = json.dumps({"assistant": h["to"]})  # the SDK's default transfer message
            if h["call"] is not None:
                for m in messages or ():
                    if m.get("role") == "tool" and m.get("tool_call_id") == h["call"]["id"]:
                        text = m.get("content") or ""
            name = h["call"]["name"] if h["call"] is not None else handoff_tool_name(h["to"] or "")
            args = h["call"]["args"] if h["call"] is not None else "{}"
            deps = [h["call"]["llm"]] if h["call"] is not None else [x for x in [self.rec.last_action_id(h["from"])] if x]
            out.append((h["to"], tool_step(self, h["from"], h["call"], name, args, text, h["error"], h["started"],
                                           h["ended"], None, deps, {"handoff.goto": h["to"]})))
        return out


def tool_step(run: Run, agent: str, call: dict | None, name: str, args: Any, text: str, error: str | None,
              started: datetime | None, ended: datetime | None, latency: float | None, deps: list[str],
              extra: dict[str, Any] | None = None, action_id: str | None = None) -> str:
    call_id = call["id"] if call is not None else None
    args_json = arguments_json(args)
    try:
        parsed = json.loads(args_json)
    except ValueError:
        parsed = args_json
    tc = tool_call(call_id, name, args_json)
    meta = {"tool.name": name, "tool.arguments": parsed, "tool_call_id": call_id, "latency_s": latency, **(extra or {})}
    aid = run.rec.record_action(
        agent, kind="tool", depends_on=deps, started_at=started, ended_at=ended, error=error,
        observation={"messages": [{"role": "assistant", "content": None, "tool_calls": [tc]}]},
        output={"text": text}, metadata={k: v for k, v in meta.items() if v is not None}, action_id=action_id)
    return aid
