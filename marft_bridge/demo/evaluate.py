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


# -- held-out evaluation of a trainer's adapters, with sampling-error intervals -------------------------


@dataclass(frozen=True)
class HeldOut:
    """Accuracy over ``samples`` sampled runs of every held-out question, and the exact probability
    that the (first) plan is the correct one. ``ci95``: half-width of the 95% interval of
    ``accuracy`` from sampling alone, the question set held fixed (sum over questions of
    p_q (1 - p_q) / (samples - 1), normal approximation)."""

    accuracy: float
    ci95: float
    plan_prob: float  # mean over questions of pi(correct plan | question), teacher-forced, exact
    samples: int
    per_question: list[float] = field(repr=False)


def plan_probability(trainer, problems: list[task.Problem], *, agent: str, two_agent: bool, temperature: float,
                     untrained: bool = False) -> list[float]:
    """Per question, the exact probability that ``agent`` writes the correct plan (two-agent: the
    whole reply, end-of-turn included; single agent: the reply's first line and its newline), by one
    teacher-forced pass of the trainer's policy under ``temperature``."""
    import torch

    from ..trainers.policy import pack

    p = trainer.policy
    tok = p.tokenizer
    obs, acts = [], []
    for prob in problems:
        messages = task.planner_messages(prob.question) if two_agent else task.single_agent_messages(prob.question)
        obs.append(list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]))
        plan = task.plan_text(prob.question, prob.correct_order)
        ids = list(tok(plan if two_agent else plan + "\n", add_special_tokens=False)["input_ids"])
        acts.append(ids + [tok.eos_token_id] if two_agent else ids)
    packed = pack(obs, acts, p.pad_id, p.device)
    temp = torch.full((len(packed.targets),), float(temperature), device=p.device)
    with torch.no_grad():
        logp, _, _ = p.token_logprobs(None if untrained else p.adapter_of[agent], packed, temp)
    seq = torch.zeros(len(obs), dtype=torch.float64).index_add_(0, packed.rows.cpu(), logp.double().cpu())
    return seq.exp().tolist()


def evaluate_trainer(trainer, tokenizer, problems: list[task.Problem], *, two_agent: bool, samples: int, seed: int,
                     temperature: float = 0.7, untrained: bool = False) -> HeldOut:
    """Held-out evaluation of the trainer's current adapters (or the untrained base) in process: every
    question ``samples`` times through the same prompts the app sends. ``tokenizer``: left-padded
    (:func:`load_model`)."""
    import math

    model = trainer.policy.model
    names = trainer.policy.adapter_of
    rows = [p for p in problems for _ in range(samples)]

    def adapters(agent: str) -> list[str]:
        return ["__base__" if untrained else names[agent]] * len(rows)  # peft's name for "no adapter"

    if two_agent:
        plans = generate(model, tokenizer, [task.planner_messages(p.question) for p in rows], temperature=temperature,
                         seed=seed, adapter_names=adapters("planner"))
        answers = generate(model, tokenizer, [task.solver_messages(p.question, plan) for p, plan in zip(rows, plans)],
                           temperature=temperature, seed=seed + 1, adapter_names=adapters("solver"))
    else:
        answers = generate(model, tokenizer, [task.single_agent_messages(p.question) for p in rows],
                           temperature=temperature, max_new_tokens=48, seed=seed, adapter_names=adapters("agent"))
    rewards = [task.reward(p.question, a) for p, a in zip(rows, answers)]
    per_q = [sum(rewards[i * samples:(i + 1) * samples]) / samples for i in range(len(problems))]
    n = len(problems)
    var = sum(q * (1 - q) * samples / max(1, samples - 1) for q in per_q) / samples / n ** 2
    plan = plan_probability(trainer, problems, agent="planner" if two_agent else "agent", two_agent=two_agent,
                            temperature=temperature, untrained=untrained)
    return HeldOut(accuracy=sum(per_q) / n, ci95=1.96 * math.sqrt(var), plan_prob=sum(plan) / n, samples=samples,
                   per_question=per_q)
