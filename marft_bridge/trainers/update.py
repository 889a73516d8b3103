"""One update's rollout data as flat tensors (CleanRL's ``b_obs``, ``b_logprobs``, ... style).

K samples (trainable actions, batch order), N = sum_k L_k action tokens in sample order. A PPO
*unit* is a token for MARFT-T and an action for MARFT-A, so the per-unit tensors are (N,) or (K,).
Token and unit indices of any subset of samples come from ``starts`` / ``lens`` by index
arithmetic, so minibatches and micro-batches slice tensors instead of walking per-sample lists.
"""

from __future__ import annotations

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
    b_adv: torch.Tensor  # (U,) GAE advantages, U = N (MARFT-T) or K (MARFT-A)
    b_ret: torch.Tensor  # (U,) GAE returns
    b_val: torch.Tensor  # (U,) old values
    b_feat: torch.Tensor | None  # (U, H) frozen-critic input features, or None (LoRA critic)
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


def rollout_batch(samples: list[Sample], passes, config, device) -> RolloutBatch:
    """Sections 1-2 of the update: rollout statistics with no gradient, then GAE along D."""
    token_level = config.mode == "marft_t"
    lens = torch.tensor([len(s.act_ids) for s in samples], dtype=torch.long)  # (K,)
    starts = torch.cumsum(lens, 0) - lens  # (K,)

    # 1. Per sample (L_k,) proximal / reference token log-probs, old values ((L_k,) MARFT-T,
    #    () MARFT-A); behaviour log-probs from the trace, else proximal (flagged in the batch).
    prox, ref, old_v, feats = passes.rollout_stats(samples)
    beh = [torch.tensor(s.beh_logp, dtype=torch.float32, device=device) if s.beh_logp is not None
           and len(s.beh_logp) == len(s.act_ids) else p for s, p in zip(samples, prox)]

    # 2. GAE by backward induction over D: each action bootstraps from its successors (advantages.py).
    succ = successors([s.parents for s in samples], [s.episode for s in samples])
    adv_d, ret_d = gae_along_d([s.reward for s in samples], [v.reshape(-1) for v in old_v], succ, config.gamma,
                               config.gae_lambda, config.token_gamma, config.token_lambda)
    cat = torch.cat if token_level else torch.stack
    return RolloutBatch(
        samples=samples, token_level=token_level, lens=lens, starts=starts,
        b_prox=torch.cat(prox), b_ref=torch.cat(ref), b_beh=torch.cat(beh),
        b_adv=torch.cat(adv_d).float().to(device), b_ret=torch.cat(ret_d).float().to(device),
        b_val=cat(old_v), b_feat=None if feats[0] is None else cat(feats),
        b_factor=torch.ones(len(samples), device=device))
