"""``marft sft`` training on a tiny real model: each adapter changes only in its own epochs and learns only
from its own agent's actions, the outputs are what ``marft adapters publish`` takes, metrics per agent
and epoch, and a killed run resumed ends with the adapters an uninterrupted run writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from safetensors.torch import load_file
from test_sft import team

from marft_bridge.cli import main as marft
from marft_bridge.serving.adapter_files import find_adapter_dir
from marft_bridge.trainers import supervised
from marft_bridge.trainers.config import MarftConfig
from marft_bridge.trainers.supervised import SftConfig, sft

CFG = MarftConfig(device="cpu", lora_r=4, lora_alpha=8)


def episodes(n: int = 8):
    return [team(k, 1.0) for k in range(n)]


def opts(**kw) -> SftConfig:
    return SftConfig(**{"epochs": 2, "lr": 5e-3, "batch_size": 3, "val_fraction": 0.25, **kw})


def weights(out) -> dict:
    return load_file(str(out / "checkpoint" / "weights.safetensors"))


def part(w: dict, adapter: str) -> dict:
    return {k: v for k, v in w.items() if f".{adapter}." in k}


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(a[k].equal(b[k]) for k in a)


def test_each_adapter_changes_only_in_its_own_epochs(tiny_model_dir, tmp_path):
    init = {n: p.detach().clone() for n, p in supervised.sft_policy(tiny_model_dir, ["planner", "solver"], CFG, 0)
            .model.named_parameters() if "lora_" in n}
    seen = []
    res = sft(episodes(), tiny_model_dir, tmp_path / "run", config=CFG, options=opts(),
              on_epoch=lambda row: seen.append((row["agent"], row["epoch"], weights(tmp_path / "run"))))
    assert [(a, e) for a, e, _ in seen] == [("planner", 1), ("planner", 2), ("solver", 1), ("solver", 2)]
    planner_done = seen[1][2]
    # Through the planner's epochs the solver's adapter is bit-identical to its init, and vice versa after.
    assert all(same(part(w, "solver"), part(init, "solver")) for _, _, w in seen[:2])
    assert not same(part(planner_done, "planner"), part(init, "planner"))
    assert all(same(part(w, "planner"), part(planner_done, "planner")) for _, _, w in seen[2:])
    assert res.examples == {"planner": (6, 2), "solver": (6, 2)}  # 8 episodes, 2 held out (by episode)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["agent"], r["epoch"], r["steps"], r["train_actions"], r["val_actions"]) for r in rows] == [
        (a, e, 2, 6, 2) for a in ("planner", "solver") for e in (1, 2)]
    assert all(0 <= r["val_token_accuracy"] <= 1 and r["val_loss"] > 0 for r in rows)
    assert rows[1]["train_loss"] < rows[0]["train_loss"]  # it learns (5e-3 on 6 tiny actions)
    assert "planner/val_loss" in rows[0] and "solver/val_loss" not in rows[0]  # per-agent curves for marft plot
    for agent in ("planner", "solver"):  # what `marft adapters publish` takes
        d = find_adapter_dir(res.adapters_dir / agent)
        assert sorted(p.name for p in d.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert json.loads((d / "adapter_config.json").read_text())["r"] == 4


def test_an_adapter_learns_only_from_its_own_agents_actions(tiny_model_dir, tmp_path):
    a = sft(episodes(), tiny_model_dir, tmp_path / "a", agents=["planner"], config=CFG, options=opts(epochs=1))
    other = episodes()
    for ep in other:  # the solver's actions say something else entirely
        ep.actions[1].output = ep.actions[1].output.model_copy(update={"text": "nothing to see here"})
    b = sft(other, tiny_model_dir, tmp_path / "b", agents=["planner"], config=CFG, options=opts(epochs=1))
    assert sorted(p.name for p in b.adapters_dir.iterdir() if p.is_dir()) == ["planner"]
    wa = load_file(str(a.adapters_dir / "planner" / "adapter_model.safetensors"))
    wb = load_file(str(b.adapters_dir / "planner" / "adapter_model.safetensors"))
    assert same(wa, wb)
    # The RL trainer starts from them (what --init-adapters does): its planner adapter is the SFT one.
    from marft_bridge.trainers.marft import MarftTrainer

    tr = MarftTrainer(CFG.model_copy(update={"ppo_epochs": 1}), tiny_model_dir, ["planner"])
    tr.load_adapters(a.adapters_dir)
    from peft import get_peft_model_state_dict

    assert same(get_peft_model_state_dict(tr.policy.model, adapter_name="planner"), wa)


def test_resume_after_a_crash_mid_epoch_ends_as_an_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch):
    full = sft(episodes(), tiny_model_dir, tmp_path / "full", config=CFG, options=opts())
    calls = {"n": 0}
    real = supervised.action_nll

    def crash(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 5:  # 3 passes an epoch (2 steps, 1 val): inside the planner's second epoch
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(supervised, "action_nll", crash)
    with pytest.raises(KeyboardInterrupt):
        sft(episodes(), tiny_model_dir, tmp_path / "run", config=CFG, options=opts())
    monkeypatch.setattr(supervised, "action_nll", real)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1
    resumed = sft(episodes(), tiny_model_dir, tmp_path / "run", config=CFG, options=opts(), resume=True)
    assert resumed.metrics == full.metrics
    for agent in ("planner", "solver"):
        assert same(load_file(str(resumed.adapters_dir / agent / "adapter_model.safetensors")),
                    load_file(str(full.adapters_dir / agent / "adapter_model.safetensors")))
    with pytest.raises(Exception, match="from another run"):  # other options: refused, not mixed
        sft(episodes(), tiny_model_dir, tmp_path / "run", config=CFG, options=opts(lr=1e-3), resume=True)


def test_resume_after_kill_9(tiny_model_dir, tmp_path):
    """A real SIGKILL right after the planner's second epoch is on disk; the resumed run finishes the solver."""
    eps = tmp_path / "eps.jsonl"
    eps.write_text("".join(ep.to_json() + "\n" for ep in episodes()))
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_sft_train import CFG, opts
        from marft_bridge.trainers.sources import read_jsonl
        from marft_bridge.trainers.supervised import sft
        def kill(row):
            if row["agent"] == "planner" and row["epoch"] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        sft(read_jsonl({str(eps)!r})[0], {str(tiny_model_dir)!r}, {str(tmp_path / "run")!r}, config=CFG,
            options=opts(), on_epoch=kill)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    state = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())
    assert state["done"] == [["planner", 1], ["planner", 2]]
    resumed = sft(episodes(), tiny_model_dir, tmp_path / "run", config=CFG, options=opts(), resume=True)
    assert [(r["agent"], r["epoch"]) for r in resumed.metrics] == [
        ("planner", 1), ("planner", 2), ("solver", 1), ("solver", 2)]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 4


def test_cli_help_and_a_run(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        marft(["sft", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--store", "--episodes", "--base-model", "--out", "--agents", "--min-reward", "--per-agent-reward",
                 "--source", "--since", "--epochs", "--lr", "--val-fraction", "--config", "--resume"):
        assert flag in text
    eps = tmp_path / "eps.jsonl"
    eps.write_text("".join(ep.to_json() + "\n" for ep in episodes(4)) + '{"not": "an episode"}\n')
    common = ["sft", "--episodes", str(eps), "--base-model", str(tiny_model_dir), "--device", "cpu", "--no-progress"]
    assert marft(common + ["--out", str(tmp_path / "out"), "--epochs", "1", "--agents", "solver",
                           "--min-reward", "0.5"]) == 0
    err = capsys.readouterr().err
    assert "1 bad records skipped" in err and "solver epoch 1: train loss" in err
    assert "--keys solver/train_loss,solver/val_loss" in err
    assert sorted(p.name for p in (tmp_path / "out" / "adapters").iterdir() if p.is_dir()) == ["solver"]
    assert marft(common + ["--out", str(tmp_path / "o2"), "--agents", "critic"]) == 1
    assert "marft: error: unknown agent or adapter 'critic'" in capsys.readouterr().err
