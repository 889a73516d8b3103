"""What tests/vllm share: the base model both servers serve, request helpers, and the comparisons.

The base is a tiny Llama of the shape vLLM's CPU attention takes (hidden 256, 4 heads: head_dim 64),
built in-process and then fine-tuned (all weights, a minute or so) until greedy decoding of three
tool prompts gives a known Hermes answer each: two parallel calls, text then a call, and a malformed
call. Adapters on top change every other output, so parity is checked on varied text.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

KEY = "vllm-test-key"
BASE_NAME = "base"  # the base model's directory name: the model name both servers answer to
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def _call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


# prompt -> the answer the base model is trained to give greedily (with TOOLS offered)
TOOL_ANSWERS = {
    "parallel": ("Add 2 and 3, and 5 and 1.", _call("add", {"a": 2, "b": 3}) + "\n" + _call("add", {"a": 5, "b": 1})),
    "text_then_call": ("What is 7 plus 8?", "I will add.\n" + _call("add", {"a": 7, "b": 8})),
    "malformed": ("Add 4 and 4.", '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 4}\n</tool_call>'),
}


def tool_messages(key: str) -> list[dict]:
    return [{"role": "user", "content": TOOL_ANSWERS[key][0]}]


def build_base(path: Path, *, max_steps: int = 400, lr: float = 1e-3) -> Path:
    """The tiny base, trained until greedy decoding of every TOOL_ANSWERS prompt gives its answer
    with a margin (a low loss), so no float difference between engines can flip a token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marft_bridge.demo.tinymodel import build_tiny_model

    raw = build_tiny_model(path.parent / "untrained", seed=0, hidden_size=256, num_heads=4, num_kv_heads=2,
                           intermediate_size=512, max_positions=2048)
    tok = AutoTokenizer.from_pretrained(str(raw))
    model = AutoModelForCausalLM.from_pretrained(str(raw), dtype=torch.float32)
    pairs = []
    for question, answer in TOOL_ANSWERS.values():
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], tools=TOOLS,
                                         add_generation_prompt=True, tokenize=True)["input_ids"]
        target = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        pairs.append((torch.tensor([list(prompt) + target]), len(prompt)))
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(max_steps):
        opt.zero_grad()
        done = True
        for ids, n in pairs:
            logits = model(input_ids=ids).logits[0, n - 1 : -1]  # [len(target), V]
            loss = torch.nn.functional.cross_entropy(logits, ids[0, n:])
            done &= float(loss.detach()) < 0.01 and torch.equal(logits.argmax(-1), ids[0, n:])
            loss.backward()
        if done:
            break
        opt.step()
    else:
        raise RuntimeError(f"the base did not memorise its tool answers in {max_steps} steps")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def chat(http, model: str, messages: list[dict], *, max_tokens: int = 24, stream: bool = False, **kw) -> dict:
    """One chat completion with token ids and log-probs, returned in the non-streamed shape
    (a stream is folded: content, tool calls by index, token ids, log-prob entries)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
            "top_logprobs": 5, "return_token_ids": True, **kw}
    if not stream:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()
    return fold_stream(stream_chunks(http, "/v1/chat/completions", body))


def stream_chunks(http, path: str, body: dict) -> list[dict]:
    chunks = []
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def fold_stream(chunks: list[dict]) -> dict:
    content, calls, token_ids, logprobs, finish, prompt_ids = "", {}, [], [], None, None
    for c in chunks:
        assert "error" not in c, c
        prompt_ids = c.get("prompt_token_ids") or prompt_ids
        for choice in c.get("choices", []):
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
            token_ids += choice.get("token_ids") or []
            logprobs += (choice.get("logprobs") or {}).get("content") or []
            finish = choice.get("finish_reason") or finish
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": calls[i]} for i in sorted(calls)]
    return {"choices": [{"message": message, "token_ids": token_ids, "finish_reason": finish,
                         "logprobs": {"content": logprobs}}], "prompt_token_ids": prompt_ids}


def calls_of(message: dict) -> list[tuple[str, dict]]:
    """Tool calls as (name, arguments object): ids differ between servers by design."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]


def logprob_gap(a: dict, b: dict) -> float:
    """Largest |Δ| between two responses' log-probs: the sampled tokens' and the top-5 alternatives'
    (sorted values, so a tie ordered differently does not count)."""
    ea, eb = a["choices"][0]["logprobs"]["content"], b["choices"][0]["logprobs"]["content"]
    assert len(ea) == len(eb)
    gap = 0.0
    for x, y in zip(ea, eb):
        gap = max(gap, abs(x["logprob"] - y["logprob"]))
        tops = sorted(t["logprob"] for t in x["top_logprobs"]), sorted(t["logprob"] for t in y["top_logprobs"])
        assert len(tops[0]) == len(tops[1])
        gap = max([gap, *(abs(p - q) for p, q in zip(*tops))])
    return gap


def processed_reference(direct, prompt_ids: list[int], token_ids: list[int], *, temperature: float,
                        top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """The log-probs of ``token_ids`` under a direct forward pass of base (+ adapter), processed
    the way both servers report them (log-softmax of logits/T after top-k/top-p)."""
    import torch

    from marft_bridge.serving.engine.sampling import processed_logprobs

    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.no_grad():
        logits = direct.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    n = logits.shape[0]
    lp = processed_logprobs(logits, torch.full((n,), float(temperature)), torch.full((n,), top_k),
                            torch.full((n,), float(top_p)))
    out = lp.gather(-1, torch.tensor(token_ids)[:, None])[:, 0].tolist()
    assert all(math.isfinite(x) for x in out), "a served token the reference masks out"
    return out
