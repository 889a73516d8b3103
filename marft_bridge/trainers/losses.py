"""MARFT losses and weights as pure tensor functions (hand-checkable; see tests/test_marft_math.py).

Per sample s (an action for MARFT-A, a token for MARFT-T) with log-probs under the new policy
(``new``), the proximal policy at the start of the update (``prox``), the behaviour policy that
sampled the trace (``beh``) and the reference (``ref``, adapter disabled):

    ratio_s  = exp(new_s - prox_s)
    w_s      = min(exp(prox_s - beh_s), cap)                  decoupled PPO behaviour weight
    L_clip   = -mean_s w_s * min(ratio_s M_s A_s, clip(ratio_s, 1-eps, 1+eps) M_s A_s)
    M        <- M * exp(new - prox) of the agents already updated in the same episode (or step)
"""

from __future__ import annotations

import torch


def behaviour_weights(prox_logp: torch.Tensor, beh_logp: torch.Tensor, cap: float) -> torch.Tensor:
    # w = min(exp(prox - beh), cap): corrects for traces sampled by an older adapter version.
    return torch.exp(prox_logp - beh_logp).clamp(max=cap)


def clipped_surrogate(new_logp, prox_logp, adv, weights, clip: float) -> torch.Tensor:
    # L = -E[w * min(r A, clip(r, 1-eps, 1+eps) A)], r = exp(new - prox); A already carries M.
    ratio = torch.exp(new_logp - prox_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip) * adv
    return -(weights * torch.minimum(unclipped, clipped)).mean()


def huber(x: torch.Tensor, delta: float) -> torch.Tensor:
    a = x.abs()
    return torch.where(a <= delta, 0.5 * x * x, delta * (a - 0.5 * delta))


def clipped_value_loss(values, old_values, returns, clip: float, delta: float) -> torch.Tensor:
    # L_V = E[max(huber(V - R), huber(V_old + clip(V - V_old, -eps, eps) - R))]
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return torch.maximum(huber(values - returns, delta), huber(clipped - returns, delta)).mean()


def kl_to_reference(new_logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    # k3 estimator of KL(pi || ref) on sampled tokens: exp(ref - new) - (ref - new) - 1  (>= 0, unbiased)
    d = ref_logp - new_logp
    return torch.exp(d) - d - 1.0


def approx_kl(new_logp: torch.Tensor, prox_logp: torch.Tensor) -> torch.Tensor:
    # Same k3 estimator, between the proximal and the new policy (early-stop signal).
    return kl_to_reference(new_logp, prox_logp).mean()


def entropy(logp: torch.Tensor) -> torch.Tensor:
    # H = -sum_v p_v log p_v of the next-token distribution, from its (temperature-scaled) log-probs.
    return -(logp.exp() * logp).sum(-1)


def normalize(adv: torch.Tensor) -> torch.Tensor:
    if adv.numel() < 2:
        return adv
    return (adv - adv.mean()) / (adv.std() + 1e-8)


def fold_factor(m: dict, keys: list, new_logp: torch.Tensor, prox_logp: torch.Tensor) -> dict:
    """M <- M * exp(new - prox) on each sample's key (episode, or episode and step); ratios of one key multiply."""
    out = dict(m)
    ratios = torch.exp(new_logp.detach().double() - prox_logp.detach().double()).tolist()
    for k, r in zip(keys, ratios):
        out[k] = out.get(k, 1.0) * r
    return out
