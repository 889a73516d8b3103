"""Where vLLM and `marft serve` answer differently, each row of the README's table checked against
both servers (same base, same registry), so the table says what the servers do today."""

from __future__ import annotations

import shutil

import pytest

from vllm_stack import BASE_NAME, TOOLS, stream_chunks

HI = [{"role": "user", "content": "hi"}]


def post(http, body: dict, path: str = "/v1/chat/completions"):
    r = http.post(path, json=body)
    return r.status_code, r.json()


def test_n_above_one(vllm_http, embedded_http):
    body = {"model": "alpha", "messages": HI, "max_tokens": 3, "n": 2, "temperature": 1.0}
    status, theirs = post(vllm_http, body)
    assert status == 200 and len(theirs["choices"]) == 2
    status, ours = post(embedded_http, body)
    assert status == 400 and ours["error"]["param"] == "n"


@pytest.mark.parametrize("field, value", [("presence_penalty", 0.5), ("frequency_penalty", 0.5),
                                          ("repetition_penalty", 1.2)])
def test_penalties_applied_by_vllm_refused_by_us(vllm_http, embedded_http, field, value):
    body = {"model": "alpha", "messages": HI, "max_tokens": 3, field: value}
    assert post(vllm_http, body)[0] == 200
    status, ours = post(embedded_http, body)
    assert status == 400 and ours["error"]["param"] == field


def test_logit_bias_applied_by_vllm_ignored_by_us(vllm_http, embedded_http, base_model):
    from transformers import AutoTokenizer

    a = AutoTokenizer.from_pretrained(str(base_model)).convert_tokens_to_ids("a")
    plain = {"model": "alpha", "messages": HI, "max_tokens": 3, "temperature": 0}
    biased = {**plain, "logit_bias": {str(a): 100}}
    assert post(vllm_http, biased)[1]["choices"][0]["message"]["content"] == "aaa"
    assert post(embedded_http, biased)[1]["choices"][0]["message"]["content"] == \
        post(embedded_http, plain)[1]["choices"][0]["message"]["content"] != "aaa"


def test_unknown_role(vllm_http, embedded_http):
    body = {"model": "alpha", "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 3}
    assert post(vllm_http, body)[0] == 200  # vLLM hands it to the chat template as it is
    status, ours = post(embedded_http, body)
    assert status == 400 and ours["error"]["param"] == "messages.0"


def test_error_code_field(vllm_http, embedded_http):
    body = {"model": "nope", "messages": HI, "max_tokens": 3}
    (s1, theirs), (s2, ours) = post(vllm_http, body), post(embedded_http, body)
    assert s1 == s2 == 404 and theirs["error"]["type"] == ours["error"]["type"] == "NotFoundError"
    assert (theirs["error"]["code"], ours["error"]["code"]) == (404, "model_not_found")


def test_adapter_from_outside_the_registry(vllm_http, embedded_http, registry, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(registry.path("alpha"), outside)
    body = {"lora_name": "stray", "lora_path": str(outside)}
    assert vllm_http.post("/v1/load_lora_adapter", json=body).status_code == 200  # any directory it can read
    assert vllm_http.post("/v1/unload_lora_adapter", json={"lora_name": "stray"}).status_code == 200
    status, ours = post(embedded_http, body, "/v1/load_lora_adapter")
    assert status == 400 and "outside the registry" in ours["error"]["message"]


def test_tool_choice_required_is_guided_by_vllm_only(vllm_http, embedded_http, base_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_model))
    body = {"model": BASE_NAME, "messages": HI, "max_tokens": 30, "temperature": 0, "tools": TOOLS,
            "tool_choice": "required", "return_token_ids": True}
    texts = [tok.decode(post(h, body)[1]["choices"][0]["token_ids"]) for h in (vllm_http, embedded_http)]
    assert texts[0].startswith('<tool_call>\n{"name": "add"')  # vLLM constrains decoding to a call
    assert not texts[1].startswith("<tool_call>")  # we sample freely (and count tool_choice_unmet)


def test_streamed_finish_reason_placement(vllm_http, embedded_http):
    body = {"model": "alpha", "messages": HI, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    theirs, ours = (stream_chunks(h, "/v1/chat/completions", body) for h in (vllm_http, embedded_http))
    # vLLM: on the last token's chunk; we: in one more chunk, with an empty delta.
    assert theirs[-1]["choices"][0]["finish_reason"] == "length" and theirs[-1]["choices"][0]["token_ids"]
    assert ours[-1]["choices"][0]["finish_reason"] == "length" and ours[-1]["choices"][0]["delta"] == {}
