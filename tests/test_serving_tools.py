"""`marft serve` with tools, through the official openai client and langchain: the prompt rendered
by the base model's chat template with tools=, Hermes `<tool_call>` output parsed into
message.tool_calls (non-streamed and streamed deltas), finish_reason "tool_calls", token ids and
log-probs over the whole sampled sequence equal to a direct forward pass of base + adapter;
tool_choice none / required / named and parallel_tool_calls; half-written calls come back as text.

The model that emits the calls is the tiny base fine-tuned in-process (~20 s) until greedy decoding
of one prompt gives a two-call Hermes answer; a small random adapter on top is what is served."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from marft_bridge.serving.fixtures import DirectModel, make_random_adapter, train_memorising_model
from marft_bridge.serving.process import ServerProcess
from marft_bridge.serving.registry import AdapterRegistry
from marft_bridge.serving.http.tool_calls import HermesParser

KEY = "tools-key"
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
MESSAGES = [{"role": "user", "content": "Add 2 and 3, and 5 and 1."}]
CALLS = [{"a": 2, "b": 3}, {"a": 5, "b": 1}]
ANSWER = "".join(f'<tool_call>\n{{"name": "add", "arguments": {json.dumps(c)}}}\n</tool_call>' + ("\n" if i == 0 else "")
                 for i, c in enumerate(CALLS))


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    base = DirectModel(tiny_model_dir)
    prompt = base.chat_prompt(MESSAGES, tools=TOOLS)
    answer = base.tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [base.tokenizer.eos_token_id]
    model_dir = train_memorising_model(tiny_model_dir, tmp / "caller-base", prompt, answer)
    reg = AdapterRegistry(tmp / "registry")
    reg.publish("caller", make_random_adapter(model_dir, tmp / "caller", seed=5, scale=0.05), promote=True)
    direct = DirectModel(model_dir, reg.path("caller"))
    assert direct.greedy(prompt, len(answer) + 5) == answer  # the adapter keeps the memorised answer
    return model_dir, reg, direct, prompt, answer


@pytest.fixture(scope="module")
def server(setup):
    model_dir, reg, *_ = setup
    with ServerProcess(model_dir, reg.root, api_key=KEY, extra_args=["--threads", "1", "--max-tokens-limit", "200"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


def health(server) -> dict:
    return httpx.get(server.url + "/health").json()


def ask(client, model="caller", **kw):
    params = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0)
    return client.chat.completions.create(**{**params, **kw})


def test_tool_calls_parsed_with_logprobs_equal_to_a_direct_forward(client, setup):
    model_dir, _, direct, prompt, answer = setup
    r = ask(client, tool_choice="auto", logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True}).model_dump()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] is None and msg["role"] == "assistant"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("function", "add", CALLS[0]), ("function", "add", CALLS[1])]
    ids = [c["id"] for c in msg["tool_calls"]]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    # The prompt is the template's rendering with tools=; ids and log-probs cover the whole answer.
    assert r["prompt_token_ids"] == prompt and "<tools>" in direct.tokenizer.decode(prompt)
    assert choice["token_ids"] == answer and r["usage"]["completion_tokens"] == len(answer)
    got = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
    want = direct.logprobs(prompt, answer)[torch.arange(len(answer)), torch.tensor(answer)]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    without_adapter = DirectModel(model_dir).logprobs(prompt, answer)[torch.arange(len(answer)), torch.tensor(answer)]
    assert (without_adapter - want).abs().max() > 1e-3  # the check above could tell the adapter apart
    assert "".join(c["token"] for c in choice["logprobs"]["content"]) == ANSWER + "<|im_end|>"


def test_tool_calls_streamed_as_deltas(client, setup):
    answer = setup[4]
    chunks = [c.model_dump() for c in ask(client, stream=True, logprobs=True, stream_options={"include_usage": True},
                                          extra_body={"return_token_ids": True})]
    calls: dict[int, dict] = {}
    content, token_ids, n_logprobs, finish = "", [], 0, None
    for c in chunks:
        if not c["choices"]:
            continue
        ch = c["choices"][0]
        delta = ch["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:  # accumulate by index, as OpenAI clients do
            slot = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            slot["id"] += tc.get("id") or ""
            slot["name"] += (tc.get("function") or {}).get("name") or ""
            slot["arguments"] += (tc.get("function") or {}).get("arguments") or ""
        token_ids += ch.get("token_ids") or []
        n_logprobs += len((ch.get("logprobs") or {}).get("content") or [])
        finish = ch["finish_reason"] or finish
    assert finish == "tool_calls" and content == ""
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == [("add", c) for c in CALLS]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert token_ids == answer and n_logprobs == len(answer)
    assert chunks[-1]["usage"]["completion_tokens"] == len(answer)


def test_tool_choice_none_parallel_false_named_and_required(client, server):
    r = ask(client, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == ANSWER
    assert r.choices[0].finish_reason == "stop"
    before = health(server)
    r = ask(client, parallel_tool_calls=False)
    assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [CALLS[0]]
    assert health(server)["tool_calls_dropped"] == before["tool_calls_dropped"] + 1
    named = ask(client, tool_choice={"type": "function", "function": {"name": "add"}})
    assert named.choices[0].finish_reason == "tool_calls" and len(named.choices[0].message.tool_calls) == 2
    assert health(server)["tool_choice_unmet"] == before["tool_choice_unmet"]
    # Not enforced by decoding: the base model does not call the tool, and the answer is its text.
    r = ask(client, model=server.base_model.rsplit("/", 1)[-1], tool_choice="required", max_tokens=20)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert isinstance(r.choices[0].message.content, str)
    assert health(server)["tool_choice_unmet"] == before["tool_choice_unmet"] + 1


@pytest.mark.parametrize("stream", [False, True])
def test_half_written_tool_call_comes_back_as_text(client, server, stream):
    before = health(server)["tool_calls_malformed"]
    r = ask(client, max_tokens=30, stream=stream)
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        assert r.choices[0].message.tool_calls is None
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert text == ANSWER[:30] and finish == "length"
    assert health(server)["tool_calls_malformed"] == before + 1


def test_langchain_bind_tools(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.base_url, api_key=KEY, model="caller", temperature=0, max_tokens=200)
    msg = llm.bind_tools(TOOLS).invoke(MESSAGES[0]["content"])  # the schema as sent: the model memorised its prompt
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("add", c) for c in CALLS]
    assert msg.response_metadata["finish_reason"] == "tool_calls"


def feed_all(parser: HermesParser, pieces) -> tuple[str, list]:
    text, calls = "", []
    for p in pieces:
        t, c = parser.feed(p)
        text, calls = text + t, calls + c
    t, c = parser.finish()
    return text + t, calls + c


@pytest.mark.parametrize("output,text,calls,malformed", [
    ('Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> done', "Sure.  done", [("f", {"x": 1})], 0),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', [], 1),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [], 1),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', [], 1),
    ('<tool_call>{"name": "f", "arguments": "{\\"y\\": 2}"}</tool_call>', "", [("f", {"y": 2})], 0),
    ('<tool_call>{"name": "f"}</tool_call>', "", [("f", {})], 0),
    ('I will add.\n<tool_call>{"name": "f"}</tool_call>', "I will add.\n", [("f", {})], 0),  # text's whitespace kept
    ('\n <tool_call>{"name": "f"}</tool_call>\n', "", [("f", {})], 0),  # whitespace that is all the content: dropped
    ('<tool_call>{"name": "f", "arguments": {"x": "<tool_call>"}}', "", [("f", {"x": "<tool_call>"})], 0),  # unclosed, complete
    ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', [], 1),  # cut off
    ("a < b <tool and <tool_ca", "a < b <tool and <tool_ca", [], 0),  # tag-like text is released at the end
    ("x" * 5 + "<tool_call>" * 0, "xxxxx", [], 0),
])
def test_hermes_parser_streamed_equals_whole(output, text, calls, malformed):
    for pieces in ([output], list(output), [output[i : i + 3] for i in range(0, len(output), 3)]):
        parser = HermesParser()
        got_text, got_calls = feed_all(parser, pieces)
        assert got_text == text
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
        assert parser.malformed == malformed


def test_hermes_parser_holds_back_only_a_possible_tag_and_limits_calls():
    parser = HermesParser()
    assert parser.feed("hello <tool") == ("hello ", [])
    assert parser.feed("box") == ("<toolbox", [])
    parser = HermesParser(max_calls=1)
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    text, calls = feed_all(parser, [call, "\n", call])
    assert text == "" and len(calls) == 1 and parser.dropped == 1  # the newline between calls is not content
    parser = HermesParser()
    assert feed_all(parser, ["\n", " ", "ok", "\n"]) == ("\n ok\n", [])  # without calls whitespace is kept


def test_a_tool_without_description_renders_as_vllm_and_as_the_trainer_does(client, setup):
    """vLLM hands the template a tool's missing description and parameters as null; so do the server
    and the trainer (one normalisation), so the recorded prompt is the one the trainer rebuilds."""
    from marft_bridge.schema import Action, Observation
    from marft_bridge.trainers.batch import observation_ids

    _, _, direct, _, _ = setup
    bare = [{"type": "function", "function": {"name": "add"}}]
    r = ask(client, tools=bare, max_tokens=1, extra_body={"return_token_ids": True}).model_dump()
    as_vllm = direct.chat_prompt(MESSAGES, tools=[{"type": "function", "function": {
        "name": "add", "description": None, "parameters": None}}])
    assert r["prompt_token_ids"] == as_vllm != direct.chat_prompt(MESSAGES, tools=bare)
    recorded = Action(agent="caller", observation=Observation(messages=MESSAGES, tools=bare))
    assert observation_ids(recorded, direct.tokenizer) == as_vllm
