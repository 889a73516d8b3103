"""Adapter registry: versioned publish, promote/rollback, manifests, refusal of unsafe adapters, CLI."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from marft_bridge.cli import main as marft
from marft_bridge.serving.adapter_files import AdapterError, inspect_adapter
from marft_bridge.serving.fixtures import make_random_adapter
from marft_bridge.serving.registry import AdapterRegistry


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    return make_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("ad") / "planner", seed=1, rank=4)


def test_publish_creates_versions_with_manifest(tmp_path, adapter_dir, tiny_model_dir):
    reg = AdapterRegistry(tmp_path / "reg")
    v1 = reg.publish("planner", adapter_dir, metrics={"reward": 0.5}, config={"lr": 1e-4})
    v2 = reg.publish("planner", adapter_dir, metrics={"reward": 0.75})
    assert (v1, v2) == (1, 2)
    assert reg.versions("planner") == [1, 2]
    assert sorted(os.listdir(reg.path("planner", 2))) == ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    m = reg.manifest("planner", 1)
    assert m.metrics == {"reward": 0.5} and m.config == {"lr": 1e-4}
    assert m.rank == 4 and m.target_modules == ["q_proj", "v_proj"]
    assert m.base_model == str(tiny_model_dir) and m.base_fingerprint is not None
    assert m.parent is None and reg.manifest("planner", 2).parent is None  # nothing was current yet
    # Same adapter, different training config -> different config hash.
    assert m.config_hash != reg.manifest("planner", 2).config_hash
    assert reg.current("planner") is None


def test_a_manifest_keeps_only_finite_number_metrics(tmp_path, adapter_dir):
    # A trainer without a critic reports value_loss NaN, and per-agent tables: neither is a number to
    # keep, and a NaN written as null made the manifest unreadable (the server then refused the version).
    reg = AdapterRegistry(tmp_path / "reg")
    v = reg.publish("planner", adapter_dir, metrics={"reward_mean": 0.5, "value_loss": float("nan"), "kl": float("inf"),
                                                     "logprob_gap": {"planner": {"mean": 0.0}}, "updates": 3,
                                                     "collapsed": True})
    assert reg.manifest("planner", v).metrics == {"reward_mean": 0.5, "updates": 3.0}


def test_publish_accepts_save_pretrained_layout_with_agent_subdir(tmp_path, adapter_dir):
    src = tmp_path / "trainer_out"
    shutil.copytree(adapter_dir, src / "coder")  # what save_pretrained(selected_adapters=["coder"]) writes
    reg = AdapterRegistry(tmp_path / "reg")
    assert reg.publish("coder", src) == 1


def test_promote_rollback_and_parent(tmp_path, adapter_dir):
    reg = AdapterRegistry(tmp_path / "reg")
    for _ in range(3):
        reg.publish("planner", adapter_dir)
    reg.promote("planner", 1)
    v4 = reg.publish("planner", adapter_dir)
    assert reg.manifest("planner", v4).parent == 1  # parent defaults to the current version
    reg.promote("planner", 3)
    reg.promote("planner", 4)
    assert reg.current("planner") == 4
    assert reg.rollback("planner") == 3
    assert reg.rollback("planner") == 1
    assert reg.current("planner") == 1
    with pytest.raises(AdapterError, match="no earlier promoted version"):
        reg.rollback("planner")
    assert reg.current("planner") == 1
    rows = reg.list()
    assert [(r.manifest.version, r.current) for r in rows] == [(1, True), (2, False), (3, False), (4, False)]
    with pytest.raises(AdapterError, match="no version 9"):
        reg.promote("planner", 9)


def test_resolve_refuses_paths_outside_the_root(tmp_path, adapter_dir):
    reg = AdapterRegistry(tmp_path / "reg")
    reg.publish("planner", adapter_dir)
    assert reg.resolve(reg.path("planner", 1)) == ("planner", 1)
    with pytest.raises(AdapterError, match="outside the registry"):
        reg.resolve(adapter_dir)
    with pytest.raises(AdapterError, match="outside the registry"):
        reg.resolve(str(reg.root / "planner" / os.path.relpath(adapter_dir, reg.root / "planner")))  # ../..
    link = reg.root / "planner" / "v7"
    link.symlink_to(adapter_dir)  # a link inside the root that points out of it
    with pytest.raises(AdapterError, match="outside the registry"):
        reg.resolve(link)
    with pytest.raises(AdapterError, match="not a version directory"):
        reg.resolve(reg.root / "planner")


def test_names_must_match_whole(tmp_path, adapter_dir):
    from marft_bridge.registry_state import state_path
    from marft_bridge.serving.registry import VERSION_DIR, check_agent_name

    reg = AdapterRegistry(tmp_path / "reg")
    for bad in ("planner\n", "planner\r\n", "planner\x00", "plan ner", ".hidden", "a" * 65, "a/b", "a..b"):
        with pytest.raises(AdapterError, match="invalid agent name"):
            reg.publish(bad, adapter_dir)
        with pytest.raises(AdapterError, match="invalid agent name"):
            check_agent_name(bad)
        assert state_path(reg.root, bad) is None
    assert list(reg.root.iterdir()) == []  # "publish('evil\n')" made no directory
    assert VERSION_DIR.match("v1\n") is None and VERSION_DIR.match("v1")
    reg.publish("planner", adapter_dir)
    (reg.root / "planner" / "v2\n").mkdir()  # not a version: a newline after the number
    assert reg.versions("planner") == [1]
    with pytest.raises(AdapterError, match="not a version directory"):
        reg.resolve(reg.root / "planner" / "v2\n")


def test_resolve_refuses_links_out_nul_bytes_and_tampered_weights(tmp_path, adapter_dir):
    reg = AdapterRegistry(tmp_path / "reg")
    v1, v2 = reg.publish("planner", adapter_dir), reg.publish("planner", adapter_dir)
    with pytest.raises(AdapterError, match="does not exist"):
        reg.resolve(str(reg.path("planner", v1)) + "\x00")
    weights = reg.path("planner", v2) / "adapter_model.safetensors"
    weights.unlink()
    weights.symlink_to(adapter_dir / "adapter_model.safetensors")  # the same bytes, outside the registry
    with pytest.raises(AdapterError, match="links to .* outside the registry"):
        reg.resolve(reg.path("planner", v2))
    weights.unlink()
    weights.symlink_to(reg.path("planner", v1) / "adapter_model.safetensors")  # inside it: allowed
    assert reg.resolve(reg.path("planner", v2)) == ("planner", v2)
    (reg.path("planner", v2) / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(AdapterError, match="cannot be read"):
        reg.resolve(reg.path("planner", v2))
    data = (reg.path("planner", v1) / "adapter_model.safetensors").read_bytes()
    config = (reg.path("planner", v1) / "adapter_config.json").read_bytes()
    reg.check_files(reg.path("planner", v1), data, config)
    with pytest.raises(AdapterError, match="adapter_model.safetensors does not match the sha256"):
        reg.check_files(reg.path("planner", v1), data[:-1] + bytes([data[-1] ^ 1]), config)
    with pytest.raises(AdapterError, match="adapter_config.json does not match the sha256"):
        reg.check_files(reg.path("planner", v1), data, config.replace(b'"lora_alpha": ', b'"lora_alpha": 1'))
    manifest = reg.path("planner", v1) / "manifest.json"  # a version published before configs were hashed
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "config_sha256"}))
    reg.check_files(reg.path("planner", v1), data, b"{}")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_adapters_are_refused_at_publish_and_nothing_is_written(tmp_path, adapter_dir):
    import torch
    from safetensors.torch import load_file

    reg = AdapterRegistry(tmp_path / "reg")
    pickled = _copy(adapter_dir, tmp_path / "pickled")
    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    (pickled / "adapter_model.safetensors").unlink()
    corrupt = _copy(adapter_dir, tmp_path / "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    wrong_rank = _copy(adapter_dir, tmp_path / "wrong_rank")
    cfg = json.loads((wrong_rank / "adapter_config.json").read_text())
    cfg["r"] = 8
    (wrong_rank / "adapter_config.json").write_text(json.dumps(cfg))
    dora = _copy(adapter_dir, tmp_path / "dora")
    cfg["r"], cfg["use_dora"] = 4, True
    (dora / "adapter_config.json").write_text(json.dumps(cfg))

    cases = {
        pickled: "only safetensors adapters are accepted",
        corrupt: "is corrupt",
        wrong_rank: "config says r=8",
        dora: "DoRA",
        tmp_path / "missing": "does not exist",
    }
    for path, message in cases.items():
        with pytest.raises(AdapterError, match=message):
            reg.publish("planner", path)
    with pytest.raises(AdapterError, match="invalid agent name"):
        reg.publish("../evil", adapter_dir)
    assert list(reg.root.iterdir()) == []


def test_inspect_reports_modules_and_shapes(adapter_dir):
    info = inspect_adapter(adapter_dir)
    assert info.rank == 4
    assert info.modules["model.layers.0.self_attn.q_proj"] == (64, 64)
    assert info.modules["model.layers.1.self_attn.v_proj"] == (64, 32)  # 2 kv heads x 16
    assert len(info.modules) == 4


def test_cli_publish_promote_rollback_list(tmp_path, adapter_dir, capsys):
    reg = str(tmp_path / "reg")
    assert marft(["adapters", "publish", "planner", str(adapter_dir), "--registry", reg, "--metric", "reward=0.5"]) == 0
    assert marft(["adapters", "publish", "planner", str(adapter_dir), "--registry", reg, "--promote"]) == 0
    assert marft(["adapters", "promote", "planner", "1", "--registry", reg]) == 0
    assert marft(["adapters", "rollback", "planner", "--registry", reg]) == 0
    capsys.readouterr()
    assert marft(["adapters", "list", "--registry", reg, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["version"], r["current"], r["metrics"]) for r in rows] == [(1, False, {"reward": 0.5}), (2, True, {})]
    assert marft(["adapters", "show", "planner", "--registry", reg]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 2
    # A refused adapter: one-line error, exit code 1.
    assert marft(["adapters", "publish", "planner", str(tmp_path / "nope"), "--registry", reg]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert marft(["adapters", "publish", "planner", str(adapter_dir), "--registry", reg, "--metric", "x"]) == 1


def test_concurrent_publish_and_promote(tmp_path, adapter_dir):
    from concurrent.futures import ThreadPoolExecutor

    reg = AdapterRegistry(tmp_path / "reg")
    with ThreadPoolExecutor(8) as pool:
        versions = list(pool.map(lambda _: reg.publish("planner", adapter_dir), range(8)))
    assert sorted(versions) == list(range(1, 9))  # every publisher got its own version directory
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda v: reg.promote("planner", v), versions))
    state = json.loads((reg.root / "planner" / "state.json").read_text())
    assert sorted(state["history"]) == list(range(1, 9)) and state["current"] == state["history"][-1]
