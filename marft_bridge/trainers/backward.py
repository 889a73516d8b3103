"""The gradient passes of one minibatch: the policy loss (section 3a of the update) and the value loss
(section 4), micro-batch by micro-batch, gradients accumulating.

Each micro-batch's loss terms are weighted by its share of the minibatch over all ranks
(``Counts``: units, tokens and actions summed over the ranks), so the accumulated (and, with several
ranks, summed) gradient is the whole minibatch's. ``trainer`` is the MarftTrainer (its config,
policy, passes, value head and device).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import losses as L
from .critic import values
from .policy import pack
from .update import RolloutBatch

STATS = ("policy_loss", "kl_ref", "entropy", "approx_kl", "clipfrac", "behaviour_weight")


class Counts(NamedTuple):
    """A minibatch's size summed over all ranks: PPO units (tokens for MARFT-T, actions for MARFT-A),
    action tokens, actions."""

    units: float
    tokens: float
    actions: float


def _advantages(trainer, rb: RolloutBatch, mb: list[int]) -> torch.Tensor:
    """(U,) the advantages with this minibatch's normalised (over the whole minibatch, before it is
    split) where ``normalize_advantages``; micro-batches index it by unit."""
    mb_adv = rb.b_adv[rb.units(mb)]  # (u,) this minibatch's advantages
    if trainer.config.normalize_advantages:
        mb_adv = L.normalize(mb_adv)
    adv = torch.empty_like(rb.b_adv)  # (U,) scatter back
    adv[rb.units(mb)] = mb_adv
    return adv


def policy_backward(trainer, adapter: str, rb: RolloutBatch, mb: list[int], n: Counts):
    """Backward of the minibatch's policy loss; returns (the loss value, its stats: this rank's
    minibatch means)."""
    c, S, token_level = trainer.config, rb.samples, rb.token_level
    adv = _advantages(trainer, rb, mb)
    local_units, local_tokens = rb.n_units(mb), rb.n_tokens(mb)
    per_action = token_level and c.loss_aggregation != "token_mean"  # Dr.GRPO / GRPO token reductions
    total, stats = 0.0, dict.fromkeys(STATS, 0.0)
    with trainer.policy.grad_mode():
        for plan in trainer.passes.gradient_plan([S[i] for i in mb], adapter):  # fsdp2: pads run inside
            sub = [mb[j] for j in plan]
            lm = rb.lens[sub].tolist()  # L_b per sample of the micro-batch
            tok = rb.tokens(sub)  # (N,) flat token positions: N = sum L_b
            new_tok, ent, _, _ = trainer.passes.forward(adapter, [S[i] for i in sub], grad=True, entropy=True)  # (N,)
            prox_tok, beh_tok, ref_tok = rb.b_prox[tok], rb.b_beh[tok], rb.b_ref[tok]  # (N,)
            mfac = rb.b_factor[sub]  # (B,) M per sample
            if token_level:  # MARFT-T: one PPO sample per token
                new, old, b = new_tok, prox_tok, beh_tok  # (N,)
                mfac = mfac.repeat_interleave(rb.lens[sub].to(trainer.device))  # (N,)
                a = adv[tok]  # (N,)
            else:  # MARFT-A: one PPO sample per action
                new, old, b = (L.action_logprobs(t, lm, c.logprob_reduction) for t in (new_tok, prox_tok, beh_tok))
                a = adv[sub]  # (B,)
            su, st = new.numel() / n.units, new_tok.numel() / n.tokens  # shares of the minibatch (all ranks)
            w = L.behaviour_weights(old, b, c.behaviour_weight_cap)  # w = min(exp(prox - beh), cap)
            if per_action:
                # L_clip = -sum_t omega_t w_t min(r_t M A, clip(r_t, 1 - eps, 1 + eps) M A), omega_t = 1 / (S L_s)
                # (seq_mean_token_mean) or 1 / S (seq_mean_token_sum); S = actions of the minibatch, all ranks
                omega = L.token_weights(rb.lens[sub], c.loss_aggregation, n.actions).to(new.device)  # (N,)
                pg_loss = -(omega * L.surrogate_terms(new, old, a * mfac, w, c.clip)).sum()
                share = 1.0
            else:
                # L_clip = -E[w * min(r M A, clip(r, 1 - eps, 1 + eps) M A)],  r = exp(new - prox)
                pg_loss = L.clipped_surrogate(new, old, a * mfac, w, c.clip)
                share = su
            # L_KL = E_tokens[1/2 (log pi - log ref)^2]  (k2: its gradient is that of KL(pi || ref))
            kl_loss = L.kl_k2(new_tok, ref_tok).mean()
            # H = E_tokens[-sum_v p_v log p_v]
            entropy = ent.mean()
            loss = share * pg_loss + st * (c.kl_coef * kl_loss - c.entropy_coef * entropy)
            loss.backward()
            total += float(loss.detach())
            with torch.no_grad():  # stats: this rank's minibatch means
                lu, lt = new.numel() / local_units, new_tok.numel() / local_tokens
                ratio = torch.exp(new - old)  # the surrogate's ratio: per action (A) or per token (T)
                stats["policy_loss"] += float(pg_loss) * n.actions / len(mb) if per_action else lu * float(pg_loss)
                stats["kl_ref"] += lt * float(L.kl_k3(new_tok, ref_tok).mean())
                stats["entropy"] += lt * float(entropy)
                stats["approx_kl"] += lu * float(L.approx_kl(new, old))
                stats["clipfrac"] += lu * float(((ratio - 1).abs() > c.clip).float().mean())
                stats["behaviour_weight"] += lu * float(w.mean())
    return total, stats


def critic_backward(trainer, rb: RolloutBatch, mb: list[int], units: float) -> float:
    """Backward of the minibatch's value loss (micro-batched through a LoRA critic backbone); its value."""
    c, S = trainer.config, rb.samples
    frozen = rb.b_feat is not None
    plans = [list(range(len(mb)))] if frozen else trainer.passes.gradient_plan([S[i] for i in mb], None, critic=True)
    total = 0.0
    for plan in plans:
        sub = [mb[j] for j in plan]
        u = rb.units(sub)
        if frozen:  # the reference pass's features, head only
            v = trainer.head(rb.b_feat[u])
        else:
            ss = [S[i] for i in sub]
            packed = pack([s.obs_ids for s in ss], [s.act_ids for s in ss], trainer.policy.pad_id, trainer.device)
            v = values(trainer.policy, trainer.head, packed, rb.token_level)
        # L_V = c_V * E[max(huber(V - R), huber(V_old + clip(V - V_old, -eps_V, eps_V) - R))]
        value_loss = c.value_coef * L.clipped_value_loss(v, rb.b_val[u], rb.b_ret[u], c.value_clip, c.huber_delta)
        loss = value_loss * (v.numel() / units)
        loss.backward()
        total += float(loss.detach())
    return total
