"""The unchanged trainer under torchrun and `accelerate launch`: two CPU gloo processes end a step with
identical adapters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from marft_bridge.serving.process import free_port

# One minibatch and no advantage normalisation: the only difference from one process training on
# all 15 episodes is the split, so token-weighted averaging must reproduce that process's adapters.
CONFIG = dict(ppo_epochs=2, num_minibatches=1, normalize_advantages=False, lr=1e-2,
              target_modules=["q_proj", "v_proj", "o_proj"], micro_batch_tokens=64)

WORKER = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    import torch.distributed as dist
    from marft_bridge.trainers.config import MarftConfig
    from marft_bridge.trainers.marft import MarftTrainer
    from marft_bridge.trainers.sources import read_jsonl

    model, episodes, out, cfg = sys.argv[1:5]
    seen = []  # (collective, device, numel) of every tensor handed to a collective
    for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_gather_into_tensor"):
        real = getattr(dist, name)
        def recording(t, *a, _real=real, _name=name, **kw):
            seen.append((_name, str(t.device), t.numel() if torch.is_tensor(t) else -1))
            return _real(t, *a, **kw)
        setattr(dist, name, recording)
    tr = MarftTrainer(MarftConfig(**json.loads(cfg)), model, agents=["a", "b"])
    assert (tr.rank, tr.world) == (dist.get_rank(), 2)

    def weights():  # this rank's adapter weights, to compare across ranks
        return {a: [p.tolist() for p in tr.policy.adapter_params(a)] for a in tr.policy.adapters}

    init = weights()
    tr.save_adapters(f"{out}/init")  # a collective: rank 0 writes, both return once the files exist
    m = tr.train_on(read_jsonl(episodes)[0])
    n_seen = len(seen)  # the update's collectives (saving adds gathers and barriers)
    tr.save_adapters(f"{out}/step")
    tr.save_checkpoint(f"{out}/ckpt")
    sizes = {a: sum(p.numel() for p in tr.policy.adapter_params(a)) for a in tr.policy.adapters}
    # one file per rank: two processes printing to one pipe can interleave mid-line
    with open(f"{out}/summary{tr.rank}.json", "w") as fh:
        json.dump({"samples": m["samples"], "order": m["agent_order"], "device": str(tr.device),
                   "seen": seen[:n_seen], "adapter_numel": sizes, "init": init, "step": weights()}, fh)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_two_gloo_processes_end_a_step_with_identical_token_weighted_adapters(tiny_model_dir, tmp_path, launcher):
    import json

    from safetensors.torch import load_file

    from marft_bridge.trainers.config import MarftConfig
    from marft_bridge.trainers.marft import MarftTrainer

    torch.set_num_threads(1)
    eps = write_episodes(tiny_model_dir, tmp_path / "eps.jsonl")
    run_torchrun(WORKER, [str(tiny_model_dir), str(tmp_path / "eps.jsonl"), str(tmp_path), json.dumps(CONFIG)],
                 tmp_path, launcher=launcher)
    s0, s1 = (json.loads((tmp_path / f"summary{k}.json").read_text()) for k in (0, 1))
    assert (s0["samples"], s1["samples"]) == (16, 14)  # unequal shards (and unequal token counts)
    f = "adapter_model.safetensors"
    assert s0["init"] == s1["init"] and s0["step"] == s1["step"]  # the ranks' adapters, exactly equal
    for agent in ("a", "b"):
        assert (tmp_path / "step" / agent / f).read_bytes() != (tmp_path / "init" / agent / f).read_bytes()
    # The checkpoint keeps both ranks' generators: their minibatch shuffles drew on their own shards.
    from safetensors.torch import load_file as load

    rng = load(str(tmp_path / "ckpt" / "rng.safetensors"))
    assert {k for k in rng if k.startswith("rank1/")} == {"rank1/" + k for k in rng if not k.startswith("rank1/")}
    # Token-weighted: the two ranks' step is the step of one process on all 30 samples.
    single = MarftTrainer(MarftConfig(**CONFIG), tiny_model_dir, agents=["a", "b"])
    single.train_on(eps)
    single.save_adapters(tmp_path / "single")
    for agent in ("a", "b"):
        got, want = load_file(str(tmp_path / "step" / agent / f)), load_file(str(tmp_path / "single" / agent / f))
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=5e-5, rtol=1e-4, msg=k)
    # Every tensor handed to a collective was on the trainer's device (NCCL would refuse CPU tensors
    # on a CUDA trainer), and each optimiser step all-reduced its adapter's gradients in one flat tensor.
    for s in (s0, s1):
        assert s["seen"] and all(dev == s["device"] for _, dev, _ in s["seen"])
        assert {name for name, _, _ in s["seen"]} == {"all_reduce"}
        grads = [n for _, _, n in s["seen"] if n > 100]
        per_adapter = s["adapter_numel"]
        critic = sum(p.numel() for p in single.head.parameters())  # frozen backbone: the value head
        assert set(grads) == set(per_adapter.values()) | {critic}
        # One all-reduce per step, not per tensor: 2 agents x 2 epochs x 1 minibatch + the critic's 2 epochs.
        assert len(grads) == (len(per_adapter) + 1) * CONFIG["ppo_epochs"]


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


def write_episodes(model_dir, path):
    """15 episodes sampled by an untrained trainer (an odd count: two ranks get 8 and 7), written to
    ``path`` as JSON lines for the workers; returned."""
    from marft_bridge.trainers.config import MarftConfig
    from marft_bridge.trainers.marft import MarftTrainer
    from marft_bridge.trainers.rollout import RolloutPolicy
    from test_trainer import make_env

    eps = make_env(3)(RolloutPolicy(MarftTrainer(MarftConfig(), model_dir, agents=["a", "b"])), 15, 21)
    path.write_text("".join(e.model_dump_json() + "\n" for e in eps))
    return eps


def run_torchrun(script, args, tmp_path, timeout=240, launcher="torchrun"):
    """``script`` in two processes under torchrun, or under ``accelerate launch`` (which runs torchrun's
    launcher with its own flags; ``--multi_gpu`` is its name for several processes, CPU included)."""
    (tmp_path / "script.py").write_text(script)
    port = str(free_port())
    if launcher == "accelerate":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--main_process_ip", "127.0.0.1", "--main_process_port", port,
               "--mixed_precision", "no", "--dynamo_backend", "no", str(tmp_path / "script.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", port, str(tmp_path / "script.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if launcher == "accelerate":  # no accelerate config file of this machine's: all is on the command line
        env["HF_HOME"] = str(tmp_path / "hf")
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
