"""Generalised advantage estimation for MARFT-A (one step per action) and MARFT-T (one step per token).

Both use the same recursion over a flat sequence of steps; only the per-step discount differs:

    delta_t = r_t + g_t * V_{t+1} * (1 - done_t) - V_t
    A_t     = delta_t + g_t * lambda * (1 - done_t) * A_{t+1}

MARFT-A: the steps are an episode's actions in topological order, g_t = gamma (per hop).
MARFT-T: the steps are the tokens of those actions, g_t = token_gamma inside an action and gamma on
the hop from an action's last token to the next action's first token; the reward sits on the
action's last token. The value of the step after an episode's last one is 0 (done_t = 1).
"""

from __future__ import annotations

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, discounts: torch.Tensor, dones: torch.Tensor, lam: float):
    """Advantages and returns (A + V) for a flat 1-D sequence of steps; pure function."""
    n = rewards.shape[0]
    adv = torch.zeros_like(values)
    last = torch.zeros((), dtype=values.dtype)
    for t in range(n - 1, -1, -1):
        nonterminal = 1.0 - dones[t]
        next_value = values[t + 1] if t + 1 < n else torch.zeros((), dtype=values.dtype)
        delta = rewards[t] + discounts[t] * next_value * nonterminal - values[t]
        last = delta + discounts[t] * lam * nonterminal * last
        adv[t] = last
    return adv, adv + values


def action_level_steps(action_rewards: list[float], episode_ends: list[bool], gamma: float):
    """(rewards, discounts, dones) tensors for MARFT-A from per-action rewards and end flags."""
    r = torch.tensor(action_rewards, dtype=torch.float64)
    g = torch.full_like(r, gamma)
    d = torch.tensor([float(e) for e in episode_ends], dtype=torch.float64)
    return r, g, d


def token_level_steps(action_rewards: list[float], action_lengths: list[int], episode_ends: list[bool],
                      gamma: float, token_gamma: float):
    """(rewards, discounts, dones) tensors for MARFT-T: each action's reward on its last token."""
    r, g, d = [], [], []
    for reward, length, end in zip(action_rewards, action_lengths, episode_ends):
        r += [0.0] * (length - 1) + [reward]
        g += [token_gamma] * (length - 1) + [gamma]
        d += [0.0] * (length - 1) + [float(end)]
    f = torch.float64
    return torch.tensor(r, dtype=f), torch.tensor(g, dtype=f), torch.tensor(d, dtype=f)
