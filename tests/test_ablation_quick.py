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
    arms = ["untrained", "marft_a", "independent", "shared"]
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
        # 2 agents x 2 epochs x 1 minibatch per update, vs 1 group x 2 epochs x 2 minibatches
        steps = {a: by_arm[a]["optimizer_steps"] for a in arms[1:]}
        assert steps == {a: 2 * 2 * s["iterations"] for a in arms[1:]}
        assert len(by_arm["marft_a"]["train_reward"]) == s["iterations"]
    comps = saved["comparisons"]["auc"]
    assert set(comps) == {"marft_a - independent", "marft_a - shared", "independent - shared"}
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


def test_frozen_learning_rates_are_required(tmp_path):
    with pytest.raises(SystemExit, match="run --tune first"):
        _script().main(["--hops", "2", "--seeds", "1", "--iterations", "1", "--hparams", str(tmp_path / "none.json"),
                        "--out", str(tmp_path / "out"), "--model-cache", str(tmp_path / "models")])
