"""An A2A call's reply, or a served request's output, gathered from its events (messages, tasks,
status and artifact updates)."""

from __future__ import annotations

from typing import Any

from a2a.types import TaskState
from google.protobuf import json_format


TERMINAL = {"TASK_STATE_COMPLETED", "TASK_STATE_FAILED", "TASK_STATE_CANCELED", "TASK_STATE_REJECTED",
             "TASK_STATE_INPUT_REQUIRED", "TASK_STATE_AUTH_REQUIRED"}
FAILED = {"TASK_STATE_FAILED", "TASK_STATE_REJECTED"}


def state_name(state: int) -> str:
    return TaskState.Name(state)


def message_text(msg: Any) -> str:
    return "\n".join(p.text for p in msg.parts if p.HasField("text"))


def message_metadata(msg: Any) -> dict[str, Any]:
    return json_format.MessageToDict(msg.metadata) if msg is not None and msg.HasField("metadata") else {}


class Reply:
    """The reply of an A2A call or the output of a served request, gathered from its events."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.state: str | None = None
        self.task_id: str | None = None
        self.context_id: str | None = None
        self.final = False

    def add(self, event: Any) -> None:
        """One event: a Message, Task, status or artifact update, or a response holding one."""
        kind = type(event).__name__
        if kind in ("StreamResponse", "SendMessageResponse"):
            which = event.WhichOneof("payload")
            if which is None:
                return
            return self.add(getattr(event, which))
        if kind == "Message":
            self.texts.append(message_text(event))
            self.task_id = event.task_id or self.task_id
            self.context_id = event.context_id or self.context_id
            self.final = True
        elif kind == "Task":
            self.task_id, self.context_id = event.id, event.context_id
            for art in event.artifacts:
                self.texts.append("\n".join(p.text for p in art.parts if p.HasField("text")))
            self._status(event.status)
        elif kind == "TaskStatusUpdateEvent":
            self.task_id, self.context_id = event.task_id, event.context_id
            self._status(event.status)
        elif kind == "TaskArtifactUpdateEvent":
            self.task_id, self.context_id = event.task_id, event.context_id
            self.texts.append("\n".join(p.text for p in event.artifact.parts if p.HasField("text")))

    def _status(self, status: Any) -> None:
        self.state = state_name(status.state)
        if status.HasField("message"):
            text = message_text(status.message)
            if text and text not in self.texts:
                self.texts.append(text)
        self.final = self.state in TERMINAL

    @property
    def text(self) -> str:
        return "\n".join(t for t in self.texts if t)

    def failure(self) -> str | None:
        """The error of a failed or rejected task, else None."""
        if self.state not in FAILED:
            return None
        return f"task {self.state}: {self.text}" if self.text else f"task {self.state}"

    def meta(self) -> dict[str, Any]:
        return {k: v for k, v in (("a2a.task_id", self.task_id), ("a2a.context_id", self.context_id),
                                  ("a2a.state", self.state)) if v}
