"""The sequential trust-region factor M over the dependency graph D, and the agent order it needs.

Samples are a batch's trainable actions, each episode's in topological order; ``parents[k]`` are
the indices of the nearest trainable actions sample k depends on in D (``Sample.parents``), so a
parent's index is always smaller than its child's.

**Round.** An agent acting again starts a new round (agent i's second turn follows the other
agents' first turns, as in the MARFT paper's rounds 1..N, N+1..2N)::

    round(k) = max( round(p) for p in parents(k);
                    round(j) + 1 for every ancestor j of k (any depth) with agent(j) == agent(k);
                    0 )

so rounds never decrease along D, and an agent never has an ancestor of its own in its round.
A planner -> solver -> planner -> solver chain has rounds 0, 0, 1, 1; the fan-out/fan-in episode
A -> B, A -> C, (B, C) -> D is one round.

**Sources of M.** ``factor_sources`` lists the pairs (k, j): sample j's whole-action ratio
pi_new(a_j|o_j) / pi_old(a_j|o_j) folds into M_k once j's agent has been updated:

* ``ancestors``: j is an ancestor of k in D within k's round (HAPPO's sequential decomposition:
  an action is re-weighted by the updated policies of the actions it read, never by its
  descendants', siblings' or another round's);
* ``round``: j is any other action of k's episode in k's round, whatever its place in D (HAPPO:
  M over every agent already updated in the round; the joint ratio telescopes for any order
  because the joint policy is a product, so a downstream agent or a sibling updated earlier counts
  too, which ``ancestors`` leaves out under a random order);
* ``step``: j acts at the same (episode, step) as k (HAPPO for agents acting in parallel);
* ``episode``: j is any other action of k's episode (trajectory-level variant: it also counts
  descendants and other rounds);
* ``none``: no pairs, M = 1 (independent per-agent PPO).

M is clipped per contributing ratio (A2PO-style): with n_k ratios folded into M_k,
M_k in [(1 - eps)^n_k, (1 + eps)^n_k].
"""

from __future__ import annotations

import torch


def action_rounds(parents: list[list[int]], agents: list[str]) -> list[int]:
    """The round of every sample (module docstring): an agent acting again starts a new round."""
    rounds: list[int] = []
    last_turn: list[dict[str, int]] = []  # per sample: agent -> latest round it acted among ancestors-or-self
    for k, (ps, agent) in enumerate(zip(parents, agents)):
        seen: dict[str, int] = {}
        for p in ps:
            if p >= k:
                raise ValueError(f"sample {k}: parent {p} is not earlier in topological order")
            for a, r in last_turn[p].items():
                seen[a] = max(seen.get(a, -1), r)
        r = max([rounds[p] for p in ps] + [seen.get(agent, -1) + 1, 0])
        seen[agent] = r
        rounds.append(r)
        last_turn.append(seen)
    return rounds


def same_round_ancestors(parents: list[list[int]], agents: list[str]) -> list[set[int]]:
    """Per sample: its ancestors in D within its round (rounds never decrease along D, so a path
    between two same-round actions stays in that round)."""
    rounds = action_rounds(parents, agents)
    anc: list[set[int]] = []
    for k, ps in enumerate(parents):
        a: set[int] = set()
        for p in ps:
            if rounds[p] == rounds[k]:
                a |= {p} | anc[p]
        anc.append(a)
    return anc


def factor_sources(parents: list[list[int]], agents: list[str], episodes: list[int], steps: list[int],
                   scope: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, j) index pairs, as two (P,) long tensors: j's ratio folds into M_k (module docstring)."""
    ks: list[int] = []
    js: list[int] = []
    if scope == "ancestors":
        for k, anc in enumerate(same_round_ancestors(parents, agents)):
            ks += [k] * len(anc)
            js += sorted(anc)
    elif scope in ("round", "step", "episode"):
        rounds = action_rounds(parents, agents) if scope == "round" else None
        groups: dict[tuple, list[int]] = {}
        for k, (e, s) in enumerate(zip(episodes, steps)):
            key = (e, rounds[k]) if scope == "round" else (e, s) if scope == "step" else (e,)
            groups.setdefault(key, []).append(k)
        for members in groups.values():
            for k in members:
                others = [j for j in members if j != k]
                ks += [k] * len(others)
                js += others
    elif scope != "none":
        raise ValueError(f"factor_scope {scope!r}: expected ancestors, round, step, episode or none")
    as_t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return as_t(ks), as_t(js)


def fold_factor(log_m: torch.Tensor, n: torch.Tensor, sources: tuple[torch.Tensor, torch.Tensor],
                log_ratio: torch.Tensor, updated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """After an agent's update: log M_k += sum of log_ratio_j over its sources j that were just
    updated (``updated``: (K,) bool), n_k += their count. log_ratio is the whole-action
    sum log pi_new - sum log pi_old, whatever reduction the surrogate uses. Pure; (K,) float64."""
    k, j = sources
    w = updated[j].to(torch.float64)  # (P,)
    log_m = log_m.index_add(0, k, log_ratio.to(torch.float64)[j] * w)
    n = n.index_add(0, k, w)
    return log_m, n


def clip_factor(log_m: torch.Tensor, n: torch.Tensor, eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, clipped): M = exp(log M) clamped to [(1 - eps)^n, (1 + eps)^n] (eps None: unclipped)."""
    m = torch.exp(log_m)
    if eps is None:
        return m, torch.zeros_like(m, dtype=torch.bool)
    lo, hi = (1.0 - eps) ** n, (1.0 + eps) ** n
    clipped = (m < lo) | (m > hi)
    return torch.minimum(torch.maximum(m, lo), hi), clipped


def factor_stats(m: torch.Tensor, clipped: torch.Tensor, n: torch.Tensor) -> dict[str, float]:
    """M quantiles over the samples whose M folds at least one ratio (others have M = 1 by definition)."""
    live = n > 0
    if not live.any():
        return {"factor_samples": 0, "factor_clipfrac": 0.0, "factor_mean": 1.0, "factor_min": 1.0,
                "factor_q05": 1.0, "factor_q50": 1.0, "factor_q95": 1.0, "factor_max": 1.0}
    x = m[live].to(torch.float64)
    q = torch.quantile(x, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
    return {"factor_samples": int(live.sum()), "factor_clipfrac": float(clipped[live].double().mean()),
            "factor_mean": float(x.mean()), "factor_min": float(x.min()), "factor_q05": q[0],
            "factor_q50": q[1], "factor_q95": q[2], "factor_max": float(x.max())}


def agent_graph_stats(present: list[str], agents: list[str], episodes: list[int],
                      anc: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """(n, n + 3) float64 for the n ``present`` agents, summable across ranks: columns 0..n-1 count
    the pairs (ancestor of agent a, action of agent b) of ``anc`` (a != b); column n the agent's
    actions; n + 1 and n + 2 the sum and count of the positions of its first action per episode."""
    pos = {a: i for i, a in enumerate(present)}
    n = len(present)
    stats = torch.zeros((n, n + 3), dtype=torch.float64)
    for k, j in zip(*(t.tolist() for t in anc)):
        a, b = agents[j], agents[k]
        if a != b and a in pos and b in pos:
            stats[pos[a], pos[b]] += 1
    seen: set[tuple[int, str]] = set()
    episode_pos: dict[int, int] = {}
    for agent, e in zip(agents, episodes):
        p = episode_pos[e] = episode_pos.get(e, -1) + 1
        if agent in pos:
            stats[pos[agent], n] += 1
            if (e, agent) not in seen:
                seen.add((e, agent))
                stats[pos[agent], n + 1] += p
                stats[pos[agent], n + 2] += 1
    return stats


def update_order(agents: list[str], stats: torch.Tensor, how: str, gen: torch.Generator) -> list[str]:
    """The order the sequential update visits ``agents``: those with actions in ``stats``
    (``agent_graph_stats``, summed over ranks), by D (``dependency``) or a seeded permutation."""
    n = len(agents)
    keep = [i for i in range(n) if stats[i, n] > 0]
    present = [agents[i] for i in keep]
    if how == "dependency":
        first = stats[keep, n + 1] / stats[keep, n + 2].clamp(min=1)
        return dependency_order(present, stats[keep][:, keep], first)
    perm = torch.randperm(len(present), generator=gen).tolist()
    return [present[i] for i in perm]


def dependency_order(agents: list[str], edges: torch.Tensor, first_pos: torch.Tensor) -> list[str]:
    """A topological order of ``agents`` by D: ``edges[a, b]`` counts (ancestor of agent a, action of
    agent b) pairs within a round across the batch; ties (and cycles: agents that read each other
    in different episodes) go to the fewest incoming pairs from the agents still unplaced, then the
    earliest mean position of the agent's first action in its episodes, then the name."""
    left = list(range(len(agents)))
    order: list[str] = []
    while left:
        def key(b):
            return (float(sum(edges[a, b] for a in left if a != b)), float(first_pos[b]), agents[b])

        nxt = min(left, key=key)
        order.append(agents[nxt])
        left.remove(nxt)
    return order
