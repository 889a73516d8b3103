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


COLLECTIVES = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    import torch.distributed as dist
    from marft_bridge.trainers import distributed as D

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    seen = []
    real = dist.all_reduce
    def recording(t, *a, **kw):  # every tensor handed to a collective, with its device
        seen.append((str(t.device), t.numel()))
        return real(t, *a, **kw)
    dist.all_reduce = recording
    params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(4))]
    # rank 0 had 3 tokens, rank 1 had 1: the trainer scales each rank's mean loss by n_r / n.
    counts = D.sum_floats([3.0 if rank == 0 else 1.0, 1.0], torch.device("cpu"))
    share = (3.0 if rank == 0 else 1.0) / counts[0]
    for k, p in enumerate(params[:2]):
        p.grad = torch.full_like(p, float(rank + 1) * (k + 1)) * share  # local means: rank 0: 1, 2; rank 1: 2, 4
    # params[2] has no gradient on either rank (counts as zeros).
    D.all_reduce_gradients(params, torch.device("cpu"))
    g = [p.grad.tolist() for p in params]
    D.all_reduce_gradients(params, torch.device("cpu"), bucket_bytes=40)
    with open(sys.argv[1] + f"/r{rank}.txt", "w") as f:
        f.write(repr({"g": g, "g2": [p.grad.tolist() for p in params], "seen": seen, "counts": counts}))
    dist.destroy_process_group()
""")


def run_torchrun(script, args, tmp_path, timeout=240):
    (tmp_path / "script.py").write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(tmp_path / "script.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # only the process group this test started
        out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    return out


def test_flat_token_weighted_gradient_all_reduce(tmp_path):
    import ast

    run_torchrun(COLLECTIVES, [str(tmp_path)], tmp_path, timeout=120)
    r0, r1 = (ast.literal_eval((tmp_path / f"r{k}.txt").read_text()) for k in (0, 1))
    assert r0["g"] == r1["g"] and r0["g2"] == r1["g2"]
    # Token-weighted: (3 * 1 + 1 * 2) / 4 = 1.25 and (3 * 2 + 1 * 4) / 4 = 2.5 (a per-rank mean would be 1.5, 3).
    assert r0["g"][0] == [[1.25, 1.25]] * 3 and r0["g"][1] == [2.5] * 5 and r0["g"][2] == [0.0] * 4
    assert r0["counts"] == [4.0, 2.0]
    assert r0["g2"][1] == [5.0] * 5  # the second call sums the (already summed) gradients again
    seen = r0["seen"]
    assert all(dev == "cpu" for dev, _ in seen)  # the trainer's device here; NCCL would need cuda
    # The counts (2 values), one flat all-reduce for the adapter (6 + 5 + 4 values); with 40-byte
    # buckets [p0] = 6, [p1, p2] = 9 (24 + 20 bytes would overflow the first).
    assert [n for _, n in seen] == [2, 15, 6, 9]
