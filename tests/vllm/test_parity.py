"""Parity of our embedded server (`marft serve`) with a real vLLM on the same base and registry:
greedy outputs identical and token log-probs within 1e-4 for the base and two adapters, plain and
streamed, chat and completions; the same prompt token ids for chat requests with tools (vLLM's
/tokenize against our rendering), and the response fields capture reads shaped as vLLM shapes them."""

from __future__ import annotations

import pytest

from vllm_stack import BASE_NAME, TOOLS, chat, fold_stream, logprob_gap, stream_chunks

TOL = 1e-4
MODELS = [BASE_NAME, "alpha", "beta"]
PROMPTS = [
    [{"role": "user", "content": "Write one short sentence about the sea."}],
    [{"role": "user", "content": "Solve 4+5*3."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Count to 5."}],
    [{"role": "user", "content": "def f(x):"}],
]
PARITY: dict[str, list] = {"outputs": [], "gaps": []}  # across the parametrized cases, for the figures


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("model", MODELS)
def test_greedy_chat_identical_and_logprobs_close(vllm_http, embedded_http, model, stream, figures):
    outputs = set()
    for messages in PROMPTS:
        ours = chat(embedded_http, model, messages, stream=stream)
        theirs = chat(vllm_http, model, messages, stream=stream)
        a, b = ours["choices"][0], theirs["choices"][0]
        same = (a["token_ids"], a["message"]["content"], a["finish_reason"]) == (
            b["token_ids"], b["message"]["content"], b["finish_reason"])
        gap = logprob_gap(ours, theirs)
        PARITY["outputs"].append(same)
        PARITY["gaps"].append(gap)
        assert same, (messages, a["message"]["content"], b["message"]["content"])
        assert ours["prompt_token_ids"] == theirs["prompt_token_ids"]
        assert gap <= TOL, (messages, gap)
        outputs.add(tuple(a["token_ids"]))
    assert len(outputs) > 1  # the prompts give different outputs: the comparison is not of one string
    figures["parity, greedy chat (base, alpha, beta x 5 prompts x plain/streamed)"] = (
        f"outputs identical {sum(PARITY['outputs'])}/{len(PARITY['outputs'])}, "
        f"max |Δ log-prob| {max(PARITY['gaps']):.2e} (sampled tokens and top-5)")


def test_adapters_change_the_outputs(vllm_http):
    """Else the per-adapter parity above would compare the base three times."""
    outs = {m: tuple(chat(vllm_http, m, PROMPTS[0])["choices"][0]["token_ids"]) for m in MODELS}
    assert len(set(outs.values())) == len(MODELS), outs


def _prompt_ids(obj: dict):
    """A completion's prompt ids: in its choice, as vLLM and we put them."""
    return obj["choices"][0].get("prompt_token_ids") if obj["choices"] else None


def completion(http, body: dict, stream: bool):
    """(token ids, text, token log-probs, prompt ids) of a /v1/completions answer, folded if streamed."""
    if not stream:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        return choice["token_ids"], choice["text"], choice["logprobs"]["token_logprobs"], _prompt_ids(out)
    chunks = stream_chunks(http, "/v1/completions", body)
    choices = [ch for c in chunks for ch in c["choices"]]
    return ([t for ch in choices for t in ch.get("token_ids") or []], "".join(ch["text"] for ch in choices),
            [x for ch in choices for x in (ch.get("logprobs") or {}).get("token_logprobs") or []],
            next(p for p in map(_prompt_ids, chunks) if p))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("prompt", ["The sea is", [4, 60, 71, 75]], ids=["text", "token-ids"])
def test_completions_identical(vllm_http, embedded_http, prompt, stream):
    body = {"model": "alpha", "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 3,
            "return_token_ids": True}
    ours, theirs = completion(embedded_http, body, stream), completion(vllm_http, body, stream)
    assert ours[:2] == theirs[:2] and ours[3] == theirs[3]
    assert max(abs(p - q) for p, q in zip(ours[2], theirs[2])) <= TOL


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_completion_prompt_ids_where_vllm_puts_them(vllm_http, embedded_http, stream):
    body = {"model": "alpha", "prompt": "The sea is", "max_tokens": 2, "temperature": 0, "return_token_ids": True}

    def where(http):
        if stream:
            first = stream_chunks(http, "/v1/completions", body)[0]
            return "prompt_token_ids" in first, "prompt_token_ids" in first["choices"][0], bool(first["choices"][0].get("token_ids"))
        out = http.post("/v1/completions", json=body).json()
        return "prompt_token_ids" in out, "prompt_token_ids" in out["choices"][0]

    assert where(embedded_http) == where(vllm_http)


TOOL_CONVERSATIONS = {
    "user": [{"role": "user", "content": "Add 2 and 3."}],
    "system-and-user": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Add 2 and 3."}],
    "after-tool-results": [
        {"role": "user", "content": "Add 2 and 3, and 5 and 1."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a":5,"b":1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "tool", "tool_call_id": "call_2", "content": "6"},
        {"role": "user", "content": "And the product?"},
    ],
}


@pytest.mark.parametrize("conversation", TOOL_CONVERSATIONS)
def test_tool_prompt_ids_match_vllm_tokenize(vllm_http, embedded_http, conversation):
    messages = TOOL_CONVERSATIONS[conversation]
    r = vllm_http.post("/tokenize", json={"model": BASE_NAME, "messages": messages, "tools": TOOLS})
    assert r.status_code == 200, r.text
    tokenized = r.json()["tokens"]
    ours = chat(embedded_http, BASE_NAME, messages, max_tokens=1, tools=TOOLS)["prompt_token_ids"]
    theirs = chat(vllm_http, BASE_NAME, messages, max_tokens=1, tools=TOOLS)["prompt_token_ids"]
    assert ours == tokenized == theirs


def test_tool_without_description_prompt_ids_match_vllm(vllm_http, embedded_http):
    tools = [{"type": "function", "function": {"name": "add"}}]
    messages = TOOL_CONVERSATIONS["user"]
    tokenized = vllm_http.post("/tokenize", json={"model": BASE_NAME, "messages": messages, "tools": tools}).json()
    ours = chat(embedded_http, BASE_NAME, messages, max_tokens=1, tools=tools)["prompt_token_ids"]
    assert ours == tokenized["tokens"]


def _shape(x):
    """Keys and value types, with lists shown by their first element."""
    if isinstance(x, dict):
        return {k: _shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_shape(x[0])] if x else []
    return type(x).__name__


# What capture and users read from a response; everything else (vLLM's refusal, annotations, ...;
# our adapter, logprobs_mode) is left out.
CHAT_FIELDS = {"prompt_token_ids", "choices", "usage"}
CHOICE_FIELDS = {"index", "message", "logprobs", "finish_reason", "token_ids"}
USAGE_FIELDS = {"prompt_tokens", "completion_tokens", "total_tokens"}


def _read_fields(resp: dict) -> dict:
    out = {k: v for k, v in resp.items() if k in CHAT_FIELDS}
    if "choices" in out:
        out["choices"] = [{k: v for k, v in c.items() if k in CHOICE_FIELDS} for c in out["choices"]]
        for c in out["choices"]:
            if isinstance(c.get("message"), dict):
                c["message"] = {k: v for k, v in c["message"].items() if k in ("role", "content")}
            if isinstance(c.get("delta"), dict):
                c["delta"] = {k: v for k, v in c["delta"].items() if k in ("role", "content")}
    if isinstance(out.get("usage"), dict):
        out["usage"] = {k: v for k, v in out["usage"].items() if k in USAGE_FIELDS}
    return out


def test_token_ids_and_logprobs_shaped_as_vllm(vllm_http, embedded_http):
    body = {"model": "alpha", "messages": PROMPTS[1], "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "return_token_ids": True}
    ours, theirs = (h.post("/v1/chat/completions", json=body).json() for h in (embedded_http, vllm_http))
    assert _shape(_read_fields(ours)) == _shape(_read_fields(theirs))

    # Streamed: vLLM sends the prompt's ids once, in the first chunk, and each chunk's token ids beside
    # their log-prob entries (a chunk may carry more than one token: vLLM's do now and then).
    def stream_shape(http):
        chunks = stream_chunks(http, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
        token_chunks = [c for c in chunks if c["choices"] and c["choices"][0].get("token_ids")]
        for c in token_chunks:
            assert len(c["choices"][0]["token_ids"]) == len(c["choices"][0]["logprobs"]["content"])
        return (sorted(k for k in chunks[0] if k in CHAT_FIELDS), _shape(_read_fields(token_chunks[0])),
                _shape(_read_fields(chunks[-1])), fold_stream(chunks)["choices"][0]["token_ids"])

    assert stream_shape(embedded_http) == stream_shape(vllm_http)
