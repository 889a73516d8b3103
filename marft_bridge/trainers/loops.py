"""The drivers around one update: on-policy iterations (``MarftTrainer.train`` / ``iteration``) and
offline passes over stored traces (``MarftTrainer.fit``). ``trainer`` is the MarftTrainer."""

from __future__ import annotations

from ..errors import MarftError
from .progress import ProgressBar
from .rollout import RolloutPolicy


def train(trainer, env_fn, iterations: int, episodes_per_iteration: int | None = None, progress: bool = False):
    """On-policy MARFT: each iteration rolls out fresh episodes with the current adapters, then updates
    (``update_scheme: rerollout``: one update per agent, each on fresh episodes; ``iteration``)."""
    n = episodes_per_iteration or trainer.config.batch_episodes

    def rollout(policy, k):
        seed = trainer.config.seed * 1_000_003 + trainer.update_count  # from the counter: resumable
        return env_fn(policy, k, seed)

    history = []
    with ProgressBar(iterations, progress) as bar:
        for _ in range(iterations):
            history += iteration(trainer, rollout, n)
            bar(history[-1])
    return history


def iteration(trainer, rollout, n: int) -> list[dict]:
    """One on-policy iteration of ``n`` episodes, ``rollout(policy, k) -> k episodes`` played with the
    adapters ``policy`` (a RolloutPolicy) holds now; the metrics of its updates.

    ``stale``: one rollout of n, one update of every agent. ``rerollout``: n split over the trained
    agents in update order (the order from the first share's batch; the first shares one episode
    larger when n does not divide): agent k is updated alone on its share, which agent k-1's new
    adapter has just played (a swap); M = 1 there. A server-backed ``rollout`` publishes first
    (``policy.save_adapters``). Each update's metrics carry ``rerollout``: agent, episodes, swap."""
    c = trainer.config
    trained = [a for a in trainer.policy.agents if a not in c.frozen_agents]
    if c.update_scheme == "stale" or c.mode == "single_agent" or c.shared_adapter or len(trained) < 2:
        return [trainer.train_on(rollout(RolloutPolicy(trainer), n))]
    shares = [n // len(trained) + (k < n % len(trained)) for k in range(len(trained))]
    episodes = rollout(RolloutPolicy(trainer), shares[0])
    order = trainer.update_order(episodes)
    out = []
    for k, agent in enumerate(order):
        if k:  # the previous agent's new adapter plays this agent's episodes
            episodes = rollout(RolloutPolicy(trainer), shares[k])
        m = trainer.train_on(episodes, agents=[agent])
        m["rerollout"] = {"agent": agent, "episodes": len(episodes), "swap": k > 0}
        out.append(m)
    return out


def fit(trainer, episodes, iterations: int, progress: bool = False) -> list[dict]:
    """Offline MARFT on stored traces: update ``iterations`` times on successive slices of
    ``batch_episodes`` episodes (cycling; the slice comes from the update counter, so resume is exact)."""
    episodes = list(episodes)
    if not episodes:
        raise MarftError("no episodes to train on")
    n = min(trainer.config.batch_episodes, len(episodes))
    history = []
    with ProgressBar(iterations, progress) as bar:
        for _ in range(iterations):
            start = (trainer.update_count * n) % len(episodes)
            chunk = (episodes + episodes)[start:start + n]
            history.append(trainer.train_on(chunk))
            bar(history[-1])
    return history
