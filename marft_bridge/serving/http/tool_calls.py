"""Hermes-format tool calls in model output, as vLLM's ``--tool-call-parser hermes`` reads them.

A call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. The parser is incremental so
streamed and whole responses come out the same by construction: text outside calls is content
(released as soon as it cannot be the start of a ``<tool_call>`` tag), a complete block becomes an
OpenAI tool call (id ``call_...``, arguments a JSON string), and a block that is not a valid call
(bad JSON, no name, arguments not an object) or is cut off comes back as text and is counted. Like
vLLM, a last block left unclosed when generation ends is a call if its JSON is complete.
Whitespace that is all the content (the newlines around calls) is dropped when calls were made;
whitespace after real text is content, streamed or not.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from .requests import ChatRequest, NamedToolChoice

START, END = "<tool_call>", "</tool_call>"


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def parse_call(body: str) -> ParsedToolCall | None:
    """A call from the JSON inside one block, or None when it is not a valid call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    """Feed text deltas, get back what can be sent now: ``(content_text, [calls])``.

    ``max_calls`` (1 when the request says ``parallel_tool_calls: false``) keeps the first calls and
    drops later ones (counted in ``dropped``; their tokens stay in the token ids and log-probs)."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self.buf = ""
        self.in_call = False
        self.calls: list[ParsedToolCall] = []
        self.malformed = 0
        self.dropped = 0
        self.blank = ""  # whitespace-only content, held until real text follows (dropped beside calls)
        self.spoke = False  # real text was released: later whitespace is content, not padding

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        self.buf += delta
        text, new = [], []
        while True:
            if not self.in_call:
                at = self.buf.find(START)
                if at < 0:
                    keep = _partial_tag_suffix(self.buf)
                    text.append(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                text.append(self.buf[:at])
                self.buf, self.in_call = self.buf[at:], True
            end = self.buf.find(END)
            if end < 0:
                break
            block, self.buf, self.in_call = self.buf[: end + len(END)], self.buf[end + len(END) :], False
            text.append(self._take(block, block[len(START) : end], new))
        return self._release("".join(text)), new

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """Generation ended: what is still held back (an unclosed last block is a call if complete)."""
        new: list[ParsedToolCall] = []
        block, self.buf = self.buf, ""
        if self.in_call:
            self.in_call = False
            block = self._take(block, block[len(START) :], new)
        text = self._release(block)
        if not self.calls:
            text, self.blank = text + self.blank, ""
        return text, new

    def _release(self, text: str) -> str:
        """Content to send now: whitespace before any real text (the newlines around calls) waits for it."""
        if not text.strip() and not self.spoke:
            self.blank += text
            return ""
        text, self.blank, self.spoke = self.blank + text, "", True
        return text

    def _take(self, block: str, body: str, new: list) -> str:
        call = parse_call(body.strip())
        if call is None:
            self.malformed += 1
            return block
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self.dropped += 1
            return ""
        self.calls.append(call)
        new.append(call)
        return ""


def parser_for(body: ChatRequest) -> HermesParser | None:
    """A chat request's parser: tool calls are parsed when tools are given and tool_choice is not "none"."""
    if not body.tools or body.tool_choice == "none":
        return None
    return HermesParser(max_calls=None if body.parallel_tool_calls else 1)


class ToolCallStats:
    """Counts over every response parsed for tool calls (``/health`` shows them)."""

    def __init__(self):
        self.counts = {"tool_calls_parsed": 0, "tool_calls_malformed": 0, "tool_calls_dropped": 0,
                       "tool_choice_unmet": 0}

    def count(self, body: ChatRequest, parser: HermesParser) -> None:
        self.counts["tool_calls_parsed"] += len(parser.calls)
        self.counts["tool_calls_malformed"] += parser.malformed
        self.counts["tool_calls_dropped"] += parser.dropped
        choice = body.tool_choice
        wanted = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if (choice == "required" and not parser.calls) or (wanted and wanted not in {c.name for c in parser.calls}):
            self.counts["tool_choice_unmet"] += 1


def _partial_tag_suffix(text: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``<tool_call>``."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0
