"""Generalised advantage estimation by backward induction over the dependency graph D.

Each trainable action k bootstraps from its successors in D (``successors``: the samples that
list k among their ``Sample.parents``), not from the next action of a flattened order, so parallel
branches never bootstrap from a sibling. With several successors (fan-out) the bootstrap is the
mean of theirs; an action without successors bootstraps from 0 (the episode's terminal action,
or a branch nothing read). Per action k with successors C_k (1/|C_k| sum; 0 when C_k is empty):

    MARFT-A (one step per action, V_k the value at k's observation):
        delta_k = r_k + gamma * mean_{c in C_k} V_c - V_k
        A_k     = delta_k + gamma * lambda * mean_{c in C_k} A_c

    MARFT-T (one step per token t = 0..L_k-1 of action k; V_{k,0} is the observation's value,
    the reward sits on the last token):
        last token:  delta = r_k + gamma * mean_c V_{c,0} - V_{k,L-1}
                     A_{k,L-1} = delta + gamma * lambda * mean_c A_{c,0}
        inside:      delta = token_gamma * V_{k,t+1} - V_{k,t}
                     A_{k,t} = delta + token_gamma * token_lambda * A_{k,t+1}

Returns are A + V. ``gae_lambda`` applies between actions, ``token_lambda`` (default 1: the whole
return signal reaches the first token, as in value-based LLM PPO, VC-PPO/VAPO) inside an action.
Untrained actions (tools, env steps) are not samples: batch.py moves their rewards onto the
trainable action they depend on, and ``Sample.parents`` skips over them.
"""

from __future__ import annotations

import torch


def successors(parents: list[list[int]], episodes: list[int]) -> list[list[int]]:
    """Per sample: the samples that depend on it in D. An episode whose trainable actions record no
    dependency at all (a capture without D) is taken as the chain of its topological order."""
    n = len(parents)
    out: list[list[int]] = [[] for _ in range(n)]
    for k, ps in enumerate(parents):
        for p in ps:
            out[p].append(k)
    by_episode: dict[int, list[int]] = {}
    for k, e in enumerate(episodes):
        by_episode.setdefault(e, []).append(k)
    for members in by_episode.values():
        if not any(parents[k] for k in members):
            for a, b in zip(members, members[1:]):
                out[a].append(b)
    return out


def gae_along_d(rewards: list[float], values: list[torch.Tensor], succ: list[list[int]], gamma: float,
                lam: float, token_gamma: float = 1.0, token_lambda: float = 1.0):
    """Advantages and returns, one (L_k,) float64 tensor per sample (L_k = 1 for MARFT-A).

    ``values[k]``: (L_k,) values of sample k, ``succ``: from ``successors`` (each successor has a
    larger index: samples are in topological order). Pure function; see the module docstring."""
    vals = [v.detach().double().cpu().tolist() for v in values]
    adv: list[list[float]] = [[] for _ in vals]
    for k in range(len(vals) - 1, -1, -1):
        v, cs = vals[k], succ[k]
        if any(c <= k for c in cs):
            raise ValueError(f"sample {k}: successor not later in topological order")
        next_v = sum(vals[c][0] for c in cs) / len(cs) if cs else 0.0
        next_a = sum(adv[c][0] for c in cs) / len(cs) if cs else 0.0
        a = [0.0] * len(v)
        last = rewards[k] + gamma * next_v - v[-1] + gamma * lam * next_a
        a[-1] = last
        for t in range(len(v) - 2, -1, -1):
            last = token_gamma * v[t + 1] - v[t] + token_gamma * token_lambda * last
            a[t] = last
        adv[k] = a
    adv_t = [torch.tensor(a, dtype=torch.float64) for a in adv]
    ret_t = [a + torch.tensor(v, dtype=torch.float64) for a, v in zip(adv_t, vals)]
    return adv_t, ret_t
