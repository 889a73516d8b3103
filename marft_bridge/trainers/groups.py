"""Group-relative advantages without a critic (GRPO, Dr.GRPO, RLOO, the raw return), per agent.

A *group* holds comparable outcomes of one task's rollouts (``Episode.group``: task id, rollout).
Each trainable action k of agent i in episode e scores r_k = R(e, i), the agent's return in its
episode: the team rewards of e plus the rewards addressed to i (agent rewards, and action rewards
on i's actions). With a team reward only, every agent scores the team's return (MAGRPO); where the
reward function gave per-agent rewards, each agent is scored on its own.

``group_by``:
* ``task``: one group per (task, agent) whose members are the task's rollouts in the batch, member e
  scoring R(e, i), whether or not agent i acted in e (its team part is still its outcome). Every
  action of agent i in rollout e gets that member's advantage.
* ``task_agent_round`` (AT-GRPO's agent- and turn-wise groups): one group per (task, agent, round),
  its members agent i's actions of that round across the task's rollouts (rounds as factor.py
  defines them: an agent acting again starts a new round). AT-GRPO samples a turn's candidates
  from one shared state; across independent rollouts the members share only the task and the
  round, an approximation.

Per member m of group g with scores r_1..r_G:

    grpo:    A_m = (r_m - mean_g r) / (std_g r + eps)    (``advantage_scale: none``: no division, Dr.GRPO)
    rloo:    A_m = r_m - 1/(G-1) sum_{j != m} r_j
    reward:  A_m = r_m                                   (no baseline; no group needed)

std is the sample standard deviation (Bessel, as torch.std, verl and TRL take it), eps = 1e-6. A
group of one member gets A = 0 under grpo and rloo (counted ``group_singletons``); a group whose
scores are all equal gives A = 0 everywhere (counted ``groups_all_equal``: DAPO filters them).
Members are gathered over all ranks first (``gather``), so a group split by the data-parallel
sharding still has one mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..errors import MarftError

EPS = 1e-6

Key = tuple  # (task, agent) or (task, agent, round)
Members = dict[Key, dict[str, float]]  # group -> member id -> score


def missing_groups(episodes, advantage: str) -> None:
    """Refuse a batch a group estimator cannot score: every episode needs ``Episode.group``."""
    if advantage not in ("grpo", "rloo"):
        return
    n = sum(1 for ep in episodes if ep.group is None)
    if n:
        raise MarftError(f"advantage: {advantage} compares the rollouts of one task, but {n} of {len(episodes)} "
                         "episodes have no group (Episode.group: task id and rollout, as `marft fit` records it); "
                         "use advantage: gae or reward for them")


def members(batch, agents: list[str], rounds: list[int], group_by: str) -> tuple[Members, list[tuple[Key, str]]]:
    """This rank's group members and, per sample, (its group, its member id).

    ``task``: member = episode id, for every agent in ``agents`` (the trainer's, the same on every
    rank); ``task_agent_round``: member = action id."""
    groups: Members = {}
    where: list[tuple[Key, str]] = []
    if group_by == "task":
        for e, (ep_id, grp) in enumerate(zip(batch.episode_ids, batch.episode_groups)):
            for agent in agents:
                score = batch.team_returns[e] + batch.own_returns[e].get(agent, 0.0)
                groups.setdefault((grp[0], agent), {})[ep_id] = score
        for s in batch.samples:
            where.append(((s.group[0], s.agent), s.episode_id))
    elif group_by == "task_agent_round":
        for s, r in zip(batch.samples, rounds):
            key = (s.group[0], s.agent, r)
            groups.setdefault(key, {})[f"{s.episode_id}/{s.action_id}"] = s.ret
            where.append((key, f"{s.episode_id}/{s.action_id}"))
    else:
        raise ValueError(f"group_by {group_by!r}: expected task or task_agent_round")
    return groups, where


def merge(parts: list[Members]) -> Members:
    """The union of every rank's members (``torch.distributed.all_gather_object``'s list)."""
    out: Members = {}
    for part in parts:
        for key, ms in part.items():
            out.setdefault(key, {}).update(ms)
    return out


def advantage(scores: dict[str, float], member: str, how: str, scale: str) -> float:
    """A of ``member`` in a group with these ``scores`` (module docstring)."""
    r = scores[member]
    if how == "reward":
        return r
    g = len(scores)
    if g < 2:
        return 0.0
    total = math.fsum(scores.values())
    if how == "rloo":
        return r - (total - r) / (g - 1)
    mean = total / g
    if scale == "none":
        return r - mean
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in scores.values()) / (g - 1))
    return (r - mean) / (std + EPS)


def group_advantages(batch, agents: list[str], rounds: list[int], config,
                     gather: Callable[[Members], list[Members]] = lambda m: [m]) -> tuple[list[float], dict]:
    """Per sample its advantage, and the groups' statistics for the metrics."""
    if config.advantage == "reward":
        return [s.ret for s in batch.samples], {}
    local, where = members(batch, agents, rounds, config.group_by)
    groups = merge(gather(local))
    adv = [advantage(groups[key], m, config.advantage, config.advantage_scale) for key, m in where]
    sizes = [len(ms) for ms in groups.values()]
    stats = {"groups": len(groups), "group_size_mean": sum(sizes) / len(sizes) if sizes else 0.0,
             "group_singletons": sum(1 for n in sizes if n < 2),
             "groups_all_equal": sum(1 for ms in groups.values() if len(ms) > 1 and len(set(ms.values())) == 1)}
    return adv, stats
