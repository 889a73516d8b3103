"""Hostile adapters and requests against a live `marft serve`: an adapter config peft refuses, a
lora_alpha whose scale overflows, tool-call arguments nested past the recursion limit. Each is
refused (by `publish`, or with a 4xx) and changes nothing else; the server starts and keeps serving."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil

import httpx
import openai
import pytest

from marft_bridge.serving.adapter_files import CONFIG_FILE, AdapterError
from marft_bridge.serving.fixtures import make_random_adapter
from marft_bridge.serving.process import ServerProcess
from marft_bridge.serving.registry import MANIFEST_FILE, AdapterRegistry, read_manifest

KEY = "hostile-key"
H = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "hi"}]
# Config edits each refused, and the words the refusal must carry.
BAD_CONFIGS = {
    "task_type": ({"task_type": "NOPE"}, "Invalid task type"),
    "layers_pattern": ({"layers_pattern": "layers"}, "layers_to_transform"),
    "alpha_overflows": ({"lora_alpha": 1e308}, "overflows torch.float32"),
    "alpha_bool": ({"lora_alpha": True}, "not a finite number"),
}


def _with_config(src, dst, update: dict):
    dst = shutil.copytree(src, dst)
    cfg = json.loads((dst / CONFIG_FILE).read_text())
    (dst / CONFIG_FILE).write_text(json.dumps({**cfg, **update}))
    return dst


def _published_before_vetting(reg: AdapterRegistry, agent: str, src, update: dict) -> int:
    """A version as the registry held it before this vetting: a good adapter published, then its
    config edited and the manifest's config hash made to match (so only the new checks refuse it)."""
    version = reg.publish(agent, src)
    path = reg.path(agent, version)
    _with_config(path, path.parent / "edit", update)
    shutil.copyfile(path.parent / "edit" / CONFIG_FILE, path / CONFIG_FILE)
    shutil.rmtree(path.parent / "edit")
    manifest = read_manifest(path).model_copy(
        update={"config_sha256": hashlib.sha256((path / CONFIG_FILE).read_bytes()).hexdigest()})
    (path / MANIFEST_FILE).write_text(manifest.model_dump_json())
    return version


@pytest.fixture(scope="module")
def good(tiny_model_dir, tmp_path_factory):
    return make_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("good") / "ad", seed=4)


@pytest.fixture(scope="module")
def hostile(tiny_model_dir, good, tmp_path_factory):
    """planner v1 good; v2.. the BAD_CONFIGS, with the first of them current; coder v1 good and current."""
    reg = AdapterRegistry(tmp_path_factory.mktemp("hostile") / "registry")
    reg.publish("coder", good, promote=True)
    reg.publish("planner", good)
    bad = {tag: _published_before_vetting(reg, "planner", good, upd) for tag, (upd, _) in BAD_CONFIGS.items()}
    reg.promote("planner", bad["task_type"])
    with ServerProcess(tiny_model_dir, reg.root, api_key=KEY, extra_args=["--threads", "1"]) as srv:
        yield srv, reg, bad


@pytest.mark.parametrize("tag", [*BAD_CONFIGS, "alpha_text", "loftq"])
def test_publish_refuses_what_the_engine_cannot_serve(good, tmp_path, tag):
    update, words = BAD_CONFIGS.get(tag, ({"lora_alpha": "x"}, "not a finite number"))
    if tag == "loftq":
        if importlib.util.find_spec("scipy") is not None:
            pytest.skip("scipy is installed: peft accepts init_lora_weights='loftq' then")
        update, words = {"init_lora_weights": "loftq"}, "scipy"
    reg = AdapterRegistry(tmp_path / "registry")
    with pytest.raises(AdapterError, match=words):
        reg.publish("planner", _with_config(good, tmp_path / "bad", update))
    assert reg.versions("planner") == []


def test_a_bad_current_version_is_skipped_at_start(hostile):
    srv, _, bad = hostile
    # The server started (the fixture) and serves the others; the log says why planner is not served.
    assert f"planner skipped v{bad['task_type']}" in srv.log_tail(20000)
    assert "Invalid task type" in srv.log_tail(20000)
    models = {m["id"] for m in httpx.get(srv.base_url + "/models", headers=H).json()["data"]}
    assert "coder" in models and "planner" not in models


@pytest.mark.parametrize("tag", list(BAD_CONFIGS))
def test_load_refuses_and_the_old_version_keeps_serving(hostile, tag):
    srv, reg, bad = hostile
    load = {"lora_name": "planner", "load_inplace": True}
    r = httpx.post(srv.base_url + "/load_lora_adapter", headers=H, timeout=60,
                   json={**load, "lora_path": str(reg.path("planner", 1))})
    assert r.status_code == 200, r.text
    r = httpx.post(srv.base_url + "/load_lora_adapter", headers=H, timeout=60,
                   json={**load, "lora_path": str(reg.path("planner", bad[tag]))})
    assert r.status_code == 400 and BAD_CONFIGS[tag][1] in r.json()["error"]["message"], r.text
    client = openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)
    out = client.chat.completions.create(model="planner", messages=MESSAGES, max_tokens=3, logprobs=True)
    assert out.model_dump()["adapter"] == {"name": "planner", "version": 1}
    assert all(abs(t.logprob) < float("inf") for t in out.choices[0].logprobs.content)


@pytest.mark.parametrize("depth, param, words", [
    (500, "messages", "too deeply for the chat template"),  # parses, but the template recurses past the limit
    (5000, "messages.1.tool_calls.0.function.arguments", "too deeply to parse"),  # json.loads does
])
def test_deeply_nested_tool_call_arguments_are_a_400(hostile, depth, param, words):
    srv = hostile[0]
    client = openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)
    messages = [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * depth + "]" * depth}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="coder", messages=messages, max_tokens=2)
    err = e.value.body
    assert (err["type"], err["param"]) == ("invalid_request_error", param) and words in err["message"]
    assert client.chat.completions.create(model="coder", messages=MESSAGES, max_tokens=2).choices


def test_the_engine_checks_overflow_in_the_dtype_it_runs(tiny_model_dir, good, tmp_path):
    from marft_bridge.serving.engine import AdapterEngine

    # Its delta bound (~1e6) fits float32, so publish takes it, but not float16 (max 65504).
    reg = AdapterRegistry(tmp_path / "registry")
    version = reg.publish("planner", _with_config(good, tmp_path / "big", {"lora_alpha": 1e6}), promote=True)
    engine = AdapterEngine(tiny_model_dir, registry=reg, dtype="float16")
    try:
        with pytest.raises(AdapterError, match="overflows torch.float16"):
            engine.load_adapter("planner", reg.path("planner", version))
        assert engine.load_current()["planner"].startswith(f"skipped v{version}:")
        assert engine.adapters() == {}
    finally:
        engine.close()
