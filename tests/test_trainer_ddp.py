"""The unchanged trainer under torchrun: two CPU gloo processes end a step with identical adapters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import torch

from marft_bridge.serving.process import free_port

WORKER = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    import torch.distributed as dist
    from marft_bridge.trainers.config import MarftConfig
    from marft_bridge.trainers.marft import MarftTrainer
    from marft_bridge.trainers.sources import read_jsonl

    model, episodes, out = sys.argv[1:4]
    cfg = MarftConfig(ppo_epochs=2, num_minibatches=2, lr=1e-2, target_modules=["q_proj", "v_proj", "o_proj"])
    tr = MarftTrainer(cfg, model, agents=["a", "b"])
    assert (tr.rank, tr.world) == (dist.get_rank(), 2)
    tr.save_adapters(f"{out}/init{tr.rank}")
    m = tr.train_on(read_jsonl(episodes)[0])
    tr.save_adapters(f"{out}/rank{tr.rank}")
    # one file per rank: two processes printing to one pipe can interleave mid-line
    with open(f"{out}/summary{tr.rank}.txt", "w") as fh:
        fh.write(f"samples {m['samples']} order {m['agent_order']}")
    dist.destroy_process_group()
""")


def test_two_gloo_processes_end_a_step_with_identical_adapters(tiny_model_dir, tmp_path):
    from marft_bridge.trainers.marft import MarftTrainer
    from marft_bridge.trainers.config import MarftConfig
    from marft_bridge.trainers.rollout import RolloutPolicy
    from test_trainer import make_env

    torch.set_num_threads(1)
    tr = MarftTrainer(MarftConfig(), tiny_model_dir, agents=["a", "b"])
    eps = make_env(2)(RolloutPolicy(tr), 15, 21)  # odd count: the ranks get 8 and 7 episodes
    (tmp_path / "eps.jsonl").write_text("".join(e.model_dump_json() + "\n" for e in eps))
    (tmp_path / "worker.py").write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(tmp_path / "worker.py"), str(tiny_model_dir), str(tmp_path / "eps.jsonl"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # only the process group this test started
        out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    assert (tmp_path / "summary0.txt").read_text().startswith("samples 16 order ")
    assert (tmp_path / "summary1.txt").read_text().startswith("samples 14 order ")
    f = "adapter_model.safetensors"
    for agent in ("a", "b"):
        r0 = (tmp_path / "rank0" / agent / f).read_bytes()
        assert r0 == (tmp_path / "rank1" / agent / f).read_bytes()
        assert (tmp_path / "init0" / agent / f).read_bytes() == (tmp_path / "init1" / agent / f).read_bytes()
        assert r0 != (tmp_path / "init0" / agent / f).read_bytes()  # the step did change them
