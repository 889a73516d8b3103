"""Tool calls parsed the same by vLLM (`--tool-call-parser hermes`) and by us.

Through the servers: the base writes three memorised Hermes answers (two parallel calls, text then a
call, a malformed call); both servers must return the same token ids, calls, content and
finish_reason, plain and streamed. Directly: vLLM's own ``Hermes2ProToolParser``, run in the vLLM
environment, and our ``HermesParser`` read the same texts; where they differ, the difference is the
one the README's table states."""

from __future__ import annotations

import json
import subprocess

import pytest

from marft_bridge.serving.http.tool_calls import HermesParser
from vllm_stack import BASE_NAME, TOOL_ANSWERS, TOOLS, calls_of, chat, tool_messages


CASES = [pytest.param(case, stream, id=f"{case}-{'streamed' if stream else 'plain'}")
         for case in TOOL_ANSWERS for stream in (False, True)]


@pytest.mark.parametrize("case, stream", CASES)
def test_servers_parse_the_memorised_answers_alike(vllm_http, embedded_http, base_model, case, stream):
    from transformers import AutoTokenizer

    ours, theirs = (chat(h, BASE_NAME, tool_messages(case), tools=TOOLS, max_tokens=200, stream=stream)["choices"][0]
                    for h in (embedded_http, vllm_http))
    tok = AutoTokenizer.from_pretrained(str(base_model))
    assert tok.decode(theirs["token_ids"], skip_special_tokens=True) == TOOL_ANSWERS[case][1]  # what was written
    assert ours["token_ids"] == theirs["token_ids"]
    if (case, stream) == ("malformed", True):
        # vLLM's streaming parser reads the name and the arguments with regular expressions, so a block that is
        # not JSON still streams as a call (its non-streamed answer has none); ours has none either way.
        assert calls_of(theirs["message"]) == [("add", {"a": 4, "b": 4})] and calls_of(ours["message"]) == []
        assert theirs["finish_reason"] == "tool_calls" and ours["finish_reason"] == "stop"
        return
    assert calls_of(ours["message"]) == calls_of(theirs["message"])
    assert (ours["message"]["content"] or None) == (theirs["message"]["content"] or None)
    assert ours["finish_reason"] == theirs["finish_reason"]
    expected_calls = {"parallel": 2, "text_then_call": 1, "malformed": 0}[case]
    assert len(calls_of(theirs["message"])) == expected_calls
    assert theirs["finish_reason"] == ("tool_calls" if expected_calls else "stop")


def _call(name, args) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


ADD = _call("add", {"a": 1, "b": 2})
MUL = _call("mul", {"a": 3, "b": 4})
# text -> None when both parse it alike, else what differs (the README's table says the same)
TEXTS = {
    "no call": ("Just text.", None),
    "one call": (ADD, None),
    "parallel calls": (ADD + "\n" + MUL, None),
    "text before a call": ("Sure.\n" + ADD, None),
    "malformed JSON only": ('<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>', None),
    "unclosed last call, JSON complete": ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', None),
    "unclosed call, JSON cut off": ('<tool_call>\n{"name": "add", "argu', None),
    "text after a call": (ADD + "\nDone.", "content"),
    "a valid and a malformed call": (ADD + "\n" + '<tool_call>\n{"name": "mul"\n</tool_call>', "calls"),
    "arguments as a JSON string": ('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "arguments"),
    "no arguments": ('<tool_call>\n{"name": "add"}\n</tool_call>', "calls"),
}

VLLM_PARSE = r"""
import json, sys
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
base, texts, tools = json.loads(sys.stdin.read())
parser = Hermes2ProToolParser(AutoTokenizer.from_pretrained(base))
request = ChatCompletionRequest(model="base", messages=[{"role": "user", "content": "x"}], tools=tools)
out = {}
for name, text in texts.items():
    info = parser.extract_tool_calls(text, request)
    out[name] = {"content": info.content or None,
                 "calls": [(c.function.name, c.function.arguments) for c in info.tool_calls]}
print("RESULT " + json.dumps(out))
"""


def ours(text: str) -> dict:
    """What `marft serve` answers for a completion of ``text`` (the server's non-streamed logic)."""
    parser = HermesParser()
    content, _ = parser.feed(text)
    rest, _ = parser.finish()
    if not parser.calls:
        return {"content": text or None, "calls": []}
    return {"content": (content + rest) or None, "calls": [(c.name, c.arguments) for c in parser.calls]}


@pytest.fixture(scope="module")
def vllm_parsed(vllm_server, base_model):
    """vLLM's parser on every text, in the vLLM environment (the code its server runs)."""
    env = vllm_server.environment()
    payload = json.dumps([str(base_model), {k: t for k, (t, _) in TEXTS.items()}, TOOLS])
    out = subprocess.run([vllm_server.python, "-c", VLLM_PARSE], input=payload, capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _normal(parsed: dict) -> dict:
    """Arguments compared as JSON values (ours and vLLM's spacing may differ)."""
    return {"content": parsed["content"], "calls": [(n, json.loads(a)) for n, a in parsed["calls"]]}


@pytest.mark.parametrize("case", TEXTS)
def test_hermes_parsers_agree_or_differ_as_documented(vllm_parsed, case):
    text, differs = TEXTS[case]
    theirs, mine = _normal(vllm_parsed[case]), _normal(ours(text))
    if differs is None:
        assert mine == theirs
        return
    if case == "text after a call":  # vLLM's content is the text before the first call only
        assert mine["calls"] == theirs["calls"] == [("add", {"a": 1, "b": 2})]
        assert (theirs["content"], mine["content"]) == (None, "\nDone.")
    elif case == "a valid and a malformed call":  # vLLM: no calls at all, the whole text as content
        assert theirs == {"content": text, "calls": []}
        assert mine["calls"] == [("add", {"a": 1, "b": 2})] and "mul" in mine["content"]
    elif case == "arguments as a JSON string":  # vLLM re-encodes the string; we parse it
        assert theirs["calls"] == [("add", '{"a": 1}')] and mine["calls"] == [("add", {"a": 1})]
    elif case == "no arguments":  # vLLM: not a call; we: a call with {}
        assert theirs == {"content": text, "calls": []} and mine["calls"] == [("add", {})]
