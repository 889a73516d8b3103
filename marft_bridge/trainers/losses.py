"""MARFT losses and weights as pure tensor functions (hand-checkable; see tests/test_marft_math.py).

Per sample s (an action for MARFT-A, a token for MARFT-T) with log-probs under the new policy
(``new``), the proximal policy at the start of the update (``prox``), the behaviour policy that
sampled the trace (``beh``) and the reference (``ref``, adapter disabled):

    ratio_s  = exp(new_s - prox_s)
    w_s      = min(exp(prox_s - beh_s), cap)                  decoupled PPO behaviour weight
    L_clip   = -mean_s w_s * min(ratio_s M_s A_s, clip(ratio_s, 1-eps, 1+eps) M_s A_s)
               (MARFT-T with loss_aggregation seq_mean_*: -sum_t omega_t w_t min(...), ``token_weights``)
    L_KL     = mean_tokens 1/2 (new - ref)^2                          k2 estimator of KL(pi || ref)

M (factor.py) is the product of the already-updated ancestors' whole-action ratios.
"""

from __future__ import annotations

import torch


def action_logprobs(token_logp: torch.Tensor, lens: list[int], reduction: str) -> torch.Tensor:
    # MARFT-A surrogate's action log-prob: sum (or mean) of its token log-probs. M always sums.
    sums = torch.stack([t.sum() for t in token_logp.split(lens)])
    if reduction == "mean":
        return sums / torch.tensor(lens, dtype=sums.dtype, device=sums.device)
    return sums


def behaviour_weights(prox_logp: torch.Tensor, beh_logp: torch.Tensor, cap: float) -> torch.Tensor:
    # w = min(exp(prox - beh), cap): corrects for traces sampled by an older adapter version.
    return torch.exp(prox_logp - beh_logp).clamp(max=cap)


def surrogate_terms(new_logp, prox_logp, adv, weights, clip: float) -> torch.Tensor:
    # Per unit w * min(r A, clip(r, 1-eps, 1+eps) A), r = exp(new - prox); A already carries M.
    ratio = torch.exp(new_logp - prox_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip) * adv
    return weights * torch.minimum(unclipped, clipped)


def clipped_surrogate(new_logp, prox_logp, adv, weights, clip: float) -> torch.Tensor:
    # L = -E[w * min(r A, clip(r, 1-eps, 1+eps) A)]: the mean over units (token_mean for MARFT-T).
    return -surrogate_terms(new_logp, prox_logp, adv, weights, clip).mean()


def token_weights(lens: torch.Tensor, how: str, n_actions: float) -> torch.Tensor:
    # (N,) omega_t of each token of actions with these lengths, L_clip = -sum_t omega_t term_t:
    # seq_mean_token_mean 1 / (S L_s) (GRPO), seq_mean_token_sum 1 / S (Dr.GRPO, verl's no-constant form);
    # S = actions in the whole minibatch (all ranks), so micro-batches and ranks add up to it.
    if how not in ("seq_mean_token_mean", "seq_mean_token_sum"):
        raise ValueError(f"loss_aggregation {how!r} has no per-action token weights")
    per_action = 1.0 / lens.double() if how == "seq_mean_token_mean" else torch.ones(len(lens), dtype=torch.float64)
    return (per_action / n_actions).repeat_interleave(lens).float()


def huber(x: torch.Tensor, delta: float) -> torch.Tensor:
    a = x.abs()
    return torch.where(a <= delta, 0.5 * x * x, delta * (a - 0.5 * delta))


def clipped_value_loss(values, old_values, returns, clip: float, delta: float) -> torch.Tensor:
    # L_V = E[max(huber(V - R), huber(V_old + clip(V - V_old, -eps, eps) - R))]
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return torch.maximum(huber(values - returns, delta), huber(clipped - returns, delta)).mean()


def kl_k2(new_logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    # k2 = 1/2 (log pi - log ref)^2 per sampled token. Its gradient (log pi - log ref) grad log pi has
    # expectation grad KL(pi || ref) under tokens sampled from pi (exact on-policy, first order off it);
    # the k3 estimator's loss gradient would be that of KL(ref || pi) instead.
    return 0.5 * (new_logp - ref_logp) ** 2


def kl_k3(new_logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    # k3 = exp(ref - new) - (ref - new) - 1 >= 0: unbiased *value* of KL(pi || ref) on tokens from pi
    # (the logged kl_ref; not used as a loss, see kl_k2).
    d = ref_logp - new_logp
    return torch.exp(d) - d - 1.0


def approx_kl(new_logp: torch.Tensor, prox_logp: torch.Tensor) -> torch.Tensor:
    # CleanRL's (r - 1) - log r, r = exp(new - prox): from the same ratio the surrogate and clipfrac use.
    log_ratio = new_logp - prox_logp
    return (torch.exp(log_ratio) - 1.0 - log_ratio).mean()


def entropy(logp: torch.Tensor) -> torch.Tensor:
    # H = -sum_v p_v log p_v of the next-token distribution, from its (temperature-scaled) log-probs.
    return -(logp.exp() * logp).sum(-1)


def normalize(adv: torch.Tensor) -> torch.Tensor:
    if adv.numel() < 2:
        return adv
    return (adv - adv.mean()) / (adv.std() + 1e-8)
