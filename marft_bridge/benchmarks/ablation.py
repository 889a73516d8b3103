"""The arms of the MARFT ablation on the codebook relay, and one (arm, seed) run.

Arms (same warm start, same episodes per iteration, same seeds; ``ARMS``):

- ``untrained``: the warm-started team, never updated (its J is the iteration-0 J of every arm);
- ``marft_a``: per-agent adapters, dependency order, M over ancestors in D, clipped;
- ``independent``: the same adapters and order, ``factor_scope: none`` (M = 1): per-agent PPO;
- ``shared``: one adapter for every role, one update group, no M; ``num_minibatches`` scaled by
  the number of agents so that optimiser steps per sample match the per-agent arms;
- ``marft_a_random`` (optional): MARFT-A with a random agent order per update.

One iteration of a run: the instrumented LangGraph graph plays ``episodes`` episodes with the
current adapters (captured into a SQLite store), the trainer updates once from the store's
episodes, and the exact J of the new adapters is computed. Secrets are drawn from
``Random(f"{seed}-{iteration}")`` and the sampler from ``seed * 1000 + iteration``, so arms that
share a seed share their random numbers.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from pydantic import BaseModel, Field

from .relay import WORDS, RelaySpec

ARMS = {
    "untrained": "untrained",
    "marft_a": "MARFT-A",
    "independent": "independent PPO",
    "shared": "shared policy",
    "marft_a_random": "MARFT-A, random order",
}
DEFAULT_ARMS = ["untrained", "marft_a", "independent", "shared"]
# What every trained arm shares (pre-declared; only lr is tuned, per arm, on the tuning seeds).
COMMON = {
    "ppo_epochs": 2,
    "num_minibatches": 1,
    "clip": 0.2,
    "gamma": 1.0,  # one team reward per episode: every action's return is that reward
    "gae_lambda": 1.0,
    "kl_coef": 0.0,
    "entropy_coef": 0.0,
    "critic_lr": 1e-3,
    "lora_r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "default_temperature": 1.0,
    "device": "cpu",
}


class RunSettings(BaseModel):
    iterations: int = Field(12, ge=1)
    episodes: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0)


def arm_config(arm: str, spec: RelaySpec, lr: float, seed: int):
    """The ``MarftConfig`` of a trained arm."""
    from ..trainers.config import MarftConfig

    extra = {
        "marft_a": {"agent_order": "dependency", "factor_scope": "ancestors", "factor_clip": 0.2},
        "marft_a_random": {"agent_order": "random", "factor_scope": "ancestors", "factor_clip": 0.2},
        "independent": {"agent_order": "dependency", "factor_scope": "none"},
        "shared": {"shared_adapter": True, "factor_scope": "none",
                   "num_minibatches": COMMON["num_minibatches"] * spec.hops},
    }
    if arm not in extra:
        raise ValueError(f"arm must be one of {[a for a in ARMS if a != 'untrained']}, got {arm!r}")
    return MarftConfig(**{**COMMON, **extra[arm], "lr": lr, "seed": seed})


def secrets_for(seed: int, iteration: int, n: int) -> list[str]:
    rng = random.Random(f"{seed}-{iteration}")
    return [rng.choice(WORDS) for _ in range(n)]


def optimizer_steps(trainer) -> int:
    """Policy optimiser steps taken so far (Adam's step counter, summed over the agents' optimisers)."""
    total = 0
    for optim in trainer.optims.values():
        steps = [float(st["step"]) for st in optim.state.values() if "step" in st]
        total += int(max(steps, default=0))
    return total


def run_arm(spec: RelaySpec, base: str | Path, arm: str, seed: int, lr: float | None, settings: RunSettings,
            store, j0: float | None = None) -> dict:
    """One (arm, seed) run: ``{"arm", "seed", "lr", "j": [J_0..J_T], "train_reward": [...],
    "optimizer_steps", "seconds", "factor_mean": [...]}``. ``untrained`` does no work (its curve is J_0)."""
    import torch

    from ..trainers.marft import MarftTrainer
    from ..trainers.rollout import RolloutPolicy
    from .exact import exact_j
    from .graph import BatchSampler, instrumented_graph, rollout

    started = time.perf_counter()
    if arm == "untrained":
        if j0 is None:
            raise ValueError("the untrained arm needs j0 (the warm start's exact J)")
        return {"arm": arm, "seed": seed, "lr": None, "j": [j0] * (settings.iterations + 1),
                "train_reward": [], "optimizer_steps": 0, "seconds": 0.0, "factor_mean": []}
    torch.manual_seed(seed)
    trainer = MarftTrainer(arm_config(arm, spec, lr, seed), base, agents=spec.agents)
    sampler = BatchSampler(RolloutPolicy(trainer), temperature=settings.temperature)
    source = f"relay/{arm}/s{seed}"
    app = instrumented_graph(spec, sampler, store, source)
    curve = [exact_j(trainer, spec, temperature=settings.temperature)]
    rewards, factors = [], []
    for it in range(settings.iterations):
        sampler.policy = RolloutPolicy(trainer)
        episodes = rollout(app, sampler, store, source, secrets_for(seed, it, settings.episodes), seed * 1000 + it)
        m = trainer.train_on(episodes)
        rewards.append(m["reward_mean"])
        factors.append(m.get("factor_mean", 1.0))
        curve.append(exact_j(trainer, spec, temperature=settings.temperature))
    return {"arm": arm, "seed": seed, "lr": lr, "j": curve, "train_reward": rewards,
            "optimizer_steps": optimizer_steps(trainer), "seconds": time.perf_counter() - started,
            "factor_mean": factors}


def run_seed(spec: RelaySpec, base: str | Path, arms: list[str], lrs: dict[str, float], seed: int,
             settings: RunSettings, workdir: str | Path) -> list[dict]:
    """Every arm on one seed (one SQLite store per seed under ``workdir``); the untrained arm's J is
    the warm start's, measured by the first trained arm's iteration 0 (adapters start as the identity)."""
    from ..store import TraceStore

    store = TraceStore.open(Path(workdir) / f"traces-s{seed}.db")
    try:
        runs = [run_arm(spec, base, a, seed, lrs.get(a), settings, store) for a in arms if a != "untrained"]
        if "untrained" in arms:
            j0 = runs[0]["j"][0] if runs else _base_j(spec, base, settings)
            runs.insert(0, run_arm(spec, base, "untrained", seed, None, settings, store, j0=j0))
    finally:
        store.close()
    return runs


def _base_j(spec: RelaySpec, base, settings: RunSettings) -> float:
    from ..trainers.marft import MarftTrainer
    from .exact import exact_j

    trainer = MarftTrainer(arm_config("marft_a", spec, 1e-3, 0), base, agents=spec.agents)
    return exact_j(trainer, spec, untrained=True, temperature=settings.temperature)
