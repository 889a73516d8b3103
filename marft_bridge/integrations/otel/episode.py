"""The spans of one trace as one Episode: actions, agents, steps and the dependency graph D
(parentage, message flow, tool-call ids); see ``integrations.otel.intake`` for the rules."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from ...capture import messages as msgs
from ...capture_errors import capture_error
from ...errors import RecordError
from ...schema import Episode, as_record_error
from .messages import genai_messages as _genai_messages
from .messages import loads as _loads
from .messages import tool_fields as _tool_fields
from .spans import Span, node_path, span_fields, span_time


def spans_to_episode(spans: Iterable[Any], source: str = "otel", episode_id: str | None = None,
                     limits: Any = None, refused: list | None = None) -> Episode:
    """Turn the spans of one trace (``ReadableSpan``s, any order) into an Episode, validated under
    ``limits`` (the store's ``RecordLimits``; default: the defaults). A model or tool span that
    cannot be an action (a message past the limits, say) is left out and counted; ``refused``, when
    given, receives ``(span, exception)`` for each, for the caller to keep.

    Parent ids that loop (a span its own parent, A -> B -> A): with no span outside the loop to be
    the root there is no episode (``ValueError``; the collectors dead-letter the trace). Beside a
    real root, each looping span's ancestry is cut where it comes back to a span already on it and
    the span is kept, as one whose parent is missing is (this loses least: nothing is left out); the
    loop is counted (``capture_stats()`` under ``otel.parent_loop``; the episode's
    ``metadata["last_capture_error"]``)."""
    from ...capture.recording import EpisodeRecorder

    nodes = [Span(s) for s in spans]
    root, ancestry, looped = _tree(nodes)
    trace_id = format(root.raw.context.trace_id, "032x")
    own_episode = next((n.attrs["marft.episode.id"] for n in nodes if "marft.episode.id" in n.attrs), None)
    rec = EpisodeRecorder(None, task=_task(nodes, root), source=source, episode_id=episode_id or own_episode or trace_id,
                          metadata={"trace_id": trace_id}, limits=limits)
    if looped:
        capture_error("otel.parent_loop", ValueError(
            f"spans {', '.join(format(i, '016x') for i in looped[:8])}{' ...' if len(looped) > 8 else ''}: "
            "parent chain loops; cut where it repeats"), rec)
    flow = _Flow(ancestry)
    # Own spans keep the episode's recording order; others go by start time, except tool spans,
    # which are recorded when they end: what ran inside them (an agent as a tool) comes first.
    order = sorted((n for n in nodes if n.kind in ("llm", "tool", "env")),
                   key=lambda n: (n.attrs.get("marft.index", 0), n.end if n.kind == "tool" and not n.own else n.start,
                                  n.end))
    for n in order:
        try:
            _record_span(rec, n, flow)
        except Exception as e:  # noqa: BLE001 - one span's fault leaves the rest of the episode
            capture_error("otel.span", e, rec)
            if refused is not None:
                refused.append((n.raw, e))
    return _finish(rec, root, limits)


def _tree(nodes: list[Span]) -> tuple[Span, dict[int, list[Span]], list[int]]:
    """The root span, each span's ancestors (nearest first) and the spans whose parent ids loop.
    Node spans with no model or tool call below them become environment steps."""
    if not nodes:
        raise ValueError("no spans")
    by_id = {n.id: n for n in nodes}
    roots = [n for n in nodes if n.parent_id not in by_id]
    if not roots:
        raise ValueError("no root span: the parent chain of every span loops back on itself")
    ancestry: dict[int, list[Span]] = {}
    looped: list[int] = []  # spans whose parent chain comes back to itself
    for n in nodes:
        # Stop at a span already on the chain: looping parent ids would otherwise never end.
        out, seen, p = [], {n.id}, by_id.get(n.parent_id)
        while p is not None and p.id not in seen:
            out.append(p)
            seen.add(p.id)
            p = by_id.get(p.parent_id)
        if p is not None:
            looped.append(n.id)
        ancestry[n.id] = out
    # Node spans with no model/tool call below them are environment steps (OpenInference shows them).
    busy = {u.id for n in nodes if n.kind in ("llm", "tool") for u in ancestry[n.id]}
    for n in nodes:
        if n.kind == "agent" and n.id not in busy and not n.own and n.meta.get("langgraph_node"):
            n.kind = "env"
    return min(roots, key=lambda n: n.start), ancestry, looped


def _task(nodes: list[Span], root: Span) -> Any:
    """The episode's task: our own workflow span's, else the workflow's first input message."""
    wf = next((n for n in nodes if n.kind == "workflow"), root)
    if wf.attrs.get("marft.episode.task") is not None:
        return _loads(wf.attrs["marft.episode.task"])
    first = _genai_messages(wf.attrs.get("gen_ai.input.messages"))
    raw = first[0]["content"] if first else wf.attrs.get("input.value")
    return _loads(raw) if isinstance(raw, str) and raw[:1] in "{[" else raw


class _Asked(NamedTuple):
    """A tool call a model call emitted, not yet answered by a tool span."""

    call_id: str
    tool: Any
    arguments: Any
    action: str  # the model call's action id
    agent_span: int | None  # the nearest agent span above that call
    start: int  # the call's span start (ns)


class _Flow:
    """What the spans recorded so far tell the next one: actions by span, tool-call ids, handoffs."""

    def __init__(self, ancestry: dict[int, list[Span]]):
        self.ancestry = ancestry
        self.recorded: list[tuple[Span, str, str]] = []  # span, action id, output text
        self.emitted: dict[str, str] = {}  # tool call id -> the model call that asked for it
        self.answered: dict[str, str] = {}  # tool call id -> the tool step that ran it
        self.by_span: dict[int, str] = {}  # span id -> its action
        self.below: dict[int, int] = {}  # span id -> actions recorded below it
        self.handoffs: dict[str, str] = {}  # agent name -> the handoff tool step that named it, not yet taken
        self.unanswered: list[_Asked] = []  # tool calls no tool span has answered yet
        self.aliases: dict[str, str] = {}  # a tool span's own call id -> the id in the model call's output
        self.asked: dict[int, str] = {}  # tool span id -> the model call found to have asked for it

    def asker(self, n: Span, tool_meta: dict[str, Any]) -> str | None:
        """The model call that asked for the tool span ``n``: by call id, else the earliest unanswered
        call of the same tool and arguments made under the same agent span before ``n`` started (Google
        ADK gives a call the model sent without an id its own ``adk-<uuid>`` on the tool span, while its
        model spans show ``<name>_<index>``; OpenInference's smolagents tool spans carry no id). Kept per
        span: asked again, the same call."""
        if n.id in self.asked:
            return self.asked[n.id]
        cid = str(tool_meta["tool_call_id"]) if tool_meta.get("tool_call_id") else None
        if cid is not None and cid in self.emitted:
            return self.emitted[cid]
        want = (tool_meta.get("tool.name"), tool_meta.get("tool.arguments"), self.agent_of(n))
        for i, c in enumerate(self.unanswered):
            if (c.tool, c.arguments, c.agent_span) == want and c.start <= n.start:
                del self.unanswered[i]
                if cid is not None:
                    self.emitted[cid], self.aliases[cid] = c.action, c.call_id
                self.asked[n.id] = c.action
                return c.action
        return None

    def agent_of(self, n: Span) -> int | None:
        """The nearest agent span above ``n`` (parallel agents' calls are told apart by it)."""
        return next((u.id for u in self.ancestry.get(n.id, ()) if u.kind == "agent"), None)

    def note(self, n: Span, aid: str, text: str) -> None:
        self.recorded.append((n, aid, text))
        self.by_span[n.id] = aid
        for u in self.ancestry[n.id]:
            self.below[u.id] = self.below.get(u.id, 0) + 1


def _record_span(rec: Any, n: Span, flow: _Flow) -> None:
    """Record one model, tool or environment span as an action of ``rec``."""
    a = n.attrs
    fields = span_fields(n)
    meta = fields.pop("metadata", None) or {}
    if meta.get("unknown_parts"):
        capture_error("otel.unknown_part", ValueError(
            f"message part types {sorted(set(meta['unknown_parts']))} kept as text"), rec)
    asked = None
    if n.own:
        deps = [str(d) for d in a.get("marft.depends_on") or () if rec.get_action(str(d)) is not None]
        agent = str(a.get("gen_ai.agent.name") or "unknown")
        kind, step, aid = str(a.get("marft.kind") or n.kind), int(a.get("marft.step") or 0), str(a["marft.action.id"])
    else:
        ups = flow.ancestry[n.id]
        agent_spans = [u for u in ups if u.kind == "agent"]
        agent = _agent(n, agent_spans)
        kind, aid = n.kind, None
        asked = flow.asker(n, meta) if n.kind == "tool" else None
        deps = _deps(n, fields, agent_spans, flow, asked)
        extra = _opened(n, flow) + _links(n, flow)
        if n.kind != "tool":
            extra += _call_links(fields["observation"]["messages"], flow.emitted, flow.answered)
            extra += _handed_to(agent, agent_spans, flow)
        deps += [d for d in dict.fromkeys(extra) if d not in deps]
        step = _step(n, ups, [rec.get_action(d).step for d in deps])
    new_id = rec.record_action(
        agent, kind=kind, step=step, depends_on=deps, error=n.error(), action_id=aid,
        started_at=span_time(n.start), ended_at=span_time(n.end), metadata={"span_id": format(n.id, "016x"), **meta},
        **fields)
    for c in (fields.get("output") or {}).get("tool_calls") or ():
        if c.get("id"):
            flow.emitted.setdefault(str(c["id"]), new_id)
            fn = c.get("function") or {}
            flow.unanswered.append(_Asked(str(c["id"]), fn.get("name"), _loads(fn.get("arguments")), new_id,
                                          flow.agent_of(n), n.start))
    if kind == "tool" and meta.get("tool_call_id"):
        cid = str(meta["tool_call_id"])
        flow.answered[cid] = new_id
        mid = flow.aliases.get(cid, cid)
        flow.answered[mid] = new_id
        if mid == cid:  # matched by its id: that one call's entry is answered (ids like ADK's repeat)
            flow.unanswered = [u for u in flow.unanswered if (u.call_id, u.action) != (cid, asked)]
    if kind == "tool" and not n.error() and (target := handoff_target(meta)):
        flow.handoffs[target] = new_id
    flow.note(n, new_id, rec.get_action(new_id).output.text)


# Tools whose call hands the conversation to another agent: ADK's, Strands' swarm's; ``transfer_to_<agent>``
# (LangGraph, the OpenAI Agents SDK) names it in the tool's name.
HANDOFF_TOOLS = frozenset({"transfer_to_agent", "handoff_to_agent"})


def handoff_target(meta: dict[str, Any]) -> str | None:
    """The agent a handoff tool step hands to (its ``agent_name`` argument, or the name's suffix)."""
    name = str(meta.get("tool.name") or "")
    args = meta.get("tool.arguments")
    if name in HANDOFF_TOOLS and isinstance(args, dict) and args.get("agent_name"):
        return str(args["agent_name"])
    for prefix in ("transfer_to_", "handoff_to_"):
        if name.startswith(prefix) and name not in HANDOFF_TOOLS:
            return name[len(prefix):] or None
    return None


def _handed_to(agent: str, agent_spans: list[Span], flow: _Flow) -> list[str]:
    """The receiving agent's first action depends on the handoff tool step that named it."""
    if not flow.handoffs:
        return []
    leaf = agent.rsplit("/", 1)[-1]
    for key in (agent, leaf):
        if key in flow.handoffs:
            return [flow.handoffs.pop(key)]
    return []


def _opened(n: Span, flow: _Flow) -> list[str]:
    """Spans still open around the first action below them: a model call whose span encloses what
    its answer started (ADK keeps it open around an ``AgentTool``) is a source of it; a tool span
    (an agent as a tool) gives it the model call that asked for that tool."""
    out = []
    for u in flow.ancestry[n.id]:
        if flow.below.get(u.id):
            continue  # not the first action below it
        if u.id in flow.by_span:
            out.append(flow.by_span[u.id])
        elif u.kind == "tool":
            asked = flow.asker(u, _tool_fields(u.attrs)["metadata"])
            if asked is not None:
                out.append(asked)
    return out


def _links(n: Span, flow: _Flow) -> list[str]:
    """Span links to recorded actions of the trace: the one convention for "that output became
    this input" (our own emitter writes ``depends_on`` as links)."""
    out = []
    for link in getattr(n.raw, "links", None) or ():
        ctx = getattr(link, "context", None)
        aid = flow.by_span.get(getattr(ctx, "span_id", None))
        if aid is not None and ctx.trace_id == n.raw.context.trace_id:
            out.append(aid)
    return out


def dead_letter_record(exc: Exception, record: str) -> RecordError:
    err = as_record_error(exc, record)
    return err if err.record is not None else RecordError(record, err.field, err.reason)


def raw_span(span: Any) -> dict[str, Any]:
    return {"name": span.name, **dict(span.attributes or {})}


def _call_links(messages: list[dict[str, Any]], emitted: dict[str, str], answered: dict[str, str]) -> list[str]:
    """Tool-call ids in an input: an assistant turn's tool call links to the model call that
    emitted it, a tool message to the tool step that answered it (else to the emitter)."""
    out: list[str] = []
    for m in messages:
        if m.get("tool_call_id"):
            cid = str(m["tool_call_id"])
            out.append(answered.get(cid) or emitted.get(cid))
        out += [emitted.get(str(c["id"])) for c in m.get("tool_calls") or () if isinstance(c, dict) and c.get("id")]
    return [d for d in dict.fromkeys(out) if d is not None]


def _deps(n: Span, fields: dict[str, Any], agent_spans: list[Span], flow: _Flow, asked: str | None = None) -> list[str]:
    """Parentage and message flow: earlier actions of this action's agent spans, and earlier actions
    whose output text is in its input. A tool span answering a call a recorded model call emitted
    (``asked``, by ``gen_ai.tool.call.id``) takes that call instead: its input is that call's
    arguments. A tool span's own descendants (an agent run as the tool) are inputs when their
    output is in the tool's result (else the last of them to end)."""
    texts = [m.get("content") or "" for m in fields["observation"]["messages"]]
    texts += [u.input_text() for u in agent_spans[:1]]
    inside = {u.id for u in agent_spans} | ({n.id} if n.kind == "env" else set())
    result = fields["output"]["text"] if n.kind == "tool" else ""
    deps, nested = [asked] if asked is not None else [], []
    ancestry = flow.ancestry
    for prev, pid, ptext in flow.recorded:
        if n.kind == "tool" and any(u.id == n.id for u in ancestry[prev.id]):
            nested.append((prev, pid, ptext))
            continue
        if prev.end > n.start or asked is not None:
            continue  # still running when this one started, or not what the asked tool read
        # parentage: an action of one of this action's agents (not one inside a sibling sub-agent)
        own_agent = next((u.id for u in ancestry[prev.id] if u.kind == "agent"), None)
        if own_agent in inside or msgs.occurs_in(msgs.output_forms(ptext), texts):
            deps.append(pid)
    answer = [pid for _, pid, ptext in nested if msgs.occurs_in(msgs.output_forms(ptext), [result])]
    if nested and not answer:
        answer = [max(nested, key=lambda x: x[0].end)[1]]
    return deps + answer


def _agent(n: Span, agent_spans: list[Span]) -> str:
    named = [name for u in reversed(agent_spans) if (name := u.own_name()) is not None]
    if named:
        return "/".join(named)
    if n.attrs.get("gen_ai.agent.name"):  # a call span naming its own agent (as our emitter's do)
        return str(n.attrs["gen_ai.agent.name"])
    for meta in [n.meta, *(u.meta for u in agent_spans)]:
        path = node_path(meta)
        if path:
            return path
    return str(n.attrs.get("gen_ai.request.model") or n.attrs.get("llm.model_name") or "unknown")


def _step(n: Span, ups: list[Span], dep_steps: list[int]) -> int:
    # LangGraph superstep of the outermost node span (subgraph actions take their parent's step).
    for s in reversed([n, *ups]):
        if isinstance(s.meta.get("langgraph_step"), int):
            return s.meta["langgraph_step"]
    return max(dep_steps, default=0) + 1


def _finish(rec: Any, root: Span, limits: Any) -> Episode:
    status = "failed" if root.error() else "completed"
    acts = rec.actions()
    return Episode.model_validate(
        {"id": rec.id, "source": rec.source, "task": rec.task, "actions": acts, "status": status,
         "started_at": span_time(root.start) or rec.started_at, "ended_at": span_time(root.end), "metadata": rec.metadata},
        context={"limits": limits} if limits is not None else None)
