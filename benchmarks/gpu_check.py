"""The trainer on a real-sized model and a CUDA GPU: one MARFT-A update, peak memory, throughput.

A random Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864,
vocabulary 151,936, tied embeddings) in bf16 with fp32 LoRA adapters and value head; 2 agents;
16 sequences of 2,048 tokens (1,024 observation + 1,024 action) per agent minibatch. Measures, in
this order: a bare LoRA forward+backward+step over the same sequences (CE on the action tokens,
same micro-batches, same checkpointing), one MARFT-A update (proximal, reference, critic, PPO,
M fold), a checkpoint save/load round trip. One ``gpu_check <figure>: <value>`` line per figure.
Runs in about a minute on one H100/H200-class GPU.

    bash benchmarks/gpu_check.sh               # CUDA machine
    bash benchmarks/gpu_check.sh --cpu-smoke   # tiny shapes on CPU: the same code path, in the test suite
"""

from __future__ import annotations

import argparse
import tempfile
import time

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151_936)
SMOKE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=1000)


def line(name: str, value) -> None:
    print(f"gpu_check {name}: {value}", flush=True)


def build_model(path, shape, dtype):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from marft_bridge.demo.tinymodel import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def episodes(n, obs_len, act_len, vocab, seed=0):
    import random

    from marft_bridge.schema import Action, Episode, Observation, Output, Reward, SamplingParams

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        acts, prev = [], []
        for k, agent in enumerate(["planner", "coder"]):
            a = Action(agent=agent, step=k, depends_on=prev,
                       observation=Observation(prompt_token_ids=[rng.randrange(5, vocab) for _ in range(obs_len)]),
                       output=Output(token_ids=[rng.randrange(5, vocab) for _ in range(act_len)],
                                     logprobs=[-rng.uniform(8.0, 14.0) for _ in range(act_len)]),
                       sampling=SamplingParams(temperature=0.7))
            acts.append(a)
            prev = [a.id]
        out.append(Episode(actions=acts, rewards=[Reward(value=rng.random())]))
    return out


def bare_update(trainer, samples):
    """Plain LoRA fine-tuning over the same micro-batches: CE on the action tokens, backward, one step."""
    import torch

    from marft_bridge.trainers import microbatch
    from marft_bridge.trainers.policy import pack

    pol, cfg = trainer.policy, trainer.config
    adapter = pol.adapters[0]
    params = pol.adapter_params(adapter)
    opt = torch.optim.AdamW(params, lr=1e-5)
    n_tok = sum(len(s.act_ids) for s in samples)
    with pol.grad_mode():
        lengths = [len(s.obs_ids) + len(s.act_ids) for s in samples]
        for plan in microbatch.plan(lengths, cfg.micro_batch_tokens, cfg.forward_batch_size):
            ss = [samples[i] for i in plan]
            packed = pack([s.obs_ids for s in ss], [s.act_ids for s in ss], pol.pad_id, pol.device)
            temp = torch.ones(packed.targets.shape[0], device=pol.device)
            logp, _, _ = pol.token_logprobs(adapter, packed, temp)
            (-logp.sum() / n_tok).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (the test suite runs this)")
    args = p.parse_args()

    import torch

    from marft_bridge.trainers.batch import build_batch
    from marft_bridge.trainers.config import MarftConfig
    from marft_bridge.trainers.marft import MarftTrainer

    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device visible (use --cpu-smoke for the CPU dry run)")
    device = torch.device("cpu" if smoke else "cuda")
    shape, n_eps, obs_len, act_len = (SMOKE, 4, 24, 16) if smoke else (QWEN2_05B, 16, 1024, 1024)
    if smoke:
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        n_params = build_model(f"{tmp}/base", shape, torch.float32 if smoke else torch.bfloat16)
        line("device", "cpu (smoke)" if smoke else torch.cuda.get_device_name())
        line("model", f"Qwen2-shaped hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, vocab "
                      f"{shape['vocab_size']}, {n_params / 1e6:.1f}M parameters, built in {time.perf_counter() - t0:.0f} s")
        cfg = MarftConfig(ppo_epochs=1, num_minibatches=1, lr=1e-5, device=device.type,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        tr = MarftTrainer(cfg, f"{tmp}/base", agents=["planner", "coder"])
        pol = tr.policy
        base_dtype = next(pol.backbone.parameters()).dtype
        assert base_dtype == (torch.float32 if smoke else torch.bfloat16), base_dtype
        assert all(p.dtype == torch.float32 for n, p in pol.model.named_parameters() if "lora_" in n)
        assert all(p.dtype == torch.float32 for p in tr.head.parameters())
        line("precision", f"base {str(base_dtype).removeprefix('torch.')}, LoRA + value head float32, "
                          f"gradient checkpointing {'on' if pol.gradient_checkpointing else 'off'}, "
                          f"attention {pol.model.get_base_model().config._attn_implementation}")
        eps = episodes(n_eps, obs_len, act_len, pol.vocab_size)
        samples = build_batch(eps, pol.tokenizer, set(pol.agents), pol.vocab_size, pol.max_context, 1.0).samples
        tokens = sum(len(s.obs_ids) + len(s.act_ids) for s in samples)
        line("batch", f"{len(samples)} sequences x {obs_len + act_len} tokens ({len(samples) // 2} per agent "
                      f"minibatch), {tokens} tokens, micro_batch_tokens {cfg.micro_batch_tokens}")

        def timed(fn):
            if not smoke:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            out = fn()
            if not smoke:
                torch.cuda.synchronize()
            return out, time.perf_counter() - t

        bare_update(tr, samples[:2])  # warm-up: kernels, allocator
        _, bare_s = timed(lambda: bare_update(tr, samples))
        bare_peak = None if smoke else torch.cuda.max_memory_allocated()
        m, marft_s = timed(lambda: tr.train_on(eps))
        marft_peak = None if smoke else torch.cuda.max_memory_allocated()
        assert m["skipped_nonfinite"] == 0 and not m["rolled_back"], m
        line("bare_forward_backward_tokens_per_s", f"{tokens / bare_s:.0f}")
        line("marft_a_update_tokens_per_s", f"{tokens / marft_s:.0f}  ({marft_s:.1f} s for one update)")
        line("throughput_ratio_marft_over_bare", f"{bare_s / marft_s:.2f}  (a MARFT-A update also runs proximal, "
                                                 "reference and M-fold forwards and the critic)")
        if smoke:
            line("peak_gpu_memory_gib", "n/a (cpu smoke)")
        else:
            line("peak_gpu_memory_gib", f"{marft_peak / 2**30:.2f}  (bare forward+backward {bare_peak / 2**30:.2f}, "
                                        f"full fp32 logits of one minibatch would be "
                                        f"{len(samples) // 2 * act_len * pol.vocab_size * 4 / 2**30:.1f})")
        line("update_metrics", f"kl_ref {m['kl_ref']:.4g}, entropy {m['entropy']:.4g}, value_loss {m['value_loss']:.4g}")
        with tempfile.TemporaryDirectory() as c:
            tr.save_checkpoint(c)
            tr.load_checkpoint(c)
        line("checkpoint_roundtrip", "OK")
    line("result", "OK")


if __name__ == "__main__":
    main()
