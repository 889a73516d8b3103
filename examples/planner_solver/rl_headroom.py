"""Sanity check that the warm-started demo model leaves reinforcement learning room to improve.

Puts one fresh LoRA adapter per agent (planner, solver) on the warm-started base, then runs a few
rounds of plain REINFORCE with a mean baseline on two-agent rollouts of training questions (team
reward from the checker, credited to both agents), printing held-out accuracy after each round.
No server involved; this is not MARFT (see ``marft train`` for that), only a check of the task.

    python examples/planner_solver/rl_headroom.py --rounds 6
"""

from __future__ import annotations

import argparse
import sys
import time

from marft_bridge.demo import evaluate, task, warmstart


def sequence_logprobs(model, tokenizer, conversations, replies):
    """Sum of the reply tokens' log-probs (reply + end-of-turn), one value per row, with gradient."""
    import torch

    encoded = warmstart.encode_examples(tokenizer, list(zip(conversations, replies)))
    input_ids, attention, labels = warmstart.pad_examples(encoded, tokenizer.pad_token_id)
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
    target = labels[:, 1:]
    mask = target != -100
    logp = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logp * mask).sum(-1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch", type=int, default=128, help="rollouts per round")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (rollouts and evaluation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=None, help="a warm-started model directory (default: build or load the cached one)")
    args = p.parse_args(argv)

    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(args.seed)
    model_dir = args.model_dir or warmstart.warm_start(progress=lambda s, n, loss: print(f"\rwarm start {s}/{n} loss {loss:.3f}", end="") if s % 100 == 0 else None)
    base, tokenizer = evaluate.load_model(model_dir)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, cfg, adapter_name="planner")
    model.add_adapter("solver", cfg)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    for p_ in params:
        p_.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=args.lr)
    splits = task.make_splits(0)

    def heldout() -> evaluate.EvalResult:
        model.eval()
        return evaluate.evaluate_two_agent(model, tokenizer, splits.heldout, temperature=args.temperature, seed=1234,
                                           planner_adapter="planner", solver_adapter="solver")

    r = heldout()
    print(f"\nround 0: held-out accuracy {r.accuracy:.3f} (plan {r.plan_accuracy:.3f})")
    started = time.perf_counter()
    for rnd in range(1, args.rounds + 1):
        problems = task.sample_problems(splits.train, args.batch, seed=args.seed * 1000 + rnd)
        model.eval()
        roll = evaluate.evaluate_two_agent(model, tokenizer, problems, temperature=args.temperature, seed=rnd,
                                           planner_adapter="planner", solver_adapter="solver")
        rewards = torch.tensor([s.reward for s in roll.samples])
        adv = rewards - rewards.mean()
        model.train()
        opt.zero_grad()
        for agent in ("planner", "solver"):
            model.set_adapter(agent)
            if agent == "planner":
                convs = [task.planner_messages(s.question) for s in roll.samples]
                replies = [s.plan for s in roll.samples]
            else:
                convs = [task.solver_messages(s.question, s.plan) for s in roll.samples]
                replies = [s.answer for s in roll.samples]
            loss = -(adv * sequence_logprobs(model, tokenizer, convs, replies)).mean()
            loss.backward()
        opt.step()
        r = heldout()
        print(f"round {rnd}: train reward {rewards.mean():.3f}  held-out accuracy {r.accuracy:.3f} (plan {r.plan_accuracy:.3f})"
              f"  [{time.perf_counter() - started:.0f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
