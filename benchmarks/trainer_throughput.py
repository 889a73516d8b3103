"""MARFT trainer throughput and memory, measured side by side in one run.

1. Tokens/s of a MARFT-A update (proximal + reference/critic passes, sequential per-agent PPO
   epochs, factor-M passes, critic) vs a bare forward+backward+step of the same LoRA model over the
   same token sequences, the same number of epochs and minibatches. Target: ratio >= 0.6.
2. Peak memory of one trainer step with 1 vs 4 agents on one base model (each in a fresh process:
   peak RSS above the post-import baseline on CPU, torch.cuda.max_memory_allocated on CUDA).
   Target: 4 agents <= 1.2x one agent (the reference keeps one full model copy per agent).

    .venv/bin/python benchmarks/trainer_throughput.py                 # CPU, small model
    .venv/bin/python benchmarks/trainer_throughput.py --device cuda --hidden 1024 --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def build_model(path, hidden, layers):
    from marft_bridge.demo.tinymodel import build_tiny_model

    return build_tiny_model(path, hidden_size=hidden, num_layers=layers, num_heads=max(4, hidden // 64),
                            num_kv_heads=max(2, hidden // 128), intermediate_size=hidden * 2, max_positions=4096)


def episodes(n, agents, obs_len, act_len, seed=0):
    import random

    from marft_bridge.schema import Action, Episode, Observation, Output, Reward, SamplingParams

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        acts, prev = [], []
        for k, agent in enumerate(agents):
            a = Action(agent=agent, step=k, depends_on=prev,
                       observation=Observation(prompt_token_ids=[rng.randrange(5, 100) for _ in range(obs_len)]),
                       output=Output(token_ids=[rng.randrange(5, 100) for _ in range(act_len)],
                                     logprobs=[-rng.uniform(0.5, 5.0) for _ in range(act_len)]),
                       sampling=SamplingParams(temperature=0.7))
            acts.append(a)
            prev = [a.id]
        out.append(Episode(actions=acts, rewards=[Reward(value=rng.random())]))
    return out


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def bare_update(trainer, batch_samples, cfg):
    """Plain LoRA fine-tuning on the same sequences: forward, CE on the action tokens, backward, step."""
    import torch

    from marft_bridge.trainers.policy import pack

    pol = trainer.policy
    adapter = pol.adapters[0]
    params = pol.adapter_params(adapter)
    opt = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(cfg.ppo_epochs):
        perm = torch.randperm(len(batch_samples), generator=gen).tolist()
        for k in range(cfg.num_minibatches):
            ss = [batch_samples[i] for i in perm[k::cfg.num_minibatches]]
            packed = pack([s.obs_ids for s in ss], [s.act_ids for s in ss], pol.pad_id, pol.device)
            temp = torch.ones(packed.targets.shape[0], device=pol.device)
            logp, _, _ = pol.token_logprobs(adapter, packed, temp)
            loss = -logp.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


def throughput(args):
    import torch

    from marft_bridge.trainers.batch import build_batch
    from marft_bridge.trainers.config import MarftConfig
    from marft_bridge.trainers.marft import MarftTrainer

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(f"{tmp}/base", args.hidden, args.layers)
        agents = ["planner", "coder"]
        cfg = MarftConfig(ppo_epochs=args.epochs, num_minibatches=args.minibatches, lr=1e-5, device=args.device,
                          forward_batch_size=args.forward_batch)
        tr = MarftTrainer(cfg, model, agents)
        eps = episodes(args.episodes, agents, args.obs_len, args.act_len)
        pol = tr.policy
        samples = build_batch(eps, pol.tokenizer, set(agents), pol.vocab_size, pol.max_context, 1.0).samples
        tokens = sum(len(s.obs_ids) + len(s.act_ids) for s in samples) * args.epochs
        marft_t, bare_t = [], []
        tr.train_on(eps)
        bare_update(tr, samples, cfg)  # warm-up both
        for _ in range(args.repeats):
            sync(tr.device)
            t0 = time.perf_counter()
            bare_update(tr, samples, cfg)
            sync(tr.device)
            t1 = time.perf_counter()
            tr.train_on(eps)
            sync(tr.device)
            t2 = time.perf_counter()
            bare_t.append(t1 - t0)
            marft_t.append(t2 - t1)
        print(f"model: hidden {args.hidden}, {args.layers} layers, device {tr.device}; {len(samples)} sequences x "
              f"{args.epochs} epochs = {tokens} tokens per update; {args.repeats} interleaved repeats")
        for name, pick in (("median", statistics.median), ("best", min)):  # best: least disturbed by a noisy host
            b, m = pick(bare_t), pick(marft_t)
            print(f"  {name:6s} bare forward+backward {tokens / b:8.0f} tokens/s | MARFT-A update {tokens / m:8.0f} "
                  f"tokens/s | ratio {b / m:.2f} (target >= 0.6)")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(args):
    """One process: build a trainer with N agents, take one step, print peak memory above baseline."""
    import threading

    import torch

    from marft_bridge.trainers.config import MarftConfig
    from marft_bridge.trainers.marft import MarftTrainer

    import peft  # noqa: F401  - heavy imports before the baseline, so it measures the trainer only
    from transformers import LlamaForCausalLM  # noqa: F401

    torch.set_num_threads(args.threads)
    agents = [f"agent{i}" for i in range(args.memory_child)]
    # Same sequences per agent (so the same minibatch shapes); 4 agents train on 4x the actions.
    eps = episodes(args.episodes, agents, args.obs_len, args.act_len)
    cfg = MarftConfig(ppo_epochs=1, num_minibatches=2, device=args.device, forward_batch_size=args.forward_batch)
    base, peak, done = _rss(), [0], threading.Event()

    def sample():  # CPU: resident set sampled every 2 ms (getrusage's peak includes the imports)
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    tr = MarftTrainer(cfg, args.model, agents)
    tr.train_on(eps)
    done.set()
    th.join()
    if tr.device.type == "cuda":
        print(json.dumps({"agents": len(agents), "peak_bytes": torch.cuda.max_memory_allocated()}))
    else:
        print(json.dumps({"agents": len(agents), "peak_bytes": max(peak[0], _rss()) - base}))


def memory(args):
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(f"{tmp}/base", args.hidden, args.layers)
        peaks = {}
        for n in (1, 4):
            cmd = [sys.executable, __file__, "--memory-child", str(n), "--model", str(model)] + _common(args)
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            peaks[n] = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
        from safetensors import safe_open

        with safe_open(f"{model}/model.safetensors", "pt") as f:
            nparams = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
        print(f"peak memory of one step (above baseline): 1 agent {peaks[1] / 2**20:.1f} MiB, "
              f"4 agents {peaks[4] / 2**20:.1f} MiB, ratio {peaks[4] / peaks[1]:.2f}   (target <= 1.2)")
        print(f"  one full model copy per agent (+ critic) would add >= {4 * nparams * 4 / 2**20:.1f} MiB of weights alone")


def _prod(shape):
    out = 1
    for s in shape:
        out *= s
    return out


def _common(args):
    return ["--device", args.device, "--hidden", str(args.hidden), "--layers", str(args.layers), "--episodes",
            str(args.episodes), "--obs-len", str(args.obs_len), "--act-len", str(args.act_len), "--threads",
            str(args.threads), "--forward-batch", str(args.forward_batch)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--obs-len", type=int, default=64)
    p.add_argument("--act-len", type=int, default=32)
    p.add_argument("--epochs", type=int, default=4, help="PPO epochs (the reference uses 5)")
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--forward-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared host)")
    p.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args()
    if args.memory_child:
        return memory_child(args)
    if not args.skip_throughput:
        throughput(args)
    if not args.skip_memory:
        memory(args)


if __name__ == "__main__":
    main()
