"""One update's rollout data as flat tensors (CleanRL's ``b_obs``, ``b_logprobs``, ... style).

K samples (trainable actions, batch order), N = sum_k L_k action tokens in sample order. A PPO
*unit* is a token for MARFT-T and an action for MARFT-A, so the per-unit tensors are (N,) or (K,).
Token and unit indices of any subset of samples come from ``starts`` / ``lens`` by index
arithmetic, so minibatches and micro-batches slice tensors instead of walking per-sample lists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .advantages import gae_along_d, successors
from .batch import Sample


@dataclass
class RolloutBatch:
    samples: list[Sample]  # K: token ids (packing), agent, D
    token_level: bool  # MARFT-T: units are tokens; MARFT-A: units are actions
    lens: torch.Tensor  # (K,) long, L_k: action tokens of sample k (CPU)
    starts: torch.Tensor  # (K,) long, first token of sample k in the flat (N,) order (CPU)
    b_prox: torch.Tensor  # (N,) proximal token log-probs (adapters at the start of the update)
    b_ref: torch.Tensor  # (N,) reference token log-probs (adapters disabled)
    b_beh: torch.Tensor  # (N,) behaviour token log-probs (the trace's, else proximal)
    b_adv: torch.Tensor  # (U,) advantages (GAE, or a group estimator's), U = N (MARFT-T) or K (MARFT-A)
    b_ret: torch.Tensor | None  # (U,) GAE returns (None: no critic)
    b_val: torch.Tensor | None  # (U,) old values (None: no critic)
    b_feat: torch.Tensor | None  # (U, H) frozen-critic input features, or None (LoRA critic, no critic)
    b_factor: torch.Tensor  # (K,) M per sample, set before each agent's update

    @property
    def K(self) -> int:
        return len(self.samples)

    def tokens(self, idx: list[int]) -> torch.Tensor:
        """(n,) long: flat token positions of samples ``idx``, sample by sample, in that order."""
        i = torch.tensor(idx, dtype=torch.long)
        lens = self.lens[i]
        first = torch.repeat_interleave(self.starts[i], lens)
        offset = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        return (first + offset).to(self.b_prox.device)

    def units(self, idx: list[int]) -> torch.Tensor:
        """(u,) long: unit positions of samples ``idx`` (their tokens, or the samples themselves)."""
        return self.tokens(idx) if self.token_level else torch.tensor(idx, dtype=torch.long,
                                                                       device=self.b_prox.device)

    def action_log_ratios(self, idx: list[int], new_tok: list[torch.Tensor], b_old: torch.Tensor) -> torch.Tensor:
        """(k,) float64: per sample of ``idx``, sum over its tokens of new - old (``new_tok``: its (L_k,)
        log-probs; ``b_old``: a flat (N,) log-prob tensor), summed in fp32 as the ratio the fold uses."""
        if not idx:
            return torch.zeros(0, dtype=torch.float64)
        diff = torch.cat(new_tok) - b_old[self.tokens(idx)]  # (n,) token by token, sample by sample
        seg = torch.repeat_interleave(torch.arange(len(idx)), self.lens[idx]).to(diff.device)  # (n,) its sample
        # index_add_ sums each sample's tokens in order, one segment for all samples
        return diff.new_zeros(len(idx)).index_add_(0, seg, diff).double().cpu()

    def n_units(self, idx: list[int]) -> int:
        return int(self.lens[idx].sum()) if self.token_level else len(idx)

    def n_tokens(self, idx: list[int]) -> int:
        return int(self.lens[idx].sum())

    def logprob_gap(self, current: Callable[[Sample], bool]) -> dict[str, list[float]]:
        """Per agent [sum, count, max] of |recorded behaviour - recomputed proximal| token log-prob over
        the actions ``current`` accepts (played by the current version, behaviour log-probs recorded):
        the train-inference mismatch of the engine that sampled them."""
        out: dict[str, list[float]] = {}
        for k, s in enumerate(self.samples):
            if s.beh_logp is None or len(s.beh_logp) != len(s.act_ids) or not current(s):
                continue
            d = (self.b_beh[self.tokens([k])] - self.b_prox[self.tokens([k])]).abs()
            acc = out.setdefault(s.agent, [0.0, 0.0, 0.0])
            acc[0], acc[1], acc[2] = acc[0] + float(d.double().sum()), acc[1] + d.numel(), max(acc[2], float(d.max()))
        return out


def rollout_batch(samples: list[Sample], passes, config, device, advantages: list[float] | None = None) -> RolloutBatch:
    """Sections 1-2 of the update: rollout statistics with no gradient, then the advantages: GAE
    along D, or ``advantages`` per sample (a group estimator's, groups.py; no critic, no values)."""
    token_level = config.mode == "marft_t"
    lens = torch.tensor([len(s.act_ids) for s in samples], dtype=torch.long)  # (K,)
    starts = torch.cumsum(lens, 0) - lens  # (K,)

    # 1. Per sample (L_k,) proximal / reference token log-probs, old values ((L_k,) MARFT-T,
    #    () MARFT-A; None without a critic); behaviour log-probs from the trace, else proximal (flagged).
    prox, ref, old_v, feats = passes.rollout_stats(samples)
    beh = [torch.tensor(s.beh_logp, dtype=torch.float32, device=device) if s.beh_logp is not None
           and len(s.beh_logp) == len(s.act_ids) else p for s, p in zip(samples, prox)]
    rb = RolloutBatch(samples=samples, token_level=token_level, lens=lens, starts=starts,
                      b_prox=torch.cat(prox), b_ref=torch.cat(ref), b_beh=torch.cat(beh), b_adv=torch.empty(0),
                      b_ret=None, b_val=None, b_feat=None, b_factor=torch.ones(len(samples), device=device))
    if advantages is not None:  # 2. a group estimator's A per action, on every token of it for MARFT-T
        adv = torch.tensor(advantages, dtype=torch.float64)  # (K,)
        rb.b_adv = (adv.repeat_interleave(lens) if token_level else adv).float().to(device)  # (U,)
        return rb

    # 2. GAE by backward induction over D: each action bootstraps from its successors (advantages.py).
    succ = successors([s.parents for s in samples], [s.episode for s in samples])
    adv_d, ret_d = gae_along_d([s.reward for s in samples], [v.reshape(-1) for v in old_v], succ, config.gamma,
                               config.gae_lambda, config.token_gamma, config.token_lambda)
    cat = torch.cat if token_level else torch.stack
    rb.b_adv, rb.b_ret = torch.cat(adv_d).float().to(device), torch.cat(ret_d).float().to(device)
    rb.b_val, rb.b_feat = cat(old_v), None if feats[0] is None else cat(feats)
    return rb
