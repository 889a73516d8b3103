"""Hot-swap on a live `marft serve`: swaps under load lose nothing and every response's adapter
version was live when it was served; bad adapters are refused while the old one keeps serving."""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest

from marft_bridge.serving.adapter_files import AdapterError
from marft_bridge.serving.fixtures import DirectModel, make_random_adapter
from marft_bridge.serving.process import ServerProcess
from marft_bridge.serving.publishers import EmbeddedServerPublisher, InProcessPublisher
from marft_bridge.serving.registry import AdapterRegistry

KEY = "swap-key"
MESSAGES = [{"role": "user", "content": "Solve 4+4."}]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    """planner v1..v6 (v1 current) and coder v1, plus the greedy outputs each must produce."""
    tmp = tmp_path_factory.mktemp("hotswap")
    reg = AdapterRegistry(tmp / "registry")
    for seed in range(6):
        reg.publish("planner", make_random_adapter(tiny_model_dir, tmp / f"p{seed}", seed=100 + seed, scale=3.0))
    reg.promote("planner", 1)
    reg.publish("coder", make_random_adapter(tiny_model_dir, tmp / "c", seed=200, scale=3.0), promote=True)
    prompt = DirectModel(tiny_model_dir).chat_prompt(MESSAGES)
    expected = {("planner", v): DirectModel(tiny_model_dir, reg.path("planner", v)).greedy(prompt, MAX_TOKENS)
                for v in range(1, 7)}
    expected[("coder", 1)] = DirectModel(tiny_model_dir, reg.path("coder", 1)).greedy(prompt, MAX_TOKENS)
    # The versions must be distinguishable by their outputs, or the equality checks below prove nothing.
    assert len({tuple(v) for v in expected.values()}) == 7
    return reg, expected, tmp


@pytest.fixture(scope="module")
def server(tiny_model_dir, setup):
    reg = setup[0]
    with ServerProcess(tiny_model_dir, reg.root, api_key=KEY, extra_args=["--threads", "1", "--max-lora-rank", "8"]) as srv:
        yield srv


def test_swaps_under_load(server, setup):
    from openai import OpenAI

    reg, expected, _ = setup
    publisher = EmbeddedServerPublisher(server.url, KEY)
    records, errors, lock = [], [], threading.Lock()
    progress = threading.Semaphore(0)

    def client(agent: str):
        c = OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
        for _ in range(100):
            sent = time.monotonic()
            try:
                r = c.chat.completions.create(model=agent, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"return_token_ids": True}).model_dump()
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                errors.append(repr(e))
                continue
            finally:
                progress.release()
            with lock:
                records.append((agent, sent, time.monotonic(), r["adapter"]["version"], r["choices"][0]["token_ids"]))

    threads = [threading.Thread(target=client, args=(a,)) for a in ("planner", "planner", "planner", "coder")]
    for t in threads:
        t.start()
    # Swap after every 60 finished requests (progress, not wall time), so each version serves some.
    swaps = {1: (float("-inf"), float("-inf"))}
    for version in range(2, 7):
        for _ in range(60):
            progress.acquire()
        began = time.monotonic()
        reg.promote("planner", version, publisher=publisher)
        swaps[version] = (began, time.monotonic())
    for t in threads:
        t.join()

    assert errors == []
    assert len(records) == 400
    seen = set()
    for agent, sent, received, version, tokens in records:
        # Served output equals the direct output of the version the response names...
        assert tokens == expected[(agent, version)], (agent, version)
        if agent == "coder":
            assert version == 1
            continue
        # ...and that version was live at some moment between sending and receiving: it was loaded
        # before the response came back, and not yet replaced when the request went out.
        assert received >= swaps[version][0]
        if version < 6:
            assert sent <= swaps[version + 1][1]
        seen.add(version)
    assert seen == {1, 2, 3, 4, 5, 6}
    assert reg.current("planner") == 6
    after_last = [r for r in records if r[0] == "planner" and r[1] > swaps[6][1]]
    assert after_last and all(r[3] == 6 for r in after_last)


def test_stream_in_flight_finishes_on_its_version(server, setup, tiny_model_dir):
    """A swap issued while a long stream is being generated does not touch that stream."""
    reg, _, _ = setup
    old = reg.current("planner")
    new = 2 if old != 2 else 3
    direct = DirectModel(tiny_model_dir, reg.path("planner", old))
    want = direct.greedy(direct.chat_prompt(MESSAGES), 100)
    body = {"model": "planner", "messages": MESSAGES, "max_tokens": 100, "temperature": 0, "stream": True,
            "return_token_ids": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    versions, tokens, swapped = set(), [], False
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            versions.add(chunk["adapter"]["version"])
            tokens += chunk["choices"][0].get("token_ids", [])
            if not swapped:  # first chunk is out: the stream is in flight; swap now, from another thread
                swapper = threading.Thread(
                    target=reg.promote, args=("planner", new), kwargs={"publisher": EmbeddedServerPublisher(server.url, KEY)})
                swapper.start()
                swapped = True
    swapper.join()
    assert versions == {old}
    assert tokens == want
    assert _planner_output(server)[0] == new


def _planner_output(server):
    r = httpx.post(server.base_url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "planner", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
                         "return_token_ids": True})
    r.raise_for_status()
    return r.json()["adapter"]["version"], r.json()["choices"][0]["token_ids"]


def _fake_version(reg: AdapterRegistry, src, version: int):
    """A version directory placed in the registry by hand (bypassing publish's checks)."""
    dst = reg.root / "planner" / f"v{version}"
    shutil.copytree(src, dst)
    return dst


def test_bad_adapters_refused_old_keeps_serving(server, setup, tiny_model_dir):
    import torch
    from safetensors.torch import load_file

    reg, expected, tmp = setup
    before = _planner_output(server)
    current = reg.current("planner")
    assert before == (current, expected[("planner", current)])
    good = reg.path("planner", current)

    rank16 = reg.publish("planner", make_random_adapter(tiny_model_dir, tmp / "r16", seed=5, rank=16))
    from marft_bridge.demo.tinymodel import build_tiny_model

    other_base = build_tiny_model(tmp / "other_base", seed=1, hidden_size=48)
    wrong_base = reg.publish("planner", make_random_adapter(other_base, tmp / "wb", seed=6))
    same_shape_base = build_tiny_model(tmp / "same_shape", seed=2, num_layers=3)
    wrong_base_fp = reg.publish("planner", make_random_adapter(same_shape_base, tmp / "wbfp", seed=7))
    pickled = _fake_version(reg, good, 90)
    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    (pickled / "adapter_model.safetensors").unlink()
    corrupt = _fake_version(reg, good, 91)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    mismatched = _fake_version(reg, good, 92)
    cfg = json.loads((mismatched / "adapter_config.json").read_text())
    (mismatched / "adapter_config.json").write_text(json.dumps({**cfg, "r": 2}))
    (reg.root / "planner" / "v93").symlink_to(tmp / "p0")  # inside the root, pointing out of it
    linked = _fake_version(reg, good, 94)  # a weights file inside the version, linked out of the registry
    (linked / "adapter_model.safetensors").unlink()
    (linked / "adapter_model.safetensors").symlink_to(tmp / "p0" / "adapter_model.safetensors")
    tampered = _fake_version(reg, good, 95)  # valid weights of the same shape, but not those published
    other = tmp / f"p{current % 6}"  # another version's source (p{k} became v{k + 1})
    shutil.copyfile(other / "adapter_model.safetensors", tampered / "adapter_model.safetensors")
    rescaled = _fake_version(reg, good, 97)  # a config edited after publishing (a valid one: alpha doubled)
    cfg = json.loads((rescaled / "adapter_config.json").read_text())
    (rescaled / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 2 * cfg["lora_alpha"]}))
    no_manifest = _fake_version(reg, good, 96)
    (no_manifest / "manifest.json").write_text("{not json")

    cases = {
        str(pickled): "only safetensors",
        str(corrupt): "corrupt",
        str(reg.path("planner", rank16)): "exceeds the server's --max-lora-rank 8",
        str(mismatched): "config says r=2",
        str(reg.path("planner", wrong_base)): "wrong base model|fingerprint",
        str(reg.path("planner", wrong_base_fp)): "fingerprint",
        str(tmp / "p0"): "outside the registry",
        str(reg.root / "planner" / "v93"): "outside the registry",
        str(reg.root / "planner" / "v99"): "does not exist",
        str(linked): "links to .* outside the registry",
        str(tampered): "adapter_model.safetensors does not match the sha256 in its manifest.json",
        str(rescaled): "adapter_config.json does not match the sha256 in its manifest.json",
        str(no_manifest): "not a readable manifest",
        str(good) + "\x00/evil": "does not exist",  # a NUL byte: the path cannot even be looked up
    }
    publisher = EmbeddedServerPublisher(server.url, KEY)
    for path, message in cases.items():
        with pytest.raises(AdapterError, match=message):
            publisher.load("planner", path)
        assert _planner_output(server) == before, path
    # A name that only looks like the agent's ("planner" and a newline) is refused, not served beside it.
    with pytest.raises(AdapterError, match="invalid agent name"):
        publisher.load("planner\n", good)
    r = httpx.post(server.base_url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "planner\n", "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert _planner_output(server) == before
    # Through the registry: a refused promotion leaves the current version as it was.
    with pytest.raises(AdapterError, match="fingerprint"):
        reg.promote("planner", wrong_base_fp, publisher=publisher)
    assert reg.current("planner") == current
    # Admin endpoints need the key.
    body = {"lora_name": "planner", "lora_path": str(good), "load_inplace": True}
    assert httpx.post(server.base_url + "/load_lora_adapter", json=body).status_code == 401
    assert httpx.post(server.base_url + "/load_lora_adapter", json=body,
                      headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.post(server.base_url + "/unload_lora_adapter", json={"lora_name": "planner"}).status_code == 401
    # Same name without load_inplace is refused, as in vLLM.
    r = httpx.post(server.base_url + "/load_lora_adapter", json={**body, "load_inplace": False},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "load_inplace" in r.json()["error"]["message"]
    assert _planner_output(server) == before


def test_unload_then_requests_get_404_and_reload(server, setup):
    reg, expected, _ = setup
    publisher = EmbeddedServerPublisher(server.url + "/v1", KEY)
    publisher.unload("coder")
    r = httpx.post(server.base_url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "coder", "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(AdapterError, match="not loaded"):
        publisher.unload("coder")
    assert publisher.deploy(reg, "coder") == 1
    r = httpx.post(server.base_url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "coder", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
                         "return_token_ids": True}).json()
    assert r["adapter"] == {"name": "coder", "version": 1}
    assert r["choices"][0]["token_ids"] == expected[("coder", 1)]


def test_in_process_publisher(tiny_model_dir, setup):
    from marft_bridge.serving.engine import AdapterEngine

    reg, expected, _ = setup
    engine = AdapterEngine(tiny_model_dir, registry=reg)
    try:
        # At start the current versions load; the hand-made broken v92 is skipped, the others serve.
        broken = shutil.copytree(reg.path("planner", 1), reg.root / "broken" / "v1")
        cfg = json.loads((broken / "adapter_config.json").read_text())
        (broken / "adapter_config.json").write_text(json.dumps({**cfg, "r": 2}))
        reg.promote("broken", 1)
        report = engine.load_current()
        assert report["planner"] == f"v{reg.current('planner')}" and report["coder"] == "v1"
        assert report["broken"].startswith("skipped v1:") and "config says r=2" in report["broken"]
        assert set(engine.adapters()) == {"planner", "coder"}
        publisher = InProcessPublisher(engine)
        prompt = DirectModel(tiny_model_dir).chat_prompt(MESSAGES)
        for version in (2, 5):
            publisher.deploy(reg, "planner", version)
            res = engine.generate(prompt, adapter="planner", max_tokens=MAX_TOKENS, temperature=0)
            assert (res.version, res.token_ids) == (version, expected[("planner", version)])
        with pytest.raises(AdapterError, match="outside the registry"):
            publisher.load("planner", setup[2] / "p0")
        assert engine.adapters()["planner"][0] == 5
        # Replaced versions are not kept around: the two routed slots and planner's one spare.
        assert len(engine._slots.peft.peft_config) == 3 and engine.stats["swaps_in_place"] == 1
    finally:
        engine.close()


def test_swaps_copy_into_the_agents_spare_slot_when_the_shape_matches(tiny_model_dir, tmp_path):
    from marft_bridge.serving.engine import AdapterEngine

    reg = AdapterRegistry(tmp_path / "registry")
    for seed, rank in ((1, 4), (2, 4), (3, 4), (4, 2)):  # v4 has another LoRA shape
        reg.publish("planner", make_random_adapter(tiny_model_dir, tmp_path / f"p{seed}", seed=seed, rank=rank, scale=3.0))
    reg.publish("coder", make_random_adapter(tiny_model_dir, tmp_path / "c", seed=9, scale=3.0))
    prompt = DirectModel(tiny_model_dir).chat_prompt(MESSAGES)
    expected = {v: DirectModel(tiny_model_dir, reg.path("planner", v)).greedy(prompt, MAX_TOKENS) for v in range(1, 5)}
    assert len({tuple(x) for x in expected.values()}) == 4  # else equal outputs would prove nothing
    engine = AdapterEngine(tiny_model_dir, registry=reg)
    try:
        got = []
        for v in (1, 2, 3, 1, 4, 2):
            engine.load_adapter("planner", reg.path("planner", v), load_inplace=True)
            res = engine.generate(prompt, adapter="planner", max_tokens=MAX_TOKENS, temperature=0)
            got.append((res.version, res.token_ids == expected[v], engine.stats["swaps_in_place"],
                        len(engine._slots.peft.peft_config)))
        assert got == [
            (1, True, 0, 1),  # the first slot
            (2, True, 0, 2),  # a new slot; v1's, unused now, becomes the spare
            (3, True, 1, 2),  # copied into the spare; v2's slot is the spare now
            (1, True, 2, 2),  # and back: still two slots
            (4, True, 2, 2),  # another rank: the spare is dropped, a new slot loaded
            (2, True, 3, 2),  # rank 4 again: copied into v1's old slot, the spare since v4 came
        ]
        engine.load_adapter("coder", reg.path("coder", 1))
        engine.unload_adapter("planner")  # its routed slot and its spare both go
        assert set(engine._slots.peft.peft_config) == {engine._slots.routes["coder"].internal}
    finally:
        engine.close()


def test_cli_promote_and_rollback_swap_the_live_server(server, setup, tiny_model_dir, capsys):
    from marft_bridge.cli import main as marft

    reg, expected, tmp = setup
    args = ["--registry", str(reg.root), "--server", server.url, "--api-key", KEY]
    before = reg.current("planner")
    target = 3 if before != 3 else 4
    assert marft(["adapters", "promote", "planner", str(target), *args]) == 0
    assert _planner_output(server) == (target, expected[("planner", target)])
    assert marft(["adapters", "rollback", "planner", *args]) == 0
    assert _planner_output(server) == (before, expected[("planner", before)])
    # A version the server refuses: one-line error, registry and server unchanged.
    capsys.readouterr()
    r16 = reg.publish("planner", make_random_adapter(tiny_model_dir, tmp / "r16b", seed=9, rank=16))
    assert marft(["adapters", "promote", "planner", str(r16), *args]) == 1
    assert "max-lora-rank" in capsys.readouterr().err
    assert reg.current("planner") == before
    assert _planner_output(server) == (before, expected[("planner", before)])
