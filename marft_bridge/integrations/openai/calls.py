"""Dependencies of a raw-client call by tool-call id and by a continued response (per episode)."""

from __future__ import annotations

from typing import Any


class _CallIndex:
    """Per episode: which action emitted each tool call id, and what each stored response depended on
    (which tool step ran a call the recorder knows: ``EpisodeRecorder.tool_step_of``)."""

    def __init__(self) -> None:
        self.emitted: dict[str, str] = {}
        # Responses API: response id -> (the action, what it depended on), for a call continuing it
        self.responses: dict[str, tuple[str, list[str]]] = {}


_INDEX_KEY = "openai.calls"  # the recorder's ``integration_data`` key


def _index(rec: Any) -> _CallIndex:
    data = rec.integration_data
    idx = data.get(_INDEX_KEY)
    if idx is None:
        idx = data.setdefault(_INDEX_KEY, _CallIndex())  # setdefault: one index if two threads race
    return idx


def note_tool_calls(rec: Any, action_id: str, calls: Any) -> None:
    """Remember that ``action_id`` (a model call of episode ``rec``) emitted these tool calls."""
    idx = _index(rec)
    for c in calls or ():
        if isinstance(c, dict) and c.get("id"):
            idx.emitted.setdefault(str(c["id"]), action_id)


def emitter_of(rec: Any, call_id: str) -> str | None:
    """The model call that emitted tool call ``call_id`` in episode ``rec``."""
    return _index(rec).emitted.get(str(call_id))


def call_dependencies(rec: Any, messages: list[dict]) -> list[str]:
    """Actions a conversation depends on through tool-call ids: for an assistant turn's tool call,
    the model call that emitted it (its message is in the input); for a tool result, the tool step
    that ran it when one was recorded, else the model call that emitted it."""
    idx = _index(rec)
    out = []
    for m in messages:
        cid = m.get("tool_call_id")
        if cid:  # the tool step that ran it (any capture's: SDK, MCP, ...), else the asking call
            aid = rec.tool_step_of(str(cid)) or idx.emitted.get(str(cid))
            if aid is not None:
                out.append(aid)
        for c in m.get("tool_calls") or ():
            aid = idx.emitted.get(str(c.get("id"))) if isinstance(c, dict) and c.get("id") else None
            if aid is not None:
                out.append(aid)
    return list(dict.fromkeys(out))


def message_dependencies(rec: Any, messages: list[dict]) -> list[str]:
    """Message flow (earlier output text in these messages) plus tool-call ids."""
    texts = [m.get("content") or "" for m in messages]
    return list(dict.fromkeys([*rec.producers_of(texts), *call_dependencies(rec, messages)]))


def call_inputs(rec: Any, fields: dict[str, Any]) -> list[str]:
    """What a recorded call depends on: its messages' (``message_dependencies``) and, for a Responses
    call that continues a stored one (``previous_response_id``: the server holds the earlier turns,
    the request does not), that call and what it depended on."""
    deps = message_dependencies(rec, fields["observation"]["messages"])
    prev = (fields.get("metadata") or {}).get("previous_response_id")
    earlier = _index(rec).responses.get(str(prev)) if prev else None
    return list(dict.fromkeys([*earlier[1], earlier[0], *deps])) if earlier else deps


def note_response(rec: Any, action_id: str, fields: dict[str, Any], deps: list[str]) -> None:
    """Remember the response id of a recorded call and what it depended on (``call_inputs``)."""
    rid = (fields.get("metadata") or {}).get("response_id")
    if rid:
        _index(rec).responses[str(rid)] = (action_id, list(deps))
