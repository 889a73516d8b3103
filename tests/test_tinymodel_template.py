"""The tiny models' chat template: plain conversations render exactly as before tools existed (the
warm-started demo models were trained on that), and tools, tool calls and tool results render in the
Qwen2.5 / Hermes format that vLLM's hermes tool parser and the embedded server read."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from marft_bridge.demo.tinymodel import build_tokenizer

# The template before tools, verbatim: plain conversations must render byte for byte like this.
OLD_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                        "b": {"type": "integer"}}}}}
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(ADD) + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
PLAIN = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?\nthanks"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "planner: step 1"}],
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("messages", PLAIN)
@pytest.mark.parametrize("gen", [True, False])
def test_plain_conversations_render_exactly_as_before(tok, messages, gen):
    old = build_tokenizer()
    old.chat_template = OLD_TEMPLATE
    new = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    assert new == old.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    ids = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)["input_ids"]
    assert ids == old.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)["input_ids"]
    # tools=None and tools=[] are "no tools" too
    assert tok.apply_chat_template(messages, tools=None, add_generation_prompt=gen, tokenize=False) == new


def test_tools_in_the_system_turn(tok):
    msgs = [{"role": "system", "content": "You add."}, {"role": "user", "content": "2+3?"}]
    text = tok.apply_chat_template(msgs, tools=[ADD], add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou add.\n\n" + TOOLS_BLOCK + "<|im_start|>user\n2+3?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    no_system = tok.apply_chat_template(msgs[1:], tools=[ADD], add_generation_prompt=True, tokenize=False)
    assert no_system == "<|im_start|>system\n" + TOOLS_BLOCK + "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"


def test_tool_calls_and_results_render_as_hermes_blocks(tok):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    wire = {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 5, "b": 1}'}}
    msgs = [
        {"role": "user", "content": "2+3+1?"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [call, wire]},
        {"role": "tool", "content": "5", "tool_call_id": "call_1", "name": "add"},
        {"role": "tool", "content": "6", "tool_call_id": "call_2", "name": "add"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "add", "arguments": {}}}]},
        {"role": "tool", "content": "0", "tool_call_id": "call_3"},
        {"role": "assistant", "content": "6"},
    ]
    text = tok.apply_chat_template(msgs, tools=[ADD], tokenize=False)
    assert text == (
        "<|im_start|>system\n" + TOOLS_BLOCK
        + "<|im_start|>user\n2+3+1?<|im_end|>\n"
        '<|im_start|>assistant\nAdding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response><|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n0\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n6<|im_end|>\n"
    )
    # Each block's body is the JSON object the hermes parser reads.
    body = text.split("<tool_call>\n")[2].split("\n</tool_call>")[0]
    assert json.loads(body) == {"name": "add", "arguments": {"a": 2, "b": 3}}


def test_the_generation_prompt_is_a_prefix_of_the_rendered_assistant_turn(tok):
    # What the trainer relies on to find an action's tokens: obs + gen prompt is a prefix of obs + answer.
    obs = [{"role": "user", "content": "2+3?"}]
    answer = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    prefix = tok.apply_chat_template(obs, tools=[ADD], add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(obs + [answer], tools=[ADD], tokenize=False)
    assert full.startswith(prefix)
    assert full[len(prefix):] == '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'


def test_the_template_survives_save_and_load(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "user", "content": "2+3?"}]
    assert (loaded.apply_chat_template(msgs, tools=[ADD], add_generation_prompt=True, tokenize=False)
            == tok.apply_chat_template(msgs, tools=[ADD], add_generation_prompt=True, tokenize=False))
