"""Peak memory of one MARFT-A update at a 151,936-token vocabulary: flat in the batch's tokens.

A random small-hidden Llama with Qwen2's vocabulary size (151,936) on CPU; one MARFT-A update
(proximal, reference and critic passes, the gradient pass, the M fold, the critic) on batches of
4k, 16k and 32k action tokens in ~2k-token sequences (2 agents, 32 observation + 2,048 action
tokens each), all in ONE minibatch (the worst case: the gradient pass sees the whole batch).
Each size runs in a fresh process; the figure is the peak resident set above the baseline taken
just before the update (model loaded, episodes built), sampled every 2 ms.

Targets: 32k/4k peak ratio <= 1.3 and < 3 GB at 32k. Beside each, the size of ONE fp32
(tokens x vocab) logits tensor, which the unchunked path materialised several times over.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer_memory.py            # 4k, 16k, 32k
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer_memory.py --tokens 2048 4096 --act-len 512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

VOCAB = 151_936


def build_model(path, hidden, layers, vocab):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from marft_bridge.demo.tinymodel import build_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def episodes(n_actions, obs_len, act_len, vocab, seed=0):
    import random

    from marft_bridge.schema import Action, Episode, Observation, Output, Reward, SamplingParams

    rng = random.Random(seed)
    out = []
    for e in range((n_actions + 1) // 2):
        acts, prev = [], []
        for k, agent in enumerate(["planner", "coder"][: n_actions - 2 * e]):
            a = Action(agent=agent, step=k, depends_on=prev,
                       observation=Observation(prompt_token_ids=[rng.randrange(5, vocab) for _ in range(obs_len)]),
                       output=Output(token_ids=[rng.randrange(5, vocab) for _ in range(act_len)],
                                     logprobs=[-rng.uniform(8.0, 14.0) for _ in range(act_len)]),
                       sampling=SamplingParams(temperature=0.7))
            acts.append(a)
            prev = [a.id]
        out.append(Episode(actions=acts, rewards=[Reward(value=rng.random())]))
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args):
    import torch

    from marft_bridge.trainers.config import MarftConfig
    from marft_bridge.trainers.marft import MarftTrainer

    torch.set_num_threads(args.threads)
    n_actions = args.child // args.act_len
    cfg = MarftConfig(ppo_epochs=1, num_minibatches=1, lr=1e-5, device="cpu",
                      micro_batch_tokens=args.micro_batch_tokens, logits_chunk_tokens=args.chunk)
    tr = MarftTrainer(cfg, args.model, ["planner", "coder"])
    eps = episodes(n_actions, args.obs_len, args.act_len, tr.policy.vocab_size)
    base, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    m = tr.train_on(eps)
    dt = time.perf_counter() - t0
    done.set()
    th.join()
    print(json.dumps({"tokens": m["tokens"], "samples": m["samples"], "peak": max(peak[0], _rss()) - base,
                      "seconds": dt, "finite": m["skipped_nonfinite"] == 0}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768], help="action tokens per batch")
    p.add_argument("--obs-len", type=int, default=32)
    p.add_argument("--act-len", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=512, help="logits_chunk_tokens")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(f"{tmp}/base", args.hidden, args.layers, args.vocab)
        print(f"random Llama: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; one MARFT-A update, "
              f"1 minibatch, {args.obs_len}+{args.act_len}-token sequences, micro_batch_tokens "
              f"{args.micro_batch_tokens}, logits_chunk_tokens {args.chunk}, CPU, {args.threads} thread(s)")
        peaks = {}
        for n in args.tokens:
            cmd = [sys.executable, __file__, "--child", str(n), "--model", model, "--obs-len", str(args.obs_len),
                   "--act-len", str(args.act_len), "--micro-batch-tokens", str(args.micro_batch_tokens),
                   "--chunk", str(args.chunk), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            if out.returncode != 0:
                sys.exit(f"child for {n} tokens failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            peaks[n] = r["peak"]
            full = r["tokens"] * args.vocab * 4
            print(f"  {r['tokens']:6d} action tokens ({r['samples']} sequences): peak above baseline "
                  f"{r['peak'] / 2**20:7.1f} MiB | one fp32 (tokens x vocab) logits tensor {full / 2**30:5.2f} GiB | "
                  f"update {r['seconds']:.0f} s{'' if r['finite'] else ' (non-finite step!)'}", flush=True)
        lo, hi = min(peaks), max(peaks)
        print(f"peak ratio {hi}/{lo} tokens: {peaks[hi] / peaks[lo]:.2f} (target <= 1.3); peak at {hi}: "
              f"{peaks[hi] / 2**30:.2f} GiB (target < 3)")


if __name__ == "__main__":
    main()
