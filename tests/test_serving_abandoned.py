"""Abandoned requests stop generating. In the engine a cancelled request leaves the queue at once
and the running batch before the next decode step, the rows beside it untouched; on a live
`marft serve` 32 clients that hang up on 1,000-token requests (streamed and not) are cancelled, and a
short request sent right after them waits only a few decode steps (counted by the engine, not timed);
a full queue answers 429 with Retry-After, streamed or not, and serves again once there is room."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from test_engine_isolation import Collector

from marft_bridge.serving.engine import AdapterEngine, GenerationRequest
from marft_bridge.serving.engine.types import QueueFull
from marft_bridge.serving.process import ServerProcess

KEY = "abandon-key"
MSG = [{"role": "user", "content": "hi"}]
LETTERS = list("abcdefgh")  # sampled only among these (no end-of-sequence): every request runs its max_tokens


@pytest.fixture(scope="module")
def letters(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids(LETTERS)


def test_a_cancelled_request_leaves_the_batch_before_the_next_decode_step(tiny_model_dir, letters):
    engine = AdapterEngine(tiny_model_dir, max_batch_size=2, batch_wait_s=0.0)
    try:
        kw = dict(max_tokens=40, temperature=1.0, allowed_token_ids=letters)
        alone = engine.generate(list(range(10, 20)), seed=1, **kw)
        rows_per_step = []  # the batch size of every decode step (one new token per row)
        hook = engine.base_model.register_forward_pre_hook(
            lambda m, a, k: rows_per_step.append(k["input_ids"].shape[0]) if k["input_ids"].shape[1] == 1 else None,
            with_kwargs=True)
        engine.batch_wait_s = 30.0  # the next two are prefilled together (the batch size ends the wait)
        kept = Collector()
        gone = GenerationRequest(prompt_ids=list(range(30, 36)), seed=2, **kw)
        # Cancelled from its own sink, in the worker, as its 5th token is sampled (mid-step).
        gone.sink = cancelled = Collector(on_token=lambda n: engine.cancel(gone) if n == 5 else None)
        engine.submit(GenerationRequest(prompt_ids=list(range(10, 20)), seed=1, sink=kept, **kw))
        engine.submit(gone)
        assert kept.done.wait(60)
        hook.remove()
        # Tokens 2..5 of the cancelled row came from decode steps 1..4; step 5 ran without it.
        assert rows_per_step == [2] * 4 + [1] * 35
        assert len(cancelled.tokens) == 5 and cancelled.result is None and cancelled.error is None
        assert kept.result.token_ids == alone.token_ids  # its batch-mate leaving changed nothing
        assert engine.health()["requests_cancelled"] == 1
    finally:
        engine.close()


def test_a_cancelled_waiting_request_frees_its_queue_place_at_once(tiny_model_dir, letters):
    engine = AdapterEngine(tiny_model_dir, max_batch_size=1, batch_wait_s=0.0, max_queued=1)
    try:
        kw = dict(temperature=1.0, allowed_token_ids=letters)
        running = GenerationRequest(prompt_ids=list(range(10, 20)), max_tokens=1000, sink=Collector(), **kw)
        engine.submit(running)
        while not running.sink.tokens:  # the worker has it: the next one waits (one row per batch)
            time.sleep(0.01)
        waiting = GenerationRequest(prompt_ids=list(range(20, 30)), max_tokens=5, sink=Collector(), **kw)
        engine.submit(waiting)
        third = GenerationRequest(prompt_ids=list(range(30, 40)), max_tokens=3, sink=Collector(), **kw)
        with pytest.raises(QueueFull, match="max_queued 1"):
            engine.submit(third)
        engine.cancel(waiting)  # its place is free now, before the worker ever looks at the queue again
        assert engine.health()["requests_waiting"] == 0 and engine.health()["requests_cancelled"] == 1
        engine.submit(third)
        engine.cancel(running)
        assert third.sink.done.wait(60) and len(third.sink.result.token_ids) == 3
        assert waiting.sink.tokens == [] and not waiting.sink.done.is_set()  # never ran
        assert len(running.sink.tokens) < 1000 and running.sink.result is None
        assert engine.health()["requests_cancelled"] == 2
    finally:
        engine.close()


def raw_post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


def long_request(letters: list[int]) -> dict:
    return {"model": "base", "messages": MSG, "max_tokens": 1000, "temperature": 1.0, "allowed_token_ids": letters}


def connect_and_send(server, body: dict) -> socket.socket:
    s = socket.create_connection((server.host, server.port), timeout=60)
    s.sendall(raw_post("/v1/chat/completions", body))
    return s


def health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=60).json()


def wait_for(server, condition, what: str) -> dict:
    deadline = time.monotonic() + 120  # a bound for a loaded machine, not a measurement
    while time.monotonic() < deadline:
        h = health(server)
        if condition(h):
            return h
        time.sleep(0.05)
    raise AssertionError(f"the server never reached: {what}; last /health {h}")


def serving(tiny_model_dir, tmp_path_factory, *args: str) -> ServerProcess:
    """`marft serve` on the base model alone (an empty registry), taking 1,000-token requests."""
    reg = tmp_path_factory.mktemp("abandon") / "registry"
    return ServerProcess(tiny_model_dir, reg, api_key=KEY, extra_args=["--threads", "1", "--max-tokens-limit", "1000",
                                                                       *args])


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serving(tiny_model_dir, tmp_path_factory, "--max-batch-size", "16", "--max-queued", "64") as srv:
        yield srv


def test_abandoned_requests_stop_and_a_short_request_after_them_waits_a_few_steps(server, letters):
    long = long_request(letters)
    clients = [connect_and_send(server, {**long, "stream": i % 2 == 0}) for i in range(32)]
    # 16 generating, 16 waiting for a slot, each asking for 1,000 tokens.
    wait_for(server, lambda h: h["requests_running"] == 16 and h["requests_waiting"] == 16 and h["decode_steps"] > 0,
             "16 running and 16 waiting")
    time.sleep(0.5)  # the clients give up after half a second
    for s in clients:
        s.close()
    before = health(server)
    r = httpx.post(server.base_url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"model": "base", "messages": MSG, "max_tokens": 4, "temperature": 0,
                         "allowed_token_ids": letters})
    after = health(server)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    # Its 4 tokens are a prefill and 3 decode steps; the abandoned rows ran at most a few steps
    # more (their hang-ups reach the server as the short request does) — not the ~1,000 they asked for.
    steps = after["decode_steps"] - before["decode_steps"]
    abandoned_tokens = after["tokens_generated"] - before["tokens_generated"] - 4
    assert steps <= 3 + 4 and abandoned_tokens <= 16 * 4, (steps, abandoned_tokens)
    done = wait_for(server, lambda h: h["requests_cancelled"] == 32, "all 32 cancelled")
    assert done["requests_running"] == 0 and done["requests_waiting"] == 0
    assert done["tokens_generated"] < 16 * 1000 // 2  # the 16 that ran stopped early; the 16 queued never started


@pytest.fixture(scope="module")
def small_queue(tiny_model_dir, tmp_path_factory):
    with serving(tiny_model_dir, tmp_path_factory, "--max-batch-size", "1", "--max-queued", "1") as srv:
        yield srv


def test_a_full_queue_answers_429_with_retry_after(small_queue, letters):
    import openai

    long = long_request(letters)
    running = connect_and_send(small_queue, long)
    wait_for(small_queue, lambda h: h["requests_running"] == 1, "one running")
    waiting = connect_and_send(small_queue, {**long, "stream": True})
    wait_for(small_queue, lambda h: h["requests_waiting"] == 1, "one waiting")
    client = openai.OpenAI(base_url=small_queue.base_url, api_key=KEY, max_retries=0)
    for stream in (False, True):  # a streamed request is refused before its stream starts
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model="base", messages=MSG, max_tokens=2, stream=stream)
        assert e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "queue_full" and "max_queued 1" in e.value.body["message"]
    running.close()
    waiting.close()
    wait_for(small_queue, lambda h: h["requests_cancelled"] == 2 and h["requests_running"] == 0, "both cancelled")
    r = client.chat.completions.create(model="base", messages=MSG, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2  # room again
