"""One request's fault stays with it: bad requests beside in-flight seeded streams leave those
streams' tokens exactly as in a run without them; a fault in the worker loop fails the requests in
flight, the worker restarts and /health says so; a seed samples the same tokens alone or batched."""

from __future__ import annotations

import math
import threading

import httpx
import pytest

from marft_bridge.serving.engine import AdapterEngine, GenerationRequest, WorkerFault
from marft_bridge.serving.fixtures import AppServer, DirectModel, make_random_adapter
from marft_bridge.serving.registry import AdapterRegistry

GOOD = [  # (prompt, adapter, seed): sampled at temperature 1, so the tokens depend on each seed's stream
    (list(range(10, 19)), "planner", 1),
    (list(range(30, 35)), None, 2),
    (list(range(40, 52)), "planner", 3),
]


@pytest.fixture(scope="module")
def registry(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("isolation")
    reg = AdapterRegistry(tmp / "registry")
    reg.publish("planner", make_random_adapter(tiny_model_dir, tmp / "planner", seed=21, scale=2.0), promote=True)
    return reg


@pytest.fixture
def engine(tiny_model_dir, registry):
    eng = AdapterEngine(tiny_model_dir, registry=registry, batch_wait_s=0.0)
    eng.load_current()
    yield eng
    eng.close()


class Collector:
    """Events of one request: tokens, the result or the error; ``on_token(n)`` runs after the n-th token."""

    def __init__(self, on_token=None):
        self.tokens, self.result, self.error, self.on_token = [], None, None, on_token
        self.done = threading.Event()

    def __call__(self, kind, payload):
        if kind == "token":
            self.tokens.append(payload.token_id)
            if self.on_token:
                self.on_token(len(self.tokens))
        elif kind == "done":
            self.result = payload
            self.done.set()
        elif kind == "error":
            self.error = payload
            self.done.set()


def run_good(engine, on_first_token=None, max_tokens=40):
    """Submit the GOOD requests together; ``on_first_token`` runs in the worker after the first one's
    3rd token, i.e. while all of them are in flight."""
    sinks = []
    for i, (prompt, adapter, seed) in enumerate(GOOD):
        hook = (lambda n: on_first_token() if n == 3 else None) if i == 0 and on_first_token else None
        sinks.append(Collector(hook))
        engine.submit(GenerationRequest(prompt_ids=prompt, adapter=adapter, max_tokens=max_tokens, temperature=1.0,
                                        seed=seed, sink=sinks[-1]))
    for s in sinks:
        assert s.done.wait(60)
    return sinks


def test_bad_requests_fail_alone_and_leave_in_flight_streams_bit_for_bit(engine):
    alone = run_good(engine)
    assert all(s.error is None and len(s.tokens) >= 5 for s in alone)  # long enough to be in flight
    bad = {  # each fails at another stage in the worker (the HTTP boundary refuses all of these earlier)
        "admission": dict(stop=[7]),  # the row's setup raises TypeError
        "sampling": dict(temperature=math.nan),  # multinomial refuses NaN probabilities
        "detokenising": dict(stop=[b"zz"]),  # str.find(bytes) raises on the first token
    }
    bad_sinks = {k: Collector() for k in bad}

    def inject():  # called in the worker thread, mid-stream: the bad ones join the running batch
        for k, kw in bad.items():
            engine.submit(GenerationRequest(prompt_ids=list(range(60, 66)), adapter="planner", max_tokens=10,
                                            seed=9, sink=bad_sinks[k], **kw))

    beside = run_good(engine, on_first_token=inject)
    for s in bad_sinks.values():
        assert s.done.wait(60)
    assert isinstance(bad_sinks["admission"].error, TypeError) and bad_sinks["admission"].tokens == []
    assert isinstance(bad_sinks["sampling"].error, RuntimeError) and bad_sinks["sampling"].tokens == []
    assert isinstance(bad_sinks["detokenising"].error, TypeError)
    for a, b in zip(alone, beside):
        assert b.error is None
        assert b.tokens == a.tokens and b.result.token_ids == a.result.token_ids
        assert b.result.logprobs == pytest.approx(a.result.logprobs, abs=1e-5)
    assert engine.stats["request_failures"] == 3
    assert engine.health()["worker_restarts"] == 0
    assert engine.stats["batches"] >= 3  # the bad ones were admitted while the good ones ran


def test_a_seed_samples_the_same_tokens_alone_or_batched(engine):
    prompt, adapter, seed = GOOD[2]

    def one(**kw):
        return engine.generate(prompt, adapter=adapter, max_tokens=30, temperature=0.9, top_k=20, seed=seed, **kw)

    alone = one()
    others = [Collector() for _ in range(5)]
    started = threading.Event()
    result = {}

    def later(n):  # the seeded request joins a running batch of five others mid-flight
        if n == 2 and not started.is_set():
            started.set()
            engine.submit(GenerationRequest(prompt_ids=prompt, adapter=adapter, max_tokens=30, temperature=0.9,
                                            top_k=20, seed=seed, sink=lambda k, p: result.setdefault("r", p) if k == "done" else None))

    for i, c in enumerate(others):
        c.on_token = later if i == 0 else None
        engine.submit(GenerationRequest(prompt_ids=list(range(20 + i, 28 + 2 * i)), adapter=adapter if i % 2 else None,
                                        max_tokens=40, temperature=1.0, seed=100 + i, sink=c))
    for c in others:
        assert c.done.wait(60)
    assert started.is_set() and "r" in result
    assert result["r"].token_ids == alone.token_ids
    assert len({tuple(c.tokens) for c in others}) == 5  # the batch-mates really sampled differently


def test_worker_fault_fails_in_flight_requests_restarts_and_health_reports_it(engine, tiny_model_dir, registry):
    from marft_bridge.serving.http.server import create_app

    calls = {"n": 0}

    def fail_on_tenth_forward(module, args, kwargs):  # a fault inside the loop's decode step
        calls["n"] += 1
        if calls["n"] == 10:
            raise RuntimeError("injected forward fault")

    handle = engine.base_model.register_forward_pre_hook(fail_on_tenth_forward, with_kwargs=True)
    try:
        with AppServer(create_app(engine)) as srv:
            body = {"model": "planner", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30,
                    "temperature": 0}
            r = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=60)
            assert r.status_code == 500
            err = r.json()["error"]
            assert err["type"] == "server_error" and "injected forward fault" in err["message"]
            assert "restarted" in err["message"]
            health = httpx.get(srv.base_url.removesuffix("/v1") + "/health").json()
            assert health["status"] == "ok" and health["worker_alive"] is True
            assert health["worker_restarts"] == 1 and "injected forward fault" in health["last_worker_fault"]["error"]
            # The restarted worker serves again, exactly.
            r = httpx.post(srv.base_url + "/chat/completions", json={**body, "return_token_ids": True}, timeout=60)
            assert r.status_code == 200
            direct = DirectModel(tiny_model_dir, registry.path("planner"))
            want = direct.greedy(direct.chat_prompt(body["messages"]), 30)
            assert r.json()["choices"][0]["token_ids"] == want
    finally:
        handle.remove()


def test_worker_fault_reaches_in_process_callers(engine):
    calls = {"n": 0}

    def fail_once(module, args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")

    handle = engine.base_model.register_forward_pre_hook(fail_once)
    try:
        with pytest.raises(WorkerFault, match="boom"):
            engine.generate(list(range(10, 20)), max_tokens=20, temperature=0)
        assert engine.generate(list(range(10, 20)), max_tokens=3, temperature=0).finish_reason == "length"
    finally:
        handle.remove()


def test_a_prompt_whose_prefill_fails_fails_alone_in_its_group(tiny_model_dir, registry):
    """Requests arriving together are prefilled as one group; when that fails, each is prefilled
    alone, so only the one the model cannot take fails and the others equal their runs alone."""
    marker = 99

    def refuse_marker(module, args, kwargs):  # a prompt this model "cannot process"
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1 and bool((ids == marker).any()):
            raise RuntimeError("cannot prefill this prompt")

    eng = AdapterEngine(tiny_model_dir, registry=registry, max_batch_size=4, batch_wait_s=0.0)
    try:
        eng.load_current()
        alone = [eng.generate(p, adapter=a, max_tokens=12, temperature=1.0, seed=s) for p, a, s in GOOD]
        eng.batch_wait_s = 30.0  # the next four arrive as one group (the batch size ends the wait)
        handle = eng.base_model.register_forward_pre_hook(refuse_marker, with_kwargs=True)
        sinks = [Collector() for _ in range(4)]
        bad = list(range(60, 66)) + [marker]
        for (prompt, adapter, seed), sink in zip([*GOOD, (bad, "planner", 4)], sinks):
            eng.submit(GenerationRequest(prompt_ids=prompt, adapter=adapter, max_tokens=12, temperature=1.0, seed=seed,
                                         sink=sink))
        for s in sinks:
            assert s.done.wait(60)
        handle.remove()
        assert isinstance(sinks[3].error, RuntimeError) and "cannot prefill" in str(sinks[3].error)
        assert [s.result.token_ids for s in sinks[:3]] == [r.token_ids for r in alone]
        assert eng.stats["request_failures"] == 1 and eng.health()["worker_restarts"] == 0
    finally:
        eng.close()
