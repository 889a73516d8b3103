"""The arms of the MARFT ablation on the codebook relay, and one (arm, seed) run.

Arms (same warm start, same episodes per iteration, same seeds; ``ARMS``):

- ``untrained``: the warm-started team, never updated (its J is the iteration-0 J of every arm);
- ``marft_a``: per-agent adapters, dependency order, M over ancestors in D, clipped;
- ``independent``: the same adapters and order, ``factor_scope: none`` (M = 1): per-agent PPO;
- ``shared``: one adapter for every role, one update group, no M; ``num_minibatches`` scaled by
  the number of agents so that optimiser steps per sample match the per-agent arms;
- ``happo``: HAPPO: a random agent order per update, M over every agent already updated in the
  round whatever its place in D (``factor_scope: round``), unclipped;
- ``marft_a_rerollout``: MARFT-A with ``update_scheme: rerollout``: the iteration's episodes split
  over the agents in update order, each agent updated on episodes its predecessors' new adapters
  played (M = 1 on them).

Group arms (critic-free, ``GROUP_ARMS``; issue 33): they compare the rollouts of one secret, so they
draw *grouped* secrets, ``episodes / group_size`` distinct words each played ``group_size`` times
(32 = 8 words x 4), and read ``Episode.group`` = (the word, its rollout index), which every arm's
episodes carry (only group estimators read it):

- ``grpo``: group-relative advantages (reward - the secret's group mean) / its std, every agent
  independent (dependency order, M = 1), no critic;
- ``grpo_happo``: the same advantages with HAPPO's random order and M over the round, unclipped;
- ``reward_happo``: the return itself as the advantage (no baseline, no normalisation), no critic,
  HAPPO's order and M;
- ``expert_iteration`` (issue 36): no policy gradient: each iteration every agent's adapter is
  fine-tuned from where it stands with the SFT loss on its own actions of that iteration's
  successful rollouts (reward 1: every success of every secret's group kept), ``--epochs`` passes in
  batches of ``EI_BATCH`` actions (``trainers.supervised.sft_in_place``, as ``marft fit --algorithm
  expert_iteration --min-reward 1`` does); its lr is the SFT rate, tuned on the same grid.

``RunSettings.secrets``: ``auto`` (grouped for the group arms, the arms before them unchanged),
``grouped`` (every arm: common secrets for a paired comparison with the group arms) or ``random``.

One iteration of a run: the instrumented LangGraph graph plays ``episodes`` episodes with the
current adapters (captured into a SQLite store), the trainer updates from the store's episodes,
and the exact J of the new adapters is computed. Secrets are drawn from ``Random(f"{seed}-{iteration}")``
and the sampler from ``seed * 1000 + iteration`` (rerollout shares: + part * 10**7, the secrets
consecutive slices), so arms that share a seed share their random numbers.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from .relay import WORDS, RelaySpec

ARMS = {
    "untrained": "untrained",
    "marft_a": "MARFT-A",
    "independent": "independent PPO",
    "shared": "shared policy",
    "happo": "HAPPO (random order, M over the round)",
    "marft_a_rerollout": "MARFT-A, fresh rollouts per agent",
    "grpo": "GRPO (group advantages, independent agents, no critic)",
    "grpo_happo": "GRPO-HAPPO (group advantages, random order, M over the round)",
    "reward_happo": "HAPPO on the return (no critic, no normalisation)",
    "expert_iteration": "expert iteration (SFT on each secret's successful rollouts)",
}
DEFAULT_ARMS = ["untrained", "marft_a", "independent", "shared", "happo", "marft_a_rerollout"]
GROUP_ARMS = ["grpo", "grpo_happo", "reward_happo", "expert_iteration"]  # play grouped secrets under "auto"
EI_BATCH = 8  # expert iteration: actions per SFT optimiser step (8 steps per agent at ~16 kept, 4 epochs)
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
    # The step-size regime (COMMON's values by default): PPO epochs and minibatches per update, the
    # approx-KL early stop, and masked sampling (every agent among its alphabet's tokens and EOS).
    epochs: int = Field(COMMON["ppo_epochs"], ge=1)
    minibatches: int = Field(COMMON["num_minibatches"], ge=1)
    target_kl: float | None = Field(None, gt=0)
    masked: bool = False
    factor_clip: float | None = Field(0.2, gt=0, lt=1)  # MARFT-A's (and its rerollout's) M clip
    # Secrets per iteration (module docstring): auto = grouped for GROUP_ARMS only, so the older arms'
    # curves are unchanged; group_size rollouts of each of episodes / group_size distinct words.
    secrets: Literal["auto", "grouped", "random"] = "auto"
    group_size: int = Field(4, ge=1)

    def grouped(self, arm: str) -> bool:
        return self.secrets == "grouped" or (self.secrets == "auto" and arm in GROUP_ARMS)


def arm_config(arm: str, spec: RelaySpec, lr: float, seed: int, settings: RunSettings | None = None):
    """The ``MarftConfig`` of a trained arm."""
    from ..trainers.config import MarftConfig

    st = settings or RunSettings()
    marft_a = {"agent_order": "dependency", "factor_scope": "ancestors", "factor_clip": st.factor_clip}
    happo = {"agent_order": "random", "factor_scope": "round", "factor_clip": None}
    extra = {
        "marft_a": marft_a,
        "marft_a_rerollout": {**marft_a, "update_scheme": "rerollout"},
        "happo": happo,
        "independent": {"agent_order": "dependency", "factor_scope": "none"},
        "shared": {"shared_adapter": True, "factor_scope": "none", "num_minibatches": st.minibatches * spec.hops},
        "grpo": {"agent_order": "dependency", "factor_scope": "none", "advantage": "grpo"},
        "grpo_happo": {**happo, "advantage": "grpo"},
        "reward_happo": {**happo, "advantage": "reward", "normalize_advantages": False},
        "expert_iteration": {"agent_order": "dependency", "factor_scope": "none", "advantage": "reward"},  # no critic
    }
    if arm not in extra:
        raise ValueError(f"arm must be one of {[a for a in ARMS if a != 'untrained']}, got {arm!r}")
    regime = {"ppo_epochs": st.epochs, "num_minibatches": st.minibatches, "target_kl": st.target_kl}
    return MarftConfig(**{**COMMON, **regime, **extra[arm], "lr": lr, "seed": seed})


def secrets_for(seed: int, iteration: int, n: int, group_size: int | None = None) -> list[str]:
    """The iteration's secrets: ``n`` independent draws, or with ``group_size`` G, n / G distinct words
    (drawn without replacement) each G times, episode k playing word k mod (n / G)."""
    rng = random.Random(f"{seed}-{iteration}")
    if group_size is None:
        return [rng.choice(WORDS) for _ in range(n)]
    tasks, rest = divmod(n, group_size)
    if rest or tasks > len(WORDS):
        raise ValueError(f"grouped secrets: {n} episodes are not {group_size} rollouts of at most "
                         f"{len(WORDS)} words")
    return rng.sample(WORDS, tasks) * group_size


def groups_of(secrets: list[str]) -> list[tuple[str, int]]:
    """Per episode its group (the secret word, the how-many-th rollout of that word it is)."""
    seen: dict[str, int] = {}
    out = []
    for w in secrets:
        out.append((w, seen.get(w, 0)))
        seen[w] = seen.get(w, 0) + 1
    return out


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
    "optimizer_steps", "episodes", "seconds", "factor_mean": [...], "valid_mass": [[per hop]...],
    "diagnostics": [per update: per agent KL step, M q05/q50/q95, clip fractions, epochs, steps]}``.
    ``untrained`` does no work (its curve is J_0)."""
    import torch

    from ..schema import EpisodeGroup
    from ..trainers.marft import MarftTrainer
    from ..trainers.rollout import RolloutPolicy
    from .exact import allowed_ids, chain_matrices, j_from_matrices, valid_mass
    from .graph import BatchSampler, instrumented_graph, rollout

    started = time.perf_counter()
    if arm == "untrained":
        if j0 is None:
            raise ValueError("the untrained arm needs j0 (the warm start's exact J)")
        return {"arm": arm, "seed": seed, "lr": None, "j": [j0] * (settings.iterations + 1),
                "train_reward": [], "optimizer_steps": 0, "episodes": 0, "seconds": 0.0, "factor_mean": [],
                "valid_mass": [], "diagnostics": []}
    torch.manual_seed(seed)
    trainer = MarftTrainer(arm_config(arm, spec, lr, seed, settings), base, agents=spec.agents)
    tok = trainer.policy.tokenizer
    allowed = {h: allowed_ids(tok, spec, h) for h in range(spec.hops)} if settings.masked else None
    sampler = BatchSampler(RolloutPolicy(trainer), temperature=settings.temperature, allowed=allowed)
    source = f"relay/{arm}/s{seed}"
    app = instrumented_graph(spec, sampler, store, source)

    def measure():
        mats = chain_matrices(trainer, spec, temperature=settings.temperature, masked=settings.masked)
        curve.append(j_from_matrices(mats))
        masses.append(valid_mass(mats))

    curve, masses, rewards, factors, diags, consumed, sft_steps = [], [], [], [], [], 0, 0
    measure()
    for it in range(settings.iterations):
        secrets = secrets_for(seed, it, settings.episodes, settings.group_size if settings.grouped(arm) else None)
        groups = groups_of(secrets)
        parts = [0, 0]  # episodes played, rollouts played in this iteration

        def play(policy, k, it=it, secrets=secrets, groups=groups, parts=parts):
            sampler.policy = policy  # the trainer's adapters as they are now (a swap after each agent)
            start = parts[0]
            episodes = rollout(app, sampler, store, source, secrets[start:start + k],
                               seed * 1000 + it + 10**7 * parts[1])
            for ep, (word, r) in zip(episodes, groups[start:start + k]):
                ep.group = EpisodeGroup(task_id=word, rollout=r)  # in memory: what the trainer reads
            parts[0], parts[1] = start + k, parts[1] + 1
            return episodes

        diags_it: list = []
        if arm == "expert_iteration":
            m = expert_step(trainer, play(RolloutPolicy(trainer), settings.episodes), settings, lr, seed, it)
            sft_steps += m.pop("optimizer_steps")
            rewards.append(m["reward_mean"])
            factors.append(1.0)
            diags_it.append(m)
        for m in ([] if arm == "expert_iteration" else trainer.iteration(play, settings.episodes)):
            rewards.append(m["reward_mean"])
            factors.append(m.get("factor_mean", 1.0))
            diags_it.append({"per_agent": m["per_agent"], "early_stops": m["early_stops"],
                             **({"rerollout": m["rerollout"]} if "rerollout" in m else {}),
                             **({"groups": m["group_advantage"]} if "group_advantage" in m else {})})
        consumed += parts[0]
        diags.append(diags_it)
        measure()
    return {"arm": arm, "seed": seed, "lr": lr, "j": curve, "train_reward": rewards,
            "optimizer_steps": optimizer_steps(trainer) + sft_steps, "episodes": consumed,
            "seconds": time.perf_counter() - started, "factor_mean": factors, "valid_mass": masses,
            "diagnostics": diags}


def expert_step(trainer, episodes: list, st: RunSettings, lr: float, seed: int, iteration: int) -> dict:
    """Expert iteration's update on one iteration's episodes (the module docstring): each agent's own
    actions of the successful rollouts, SFT from the adapters as they stand; returns its metrics."""
    import math

    from ..trainers.batch import trained_name
    from ..trainers.supervised import SftConfig, sft_in_place

    agents = set(trainer.agents)
    rewards = [ep.team_reward() or 0.0 for ep in episodes]
    kept = {ep.id for ep, r in zip(episodes, rewards) if r >= 1.0}
    options = SftConfig(epochs=st.epochs, lr=lr, batch_size=EI_BATCH, val_fraction=0.0,
                        seed=seed * 1_000_003 + iteration)
    step = sft_in_place(trainer.policy, episodes, config=trainer.config, options=options,
                        base_names=trainer.base_names, name_of=lambda a: trained_name(a, agents),
                        keep=lambda ep, a: ep.id in kept)
    steps = sum(math.ceil(n / EI_BATCH) * st.epochs for n in step["actions"].values())
    return {"reward_mean": sum(rewards) / max(len(rewards), 1), "kept_rollouts": len(kept),
            "kept_actions": step["actions"], "sft_loss": step["loss"], "optimizer_steps": steps}


def warm_imports(base: str | Path) -> float:
    """Import what an arm-run loads lazily (transformers' tokenizer and model modules for ``base``,
    peft, LangGraph, the capture's targets), so a process's first run is timed like its others: a
    run's ``seconds`` is its own cost, not the process's start-up. Returns the seconds it took."""
    started = time.perf_counter()
    import openai._base_client  # noqa: F401 - the capture's targets
    import peft  # noqa: F401
    from langgraph.graph import StateGraph  # noqa: F401
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoTokenizer

    from ..trainers.marft import MarftTrainer  # noqa: F401

    AutoTokenizer.from_pretrained(str(base))
    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(str(base)))]  # imports the modeling module
    return time.perf_counter() - started


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
