"""The embedded server through the official openai client and langchain's ChatOpenAI: chat,
completions, streaming, log-probs equal to a direct forward pass, token ids, adapter versions,
errors; plus the sampling function and cross-adapter batching of the engine."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from marft_bridge.serving.fixtures import DirectModel, make_random_adapter
from marft_bridge.serving.process import ServerProcess
from marft_bridge.serving.registry import AdapterRegistry
from marft_bridge.serving.engine.sampling import processed_logprobs

KEY = "test-key"
MESSAGES = [{"role": "user", "content": "Plan: add 2 and 3."}]


@pytest.fixture(scope="module")
def registry(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serving")
    reg = AdapterRegistry(tmp / "registry")
    for agent, seed in (("planner", 11), ("coder", 12)):
        reg.publish(agent, make_random_adapter(tiny_model_dir, tmp / agent, seed=seed, scale=2.0), promote=True)
    return reg


@pytest.fixture(scope="module")
def server(tiny_model_dir, registry):
    with ServerProcess(tiny_model_dir, registry.root, api_key=KEY, extra_args=["--threads", "1", "--max-tokens-limit", "64",
                                                                                  "--max-request-bytes", "20000"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def direct(tiny_model_dir, registry):
    return {
        "planner": DirectModel(tiny_model_dir, registry.path("planner")),
        "coder": DirectModel(tiny_model_dir, registry.path("coder")),
        "base": DirectModel(tiny_model_dir),
    }


def test_models_lists_base_and_adapters(client, registry):
    models = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(models) == {"base", "planner", "coder"}
    assert models["planner"]["version"] == 1 and models["planner"]["parent"] == "base"
    assert models["planner"]["root"] == str(registry.path("planner", 1))


@pytest.mark.parametrize("model", ["planner", "coder", "base"])
def test_chat_logprobs_equal_direct_forward(client, direct, model):
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=7, logprobs=True, top_logprobs=3,
        extra_body={"return_token_ids": True},
    ).model_dump()
    choice = r["choices"][0]
    ref = direct[model]
    assert r["prompt_token_ids"] == ref.chat_prompt(MESSAGES)
    assert r["adapter"] == {"name": model, "version": None if model == "base" else 1}
    assert r["logprobs_mode"] == "processed"
    tokens = choice["token_ids"]
    assert len(tokens) == 12 and r["usage"]["completion_tokens"] == 12
    expected = ref.logprobs(r["prompt_token_ids"], tokens)
    got = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
    want = expected[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    for pos, entry in enumerate(choice["logprobs"]["content"]):
        top_ids = [ref.tokenizer.convert_tokens_to_ids(t["token"]) for t in entry["top_logprobs"]]
        assert top_ids == expected[pos].topk(3).indices.tolist()
        assert entry["token"] == ref.tokenizer.decode([tokens[pos]])
    assert choice["message"]["content"] == ref.tokenizer.decode(tokens, skip_special_tokens=True)


def test_processed_logprobs_under_temperature_and_top_k(client, direct):
    r = client.chat.completions.create(
        model="planner", messages=MESSAGES, max_tokens=8, temperature=0.7, top_p=1.0, seed=3, logprobs=True,
        extra_body={"return_token_ids": True, "top_k": 5},
    ).model_dump()
    tokens = r["choices"][0]["token_ids"]
    lp = direct["planner"].logprobs(r["prompt_token_ids"], tokens, temperature=0.7)
    kth = lp.topk(5).values[:, -1:]
    masked = lp.masked_fill(lp < kth, float("-inf")).log_softmax(-1)  # renormalise over the top 5
    want = masked[torch.arange(len(tokens)), torch.tensor(tokens)]
    got = torch.tensor([c["logprob"] for c in r["choices"][0]["logprobs"]["content"]])
    assert torch.allclose(got, want, atol=1e-4)
    assert all(lp[i].topk(5).indices.tolist().count(t) == 1 for i, t in enumerate(tokens))  # sampled inside top-k


def test_allowed_token_ids_mask_sampling_and_logprobs_as_vllm_does(client, direct):
    ref = direct["planner"]
    allowed = ref.tokenizer.convert_tokens_to_ids(list("aeiou "))
    kw = dict(model="planner", messages=MESSAGES, max_tokens=16, temperature=0.8, seed=9, logprobs=True, top_logprobs=2)
    extra = {"return_token_ids": True, "allowed_token_ids": allowed, "top_k": 3}
    r = client.chat.completions.create(**kw, extra_body=extra).model_dump()
    tokens, content = r["choices"][0]["token_ids"], r["choices"][0]["logprobs"]["content"]
    assert len(tokens) == 16 and set(tokens) <= set(allowed)
    # The direct forward masked to the set first, then temperature and top-k: vLLM's order.
    lp = ref.logprobs(r["prompt_token_ids"], tokens, temperature=0.8)  # log-softmax(logits / T)
    outside = torch.ones(lp.shape[-1], dtype=torch.bool)
    outside[allowed] = False
    masked = lp.masked_fill(outside, float("-inf")).log_softmax(-1)
    kth = masked.topk(3).values[:, -1:]
    dist = masked.masked_fill(masked < kth, float("-inf")).log_softmax(-1)
    want = dist[torch.arange(16), torch.tensor(tokens)]
    got = torch.tensor([c["logprob"] for c in content])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    for pos, entry in enumerate(content):  # the top log-probs are the masked distribution's too
        top_ids = [ref.tokenizer.convert_tokens_to_ids(t["token"]) for t in entry["top_logprobs"]]
        assert top_ids == dist[pos].topk(2).indices.tolist() and set(top_ids) <= set(allowed)
    streamed = client.chat.completions.create(**kw, stream=True, extra_body=extra)
    assert [t for c in streamed for t in c.model_dump()["choices"][0].get("token_ids", [])] == tokens
    done = client.completions.create(model="planner", prompt="add", max_tokens=8, temperature=1.0, seed=3,
                                     extra_body={"return_token_ids": True, "allowed_token_ids": allowed[:2]})
    assert set(done.model_dump()["choices"][0]["token_ids"]) <= set(allowed[:2])


def test_seed_makes_sampling_reproducible_and_streaming_matches(client):
    kw = dict(model="coder", messages=MESSAGES, max_tokens=16, temperature=1.0, seed=42)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == a
    assert all(c.model_dump()["adapter"] == {"name": "coder", "version": 1} for c in chunks)
    assert chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stream_carries_token_ids_and_logprobs(server):
    body = {"model": "planner", "messages": MESSAGES, "max_tokens": 5, "stream": True, "logprobs": True,
            "return_token_ids": True, "temperature": 0}
    events = []
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    import json

    chunks = [json.loads(e) for e in events[:-1]]
    assert "prompt_token_ids" in chunks[0]
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    lps = [x for c in chunks if c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"]["content"]]
    assert len(ids) == len(lps) == 5
    full = httpx.post(server.base_url + "/chat/completions", json={**body, "stream": False},
                      headers={"Authorization": f"Bearer {KEY}"}).json()
    assert full["choices"][0]["token_ids"] == ids  # greedy: streamed and whole responses agree


def test_stop_strings_and_greedy_equals_direct(client, direct):
    prompt = direct["planner"].chat_prompt(MESSAGES)
    want = direct["planner"].greedy(prompt, 10)
    text = direct["planner"].tokenizer.decode(want, skip_special_tokens=True)
    r = client.chat.completions.create(model="planner", messages=MESSAGES, max_tokens=10, temperature=0,
                                       extra_body={"return_token_ids": True}).model_dump()
    assert r["choices"][0]["token_ids"] == want
    assert r["choices"][0]["message"]["content"] == text
    stop = text[3:5]
    r = client.chat.completions.create(model="planner", messages=MESSAGES, max_tokens=10, temperature=0, stop=[stop])
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_completions_endpoint(client, direct):
    tok = direct["coder"].tokenizer
    r = client.completions.create(model="coder", prompt="def add(a, b):", max_tokens=6, temperature=1.0, seed=5,
                                  logprobs=2, extra_body={"return_token_ids": True}).model_dump()
    prompt_ids = r["choices"][0]["prompt_token_ids"]  # in the choice, where vLLM puts a completion's
    assert prompt_ids == tok("def add(a, b):")["input_ids"] and "prompt_token_ids" not in r
    tokens = r["choices"][0]["token_ids"]
    want = direct["coder"].logprobs(prompt_ids, tokens)[torch.arange(6), torch.tensor(tokens)]
    assert torch.allclose(torch.tensor(r["choices"][0]["logprobs"]["token_logprobs"]), want, atol=1e-4)
    assert r["adapter"] == {"name": "coder", "version": 1}
    streamed = client.completions.create(model="coder", prompt="def add(a, b):", max_tokens=6, temperature=1.0,
                                         seed=5, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r["choices"][0]["text"]
    streamed = [c.model_dump() for c in client.completions.create(
        model="coder", prompt="def add(a, b):", max_tokens=6, temperature=1.0, seed=5, stream=True,
        extra_body={"return_token_ids": True})]
    # streamed, the prompt ids come once, in the first token's choice
    assert streamed[0]["choices"][0]["prompt_token_ids"] == prompt_ids and streamed[0]["choices"][0]["token_ids"]
    assert [t for c in streamed for t in c["choices"][0].get("token_ids") or []] == tokens
    assert not any("prompt_token_ids" in c["choices"][0] for c in streamed[1:])


def test_langchain_chat_openai(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.base_url, api_key=KEY, model="planner", max_tokens=8, temperature=0, logprobs=True)
    msg = llm.invoke("Plan: add 2 and 3.")
    n_tokens = msg.response_metadata["token_usage"]["completion_tokens"]
    assert 1 <= n_tokens <= 8 and len(msg.response_metadata["logprobs"]["content"]) == n_tokens
    assert msg.response_metadata["model_name"] == "planner"
    chunks = list(llm.stream("Plan: add 2 and 3."))
    assert "".join(c.content for c in chunks) == msg.content


def test_errors_in_openai_format(client, server):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nobody", messages=MESSAGES)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):  # streaming too: refused before the stream starts
        client.chat.completions.create(model="nobody", messages=MESSAGES, stream=True)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be between 1 and 64"):
        client.chat.completions.create(model="planner", messages=MESSAGES, max_tokens=65)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model="planner", messages=MESSAGES, top_p=0)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="planner", messages=[{"role": "user", "content": "x" * 30000}])
    assert e.value.status_code == 413
    from openai import OpenAI

    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    r = httpx.post(server.base_url + "/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "error" in r.json()


def test_processed_logprobs_function():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0]])
    lp = processed_logprobs(logits, torch.tensor([1.0, 0.5]), torch.tensor([0, 2]), torch.tensor([0.8, 1.0]))
    # Row 0: probs .61,.22,.14,.03 -> top_p .8 keeps the first two (.61 < .8, .61+.22 >= .8).
    want0 = torch.tensor([2.0, 1.0]).log_softmax(-1)
    assert torch.allclose(lp[0, :2], want0) and torch.isinf(lp[0, 2:]).all()
    # Row 1: T=0.5, top-2 keeps tokens 1 and 3.
    want1 = (torch.tensor([3.0, 2.0]) / 0.5).log_softmax(-1)
    assert torch.allclose(lp[1, [1, 3]], want1) and torch.isinf(lp[1, [0, 2]]).all()
    greedy = processed_logprobs(logits, torch.tensor([0.0, 0.0]), torch.tensor([1, 1]), torch.tensor([0.1, 0.1]))
    assert torch.allclose(greedy, logits.log_softmax(-1))  # temperature 0 reports the raw distribution
    # allowed_token_ids masks first: row 0 keeps tokens 1 and 3, then T=0.5 and top-k 1 apply to those.
    allowed = torch.tensor([[False, True, False, True], [True] * 4])
    lp = processed_logprobs(logits, torch.tensor([1.0, 0.5]), torch.tensor([0, 1]), torch.tensor([1.0, 1.0]), allowed)
    assert torch.allclose(lp[0, [1, 3]], torch.tensor([1.0, -1.0]).log_softmax(-1)) and torch.isinf(lp[0, [0, 2]]).all()
    assert lp[1, 1] == 0 and torch.isinf(lp[1, [0, 2, 3]]).all()  # unmasked row: top-1 of all four
    greedy = processed_logprobs(logits[:1], torch.tensor([0.0]), torch.tensor([0]), torch.tensor([1.0]), allowed[:1])
    assert int(greedy.argmax()) == 1  # the best allowed token, not the best token (0)


def test_engine_batches_across_adapters(tiny_model_dir, registry):
    from marft_bridge.serving.engine import AdapterEngine, GenerationRequest

    # A long gathering window and a batch size of 6 make the six requests below one batch.
    engine = AdapterEngine(tiny_model_dir, registry=registry, max_batch_size=6, batch_wait_s=30.0)
    try:
        engine.load_adapter("planner", registry.path("planner"))
        engine.load_adapter("coder", registry.path("coder"))
        prompts = [list(range(10, 10 + n)) for n in (5, 9, 3, 7, 4, 6)]  # different lengths: left padding
        names = ["planner", "coder", None, "coder", "planner", None]
        results, done = [None] * 6, threading.Event()

        def sink_for(i):
            def sink(kind, payload):
                if kind == "done":
                    results[i] = payload
                    if all(results):
                        done.set()
            return sink

        for i, (p, n) in enumerate(zip(prompts, names)):
            engine.submit(GenerationRequest(prompt_ids=p, adapter=n, max_tokens=6, temperature=0, sink=sink_for(i)))
        assert done.wait(60)
        assert (engine.stats["batches"], engine.stats["rows"]) == (1, 6)
        refs = {"planner": DirectModel(tiny_model_dir, registry.path("planner")),
                "coder": DirectModel(tiny_model_dir, registry.path("coder")), None: DirectModel(tiny_model_dir)}
        for p, n, res in zip(prompts, names, results):
            assert res.token_ids == refs[n].greedy(p, 6)
            assert res.adapter == (n or "base") and res.version == (1 if n else None)
            lp = refs[n].logprobs(p, res.token_ids)[torch.arange(6), torch.tensor(res.token_ids)]
            assert torch.allclose(torch.tensor(res.logprobs), lp, atol=1e-4)
    finally:
        engine.close()


def test_serve_cli_refuses_a_missing_base_model(tmp_path, capsys):
    from marft_bridge.cli import main as marft

    assert marft(["serve", "--base-model", str(tmp_path / "nope"), "--registry", str(tmp_path / "reg")]) == 1
    assert "is not a model directory" in capsys.readouterr().err


def test_engine_admits_requests_into_a_running_batch(tiny_model_dir, registry):
    """Continuous batching: a request arriving mid-generation joins the running batch at the next
    step (left-padded KV caches merged) and finishes first; both outputs equal direct generation."""
    from marft_bridge.serving.engine import AdapterEngine, GenerationRequest

    engine = AdapterEngine(tiny_model_dir, registry=registry, batch_wait_s=0.0)
    try:
        engine.load_adapter("planner", registry.path("planner"))
        engine.load_adapter("coder", registry.path("coder"))
        order, results, first_token, done = [], {}, threading.Event(), threading.Event()

        def sink_for(name):
            def sink(kind, payload):
                if kind == "token":
                    first_token.set()
                elif kind == "done":
                    order.append(name)
                    results[name] = payload
                    if len(results) == 2:
                        done.set()
            return sink

        long_prompt, short_prompt = list(range(20, 41)), list(range(50, 55))
        engine.submit(GenerationRequest(prompt_ids=long_prompt, adapter="planner", max_tokens=80, temperature=0,
                                        sink=sink_for("long")))
        assert first_token.wait(60)
        engine.submit(GenerationRequest(prompt_ids=short_prompt, adapter="coder", max_tokens=3, temperature=0,
                                        sink=sink_for("short")))
        assert done.wait(60)
        assert engine.stats["batches"] == 2
        if results["long"].finish_reason == "length":  # it ran 80 steps; the short one needed 3
            assert order == ["short", "long"]
        assert results["long"].token_ids == DirectModel(tiny_model_dir, registry.path("planner")).greedy(long_prompt, 80)
        assert results["short"].token_ids == DirectModel(tiny_model_dir, registry.path("coder")).greedy(short_prompt, 3)
    finally:
        engine.close()
