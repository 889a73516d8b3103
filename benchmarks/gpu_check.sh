#!/usr/bin/env bash
# The trainer on a CUDA GPU (benchmarks/gpu_check.py): a random Qwen2-0.5B-shaped bf16 model, one
# MARFT-A update over 16 x 2,048-token sequences per minibatch, peak GPU memory, tokens/s against a
# bare forward+backward; one "gpu_check <figure>: <value>" line per figure, about a minute, at most 5.
#   bash benchmarks/gpu_check.sh               # on a machine with a CUDA GPU
#   bash benchmarks/gpu_check.sh --cpu-smoke   # tiny shapes on CPU (run by tests/test_gpu_check_smoke.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
exec timeout 300 "$PY" benchmarks/gpu_check.py "$@"
