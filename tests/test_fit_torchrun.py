"""``fit`` under torchrun with two CPU gloo ranks: rank 0 plays the rollouts, publishes and evaluates; both
ranks train each update on their shard of the episodes rank 0 stored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("langgraph")

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "fit_quickstart"

DRIVER = textwrap.dedent("""
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from marft_bridge.fitting import fit

    base, out, val, tasks, app, reward = sys.argv[1:7]
    results = fit(app, tasks, reward, base, ["planner", "solver"], out, val=val, iterations=1,
                  tasks_per_iteration=2, group_size=2, concurrency=4, progress=False,
                  config={"ppo_epochs": 1, "num_minibatches": 1, "micro_batch_tokens": 256})
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"rank0_results": bool(results)}, f)
""")


def test_two_gloo_ranks_train_what_rank_0_plays(tmp_path, tiny_model_dir):
    from marft_bridge.serving import AdapterRegistry
    from marft_bridge.serving.process import free_port

    (tmp_path / "driver.py").write_text(DRIVER)
    val = tmp_path / "val.jsonl"
    val.write_text("".join((QUICKSTART / "val.jsonl").read_text().splitlines(keepends=True)[:2]))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(tmp_path / "driver.py"),
           str(tiny_model_dir), str(out), str(val), str(QUICKSTART / "tasks.jsonl"),
           f"{QUICKSTART / 'app.py'}:build_app", f"{QUICKSTART / 'reward.py'}:score"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # only the process group this test started
        log, _ = proc.communicate()
    assert proc.returncode == 0, log[-3000:]
    assert json.loads((out / "rank0.json").read_text()) == {"rank0_results": True}
    assert json.loads((out / "rank1.json").read_text()) == {"rank0_results": False}  # rank 1 only trained
    results = json.loads((out / "results.json").read_text())
    row = results["iterations"][1]
    assert row["counts"]["ok"] == 4 and row["versions"] == {"planner": 2, "solver": 2}
    # 4 episodes x 2 agents = 8 samples; rank 0 trained on its shard (episodes 0 and 2) and all-reduced
    assert row["metrics"]["samples"] == 4
    assert AdapterRegistry(out / "registry").versions("solver") == [1, 2]
