"""The demo's base model: a tiny character-level Llama, warm-started by supervised fine-tuning on
*imperfect* demonstrations so that it starts competent but leaves reinforcement learning room.

The demonstrations are the task's correct plans and worked solutions, except that a controlled
fraction of plans take the wrong order (``plan_error_rate``) and a controlled fraction of final
results are slightly off (``answer_error_rate``). The model learns that noisy policy, so sampling
from it is right only part of the time; MARFT's job is to push the probability of the right plan
and the right result up. The warm start trains the base weights (no LoRA); RL later trains one
LoRA adapter per agent on top.

The result is cached under ``<cache_dir>/<name>-<hash of the settings>/``: later runs with the same
settings load it instead of training again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from . import task

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path(".marft") / "models"
META_FILE = "warmstart.json"
# Bump when the recipe changes in a way the settings do not show, so old caches are not reused.
RECIPE_VERSION = 1

ProgressFn = Callable[[int, int, float], None]  # (step, total_steps, loss)


class WarmStartConfig(BaseModel):
    """Settings of the warm start; their hash names the cache directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(default="demo-base", pattern=r"^[A-Za-z0-9_.-]+$")
    seed: int = 0
    split_seed: int = Field(default=0, description="seed of task.make_splits; only its train split is used")
    heldout_size: int = 100
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    steps: int = Field(default=1000, ge=1)
    batch_size: int = Field(default=64, ge=1)
    lr: float = Field(default=3e-3, gt=0)
    warmup_steps: int = Field(default=20, ge=0)
    plan_error_rate: float = Field(default=0.3, ge=0, le=1, description="fraction of demo plans in the wrong order")
    answer_error_rate: float = Field(default=0.1, ge=0, le=1, description="fraction of demo results that are off")

    def key(self) -> str:
        blob = json.dumps({"recipe": RECIPE_VERSION, "task": task_fingerprint(), **self.model_dump()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def dirname(self) -> str:
        return f"{self.name}-{self.key()}"


def task_fingerprint() -> str:
    """What the model is trained to say, so a change to the task's prompts or formats misses the cache."""
    q = "2+3*4"
    parts = [task.PLANNER_SYSTEM, task.SOLVER_SYSTEM, task.SINGLE_SYSTEM, task.MAX_OPERAND, task.MAX_VALUE,
             task.plan_text(q, "left"), task.single_agent_reply(q, "right"), task.solver_messages(q, "p")[1]["content"]]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]


# -- demonstrations ---------------------------------------------------------------------------------


def _off_by(value: int, rng: random.Random) -> int:
    """A plausible slip: the right value moved by 1-3 (kept non-negative)."""
    delta = rng.choice([-3, -2, -1, 1, 2, 3])
    return value + delta if value + delta >= 0 else value - delta


def demonstrations(
    problems: list[task.Problem], n: int, *, seed: int, plan_error_rate: float, answer_error_rate: float
) -> list[tuple[list[dict[str, str]], str]]:
    """``n`` (messages, reply) pairs: a fifth for the planner, two fifths each for the solver and the single agent.

    The solver always follows the plan it is given (even a wrong one), so the plan decides the
    answer: a wrong planner costs the team its reward however well the solver computes.
    """
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.choice(problems)
        wrong_plan = rng.random() < plan_error_rate
        order: task.Order = p.correct_order
        if wrong_plan:
            order = "right" if order == "left" else "left"
        final = None
        if rng.random() < answer_error_rate:
            final = _off_by(task.steps(p.question, order)[1][3], rng)
        role = i % 5  # the planner's copy-and-bracket is easy; arithmetic (solver, single agent) needs more
        if role == 0:
            out.append((task.planner_messages(p.question), task.plan_text(p.question, order)))
        elif role in (1, 2):
            plan = task.plan_text(p.question, order)
            out.append((task.solver_messages(p.question, plan), task.solution_text(p.question, order, final=final)))
        else:
            out.append((task.single_agent_messages(p.question), task.single_agent_reply(p.question, order, final=final)))
    rng.shuffle(out)
    return out


def encode_examples(tokenizer, examples: list[tuple[list[dict[str, str]], str]]):
    """Token ids and loss masks: the prompt as the chat template renders it for generation, then the
    reply and the end-of-turn token, which is exactly what the server samples."""
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m, _ in examples]
    replies = [reply + tokenizer.eos_token for _, reply in examples]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(replies, add_special_tokens=False)["input_ids"]
    return [(p + r, len(p)) for p, r in zip(prompt_ids, reply_ids)]


# -- training -----------------------------------------------------------------------------------------


def pad_examples(encoded, pad_id: int):
    """``encode_examples`` rows right-padded into ``(input_ids, attention_mask, labels)``; labels are
    -100 outside the reply, so the loss counts only reply tokens."""
    import torch

    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    attention = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, (ids, n_prompt) in enumerate(encoded):
        t = torch.tensor(ids)
        input_ids[row, : len(ids)] = t
        labels[row, n_prompt : len(ids)] = t[n_prompt:]
        attention[row, : len(ids)] = 1
    return input_ids, attention, labels


def train_sft(model, tokenizer, config: WarmStartConfig, progress: ProgressFn | None = None) -> float:
    """Supervised fine-tuning of ``model`` in place on noisy demonstrations; returns the final loss
    (mean over the last 20 steps)."""
    import torch

    splits = task.make_splits(config.split_seed, config.heldout_size)
    examples = demonstrations(
        splits.train,
        config.steps * config.batch_size,
        seed=config.seed,
        plan_error_rate=config.plan_error_rate,
        answer_error_rate=config.answer_error_rate,
    )
    encoded = encode_examples(tokenizer, examples)
    torch.manual_seed(config.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        frac = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    recent: list[float] = []
    for step in range(config.steps):
        chunk = encoded[step * config.batch_size : (step + 1) * config.batch_size]
        input_ids, attention, labels = pad_examples(chunk, tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        recent = (recent + [loss.item()])[-20:]
        if progress is not None:
            progress(step + 1, config.steps, recent[-1])
    model.eval()
    return sum(recent) / len(recent)


def warm_start(
    config: WarmStartConfig | None = None,
    *,
    cache_dir: str | Path = DEFAULT_CACHE_DIR,
    force: bool = False,
    progress: ProgressFn | None = None,
) -> Path:
    """The warm-started model directory for ``config``: loaded from the cache when present, else built,
    trained and written there (atomically, so an interrupted run leaves no half model behind)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .tinymodel import build_tiny_model

    config = config or WarmStartConfig()
    cache_dir = Path(cache_dir)
    target = cache_dir / config.dirname()
    if (target / META_FILE).exists() and not force:
        log.info("warm-started model found in cache: %s", target)
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{config.dirname()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(
        tmp,
        seed=config.seed,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        max_positions=256,
    )
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    started = time.perf_counter()
    loss = train_sft(model, tokenizer, config, progress)
    seconds = time.perf_counter() - started
    model.save_pretrained(tmp)  # safetensors
    meta = {"config": config.model_dump(), "recipe": RECIPE_VERSION, "task": task_fingerprint(), "final_loss": loss,
            "train_seconds": seconds}
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    log.info("warm-started model written to %s (loss %.3f, %.0f s)", target, loss, seconds)
    return target


def read_meta(model_dir: str | Path) -> dict:
    """The settings and training summary stored beside a warm-started model."""
    return json.loads((Path(model_dir) / META_FILE).read_text())
