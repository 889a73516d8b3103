"""Expert iteration (rejection-sampling fine-tuning) as ``fit``'s update: ``--algorithm expert_iteration``.

Per iteration, among the rollouts of each task group (the iteration's G rollouts of one task), each
agent keeps its best ones: ranked by its own reward where the reward function gave one per agent, else
the team reward; with ``--min-reward R`` those below R are dropped, with ``--top-k-per-group K`` at
most the K highest are kept (ties: the lower rollout index first). Then each agent's adapter is
fine-tuned from where it stands (``trainers.supervised.sft_in_place``: the SFT loss on its own kept
actions only, rendered exactly as the RL trainer renders them); an agent with no kept action keeps its
adapter as it was. Publishing, hot-swapping, the journal and resume are ``fit``'s, as for PPO.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

ALGORITHMS = ("ppo", "expert_iteration")


def select(outcomes: list, top_k: int | None, min_reward: float | None) -> set[tuple[str, str]]:
    """The kept (episode id, recorded agent) pairs of one iteration's outcomes (see the module docstring)."""
    from ..trainers.sft_data import agent_reward

    groups: dict[tuple[str, str], list[tuple[float, int, str]]] = {}
    for o in outcomes:
        if o.status != "ok" or o.episode is None:
            continue
        ep = o.episode
        for agent in dict.fromkeys(a.agent for a in ep.actions if a.kind == "llm"):
            r = agent_reward(ep, agent)
            if r is not None and (min_reward is None or r >= min_reward):
                groups.setdefault((o.task.id, agent), []).append((r, o.rollout, ep.id))
    kept = set()
    for (_, agent), ranked in groups.items():
        ranked.sort(key=lambda x: (-x[0], x[1]))
        kept.update((ep_id, agent) for _, _, ep_id in ranked[:top_k])  # top_k None: every one
    return kept


def update(trainer: Any, outcomes: list, s: Any, iteration: int, out_dir: Path) -> dict:
    """One expert-iteration step on ``trainer``'s adapters; the adapters and the checkpoint written under
    ``out_dir`` as the PPO step writes them; returns the step's metrics (``kept_rollouts`` None: nothing
    was kept, nothing trained or written)."""
    from ..trainers.batch import trained_name
    from ..trainers.supervised import SftConfig, sft_in_place

    ok = [o for o in outcomes if o.status == "ok" and o.episode is not None]
    kept = select(ok, s.top_k_per_group, s.min_reward)
    rollouts = len({ep for ep, _ in kept})
    metrics: dict = {"algorithm": "expert_iteration", "rollouts": len(ok), "kept_rollouts": rollouts}
    if not kept:
        return {**metrics, "kept_rollouts": None}
    agents = set(trainer.agents)
    # One shuffle seed per iteration (recorded: the step can be replayed from the published versions).
    options = SftConfig(epochs=s.sft_epochs, lr=s.sft_lr, batch_size=s.sft_batch_size, val_fraction=0.0,
                        seed=s.seed * 1_000_003 + iteration)
    step = sft_in_place(trainer.policy, [o.episode for o in ok], config=trainer.config, options=options,
                        base_names=trainer.base_names, name_of=lambda a: trained_name(a, agents),
                        keep=lambda ep, a: (ep.id, a.agent) in kept)
    metrics.update(sft_seed=options.seed, kept_actions=step["actions"], kept_tokens=step["tokens"],
                   sft_loss=_finite(step["loss"]), sft_token_accuracy=_finite(step["token_accuracy"]),
                   skipped=step["skipped"])
    trainer.save_adapters(Path(out_dir) / "adapters")
    trainer.save_checkpoint(Path(out_dir) / "checkpoint")
    return metrics


def _finite(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float)) and math.isfinite(v)}
