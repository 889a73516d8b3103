"""In-process evaluation of the demo task: direct transformers generation with the planner's and
the solver's prompts (no server), the same prompts the LangGraph app sends. Used by tests, by the
warm-start check and by the demo's held-out evaluation of trained adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from . import task


@dataclass(frozen=True)
class Sample:
    question: str
    plan: str | None  # None for the single agent (its plan is part of ``answer``)
    answer: str
    reward: float


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    n: int
    plan_accuracy: float  # fraction of plans that are exactly the correct-order plan
    samples: list[Sample] = field(repr=False)


def load_model(model_dir: str | Path):
    """``(model, tokenizer)`` from a transformers directory, in eval mode, with left padding for batches."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model, tokenizer


def generate(
    model,
    tokenizer,
    conversations: list[list[dict[str, str]]],
    *,
    temperature: float = 0.7,
    max_new_tokens: int = 32,
    seed: int = 0,
    batch_size: int = 128,
    adapter_names: list[str] | None = None,
) -> list[str]:
    """One reply per conversation. ``temperature == 0`` is greedy. ``adapter_names`` (one per
    conversation) selects peft adapters per row, as ``PeftModel.generate`` accepts."""
    import torch

    if tokenizer.padding_side != "left":
        raise ValueError("batched generation needs tokenizer.padding_side == 'left'")
    torch.manual_seed(seed)
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in conversations]
    replies: list[str] = []
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[start : start + batch_size], add_special_tokens=False, padding=True, return_tensors="pt")
        kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False)
        if adapter_names is not None:
            kwargs["adapter_names"] = adapter_names[start : start + batch_size]
        with torch.no_grad():
            out = model.generate(**enc, **kwargs)
        new = out[:, enc["input_ids"].shape[1] :]
        replies.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return replies


def _per_row(adapter: str | None, n: int) -> list[str] | None:
    return None if adapter is None else [adapter] * n


def _result(problems: list[task.Problem], samples: list[Sample], plans: list[str]) -> EvalResult:
    n = len(samples)
    plan_ok = [task.plan_order(p.question, plan) == p.correct_order for p, plan in zip(problems, plans)]
    return EvalResult(accuracy=sum(s.reward for s in samples) / n, n=n, plan_accuracy=sum(plan_ok) / n, samples=samples)


def evaluate_two_agent(
    model,
    tokenizer,
    problems: list[task.Problem],
    *,
    temperature: float = 0.7,
    seed: int = 0,
    max_new_tokens: int = 32,
    planner_adapter: str | None = None,
    solver_adapter: str | None = None,
) -> EvalResult:
    """Planner then solver on every problem; accuracy is the mean checker reward."""
    questions = [p.question for p in problems]
    n = len(questions)
    sampling = dict(temperature=temperature, max_new_tokens=max_new_tokens)
    plans = generate(model, tokenizer, [task.planner_messages(q) for q in questions], seed=seed,
                     adapter_names=_per_row(planner_adapter, n), **sampling)
    answers = generate(model, tokenizer, [task.solver_messages(q, plan) for q, plan in zip(questions, plans)],
                       seed=seed + 1, adapter_names=_per_row(solver_adapter, n), **sampling)
    samples = [Sample(q, plan, a, task.reward(q, a)) for q, plan, a in zip(questions, plans, answers)]
    return _result(problems, samples, plans)


def evaluate_single_agent(
    model,
    tokenizer,
    problems: list[task.Problem],
    *,
    temperature: float = 0.7,
    seed: int = 0,
    max_new_tokens: int = 48,
    adapter: str | None = None,
) -> EvalResult:
    """One agent plans and solves in one reply (its plan is the reply's first line); same checker."""
    questions = [p.question for p in problems]
    answers = generate(model, tokenizer, [task.single_agent_messages(q) for q in questions], temperature=temperature,
                       max_new_tokens=max_new_tokens, seed=seed, adapter_names=_per_row(adapter, len(questions)))
    samples = [Sample(q, None, a, task.reward(q, a)) for q, a in zip(questions, answers)]
    return _result(problems, samples, [a.split("\n")[0] for a in answers])
