"""benchmarks/gpu_check.sh in its CPU dry mode: the GPU script's whole code path on tiny shapes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_smoke_prints_every_figure():
    env = {**os.environ, "PY": sys.executable, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-smoke"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = dict(re.findall(r"^gpu_check ([a-z_]+): (.*)$", out.stdout, flags=re.M))
    assert figures["result"] == "OK" and figures["checkpoint_roundtrip"] == "OK"
    assert figures["device"] == "cpu (smoke)"
    assert figures["batch"].startswith("8 sequences x 40 tokens (4 per agent minibatch), 320 tokens")
    assert "LoRA + value head float32" in figures["precision"] and "attention sdpa" in figures["precision"]
    for name in ("bare_forward_backward_tokens_per_s", "marft_a_update_tokens_per_s",
                 "throughput_ratio_marft_over_bare"):
        assert float(figures[name].split()[0]) > 0, name
    assert figures["peak_gpu_memory_gib"].startswith("n/a")


def test_gpu_check_without_cuda_says_so():
    env = {**os.environ, "PY": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode != 0 and "no CUDA device visible" in out.stderr
