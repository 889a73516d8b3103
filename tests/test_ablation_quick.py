"""benchmarks/marft_ablation.py --quick: every arm runs through the captured graph, the table and
the PNG are written, and the arms are paired (same J_0, same optimiser steps per sample)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("langgraph")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "marft_ablation.py"


def _script():
    spec = importlib.util.spec_from_file_location("marft_ablation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return str(tmp_path_factory.mktemp("models"))  # the quick warm start, built once for the module


def test_quick_ablation_writes_a_paired_table_and_curves(tmp_path, models, capsys):
    report = _script().main(["--quick", "--workers", "1", "--out", str(tmp_path / "out"), "--model-cache", models])
    out = tmp_path / "out"
    assert (out / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / "results.json").read_text())
    assert saved["table"] == json.loads(json.dumps(report["table"]))
    arms = ["untrained", "marft_a", "independent", "shared", "happo", "marft_a_rerollout"]
    assert list(saved["table"]) == arms
    s = saved["settings"]
    for runs in saved["runs"]:
        by_arm = {r["arm"]: r for r in runs}
        assert list(by_arm) == arms
        j0 = by_arm["untrained"]["j"][0]
        for r in runs:
            assert len(r["j"]) == s["iterations"] + 1 and all(0.0 <= j <= 1.0 for j in r["j"])
            assert r["j"][0] == pytest.approx(j0, abs=1e-9)  # adapters start as the identity
        assert set(by_arm["untrained"]["j"]) == {j0}
        # 2 agents x 2 epochs x 1 minibatch per update, vs 1 group x 2 epochs x 2 minibatches; the
        # rerollout arm updates each agent once per iteration, on its half of the episodes
        steps = {a: by_arm[a]["optimizer_steps"] for a in arms[1:]}
        assert steps == {a: 2 * 2 * s["iterations"] for a in arms[1:]}
        assert {a: by_arm[a]["episodes"] for a in arms[1:]} == {a: s["iterations"] * s["episodes"] for a in arms[1:]}
        assert len(by_arm["marft_a"]["train_reward"]) == s["iterations"]
        assert len(by_arm["marft_a_rerollout"]["train_reward"]) == 2 * s["iterations"]  # one update per agent
        for d in by_arm["marft_a"]["diagnostics"]:
            assert set(d[0]["per_agent"]) == {"encoder", "decoder"}
            assert {"kl_step", "m_q05", "m_q50", "m_q95", "clipfrac"} <= set(d[0]["per_agent"]["decoder"])
    comps = saved["comparisons"]["auc"]
    assert set(comps) == {"marft_a - independent", "marft_a - shared", "independent - shared",
                          "happo - independent", "happo - marft_a", "marft_a_rerollout - marft_a"}
    for c in comps.values():
        assert c["lo"] <= c["mean"] <= c["hi"] and c["n"] == 2
    printed = capsys.readouterr().out
    assert "| MARFT-A |" in printed and "paired difference, auc" in printed


def test_quick_runs_reproduce_their_curves(tmp_path, models):
    main = _script().main
    args = ["--quick", "--workers", "1", "--model-cache", models, "--arms", "marft_a"]
    first = main(args + ["--out", str(tmp_path / "a")])
    second = main(args + ["--out", str(tmp_path / "b")])
    assert [r["j"] for runs in first["runs"] for r in runs] == [r["j"] for runs in second["runs"] for r in runs]
    # --compare-with: another invocation's runs on the same seeds join as ARM@LABEL, paired with ARM
    joined = main(args + ["--out", str(tmp_path / "c"), "--from-runs", str(tmp_path / "a" / "runs.jsonl"),
                          "--compare-with", f"again={tmp_path / 'b' / 'runs.jsonl'}"])
    assert list(joined["table"]) == ["marft_a", "marft_a@again"]
    c = joined["comparisons"]["auc"]["marft_a@again - marft_a"]
    assert (c["mean"], c["n"]) == (0.0, 2)
    assert joined["lrs"]["marft_a@again"] == first["lrs"]["marft_a"]


def test_a_learning_rate_or_a_grid_is_required(tmp_path):
    with pytest.raises(SystemExit, match="pass --lr"):
        _script().main(["--hops", "2", "--seeds", "1", "--iterations", "1",
                        "--out", str(tmp_path / "out"), "--model-cache", str(tmp_path / "models")])


def test_quick_lr_grid_in_the_large_step_regime(tmp_path, capsys):
    report = _script().main(["--quick", "--workers", "1", "--arms", "untrained", "marft_a", "happo",
                             "--lr-grid", "2e-3", "5e-3", "--masked", "--warm-start", "miscoordinated",
                             "--epochs", "3", "--minibatches", "2", "--target-kl", "0.05", "--factor-clip", "null",
                             "--out", str(tmp_path / "out"), "--model-cache", str(tmp_path / "models")])
    grid = report["lr_grid"]
    assert grid["seeds"] == [1000, 1001] and report["seeds"] == [0, 1]  # tuning and evaluation disjoint
    assert set(grid["response"]) == {"marft_a", "happo"} and set(grid["response"]["happo"]) == {"0.002", "0.005"}
    assert report["lrs"] == grid["chosen"]
    for a, lr in grid["chosen"].items():  # the chosen rate has the best mean tuning AUC
        assert grid["response"][a][str(lr)]["auc"]["mean"] == max(r["auc"]["mean"] for r in grid["response"][a].values())
    st = report["settings"]
    assert (st["epochs"], st["minibatches"], st["target_kl"], st["masked"], st["factor_clip"]) == (3, 2, 0.05, True, None)
    assert report["warm_start"]["mix"] == "miscoordinated"
    for runs in report["runs"]:
        for r in runs[1:]:
            assert len(r["valid_mass"]) == st["iterations"] + 1 and all(0 < m <= 1 + 1e-9 for v in r["valid_mass"] for m in v)
            assert r["optimizer_steps"] <= 2 * 3 * 2 * 2  # early stops can only remove steps
    printed = capsys.readouterr().out
    assert "lr-response on tuning seeds 1000..1001" in printed and "selection noise" in printed


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        _script().parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--lr-grid", "--tuning-seeds", "--warm-start", "--masked", "--epochs", "--minibatches",
                 "--target-kl", "--factor-clip", "--hops", "Pre-declared headline protocol"):
        assert flag in text
