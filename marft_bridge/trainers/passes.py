"""The trainer's passes over samples: forwards in token-budget micro-batches, and the fsdp2 idle passes.

Every pass plans its micro-batches with ``micro_batch_tokens`` (microbatch.py). Under ``parallelism:
fsdp2`` every forward and backward is a collective, so every pass runs as many micro-batches on
every rank: the plan is padded to the busiest rank's (``fsdp.pad_plan``) and a rank out of samples
runs empty ones (``idle``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import fsdp, microbatch
from .batch import Sample
from .config import MarftConfig
from .critic import ValueHead, features, values
from .policy import MultiAgentPolicy, TokenMask, pack


class SamplePasses:
    """Micro-batched forwards of the policy (an adapter, or the reference) and the critic over samples."""

    def __init__(self, policy: MultiAgentPolicy, head: ValueHead | None, config: Callable[[], MarftConfig]):
        self.policy, self.head, self.device = policy, head, policy.device
        self._config = config

    @property
    def config(self) -> MarftConfig:
        return self._config()  # the trainer's at each call: a config it is given later applies here too

    def plan(self, samples: list[Sample]) -> list[list[int]]:
        """Micro-batches of ``samples`` (indices): padded tokens <= micro_batch_tokens, sorted by length."""
        plan = microbatch.plan([len(s.obs_ids) + len(s.act_ids) for s in samples], self.config.micro_batch_tokens,
                               self.config.forward_batch_size)
        return fsdp.pad_plan(plan, self.device) if self.policy.sharded else plan  # fsdp2: as many on every rank

    def gradient_plan(self, samples: list[Sample], adapter, critic: bool = False):
        """``plan`` for a gradient pass of ``adapter`` (``critic``: the critic's), its non-empty
        micro-batches a time, for the caller's forward and backward. Under fsdp2 every forward and
        backward is a collective, so the empty micro-batches that pad this rank's plan to the busiest
        rank's run here as one-token passes with a zero loss; and only the last micro-batch's
        backward reduce-scatters: one collective per minibatch."""
        plans = self.plan(samples)
        for k, mb in enumerate(plans):
            self.policy.gradient_sync(k == len(plans) - 1)
            if mb:
                yield mb
            else:
                self._padding_pass(adapter, critic)

    def idle(self, adapter, critic: bool = False) -> None:
        """fsdp2: a rank without samples in this minibatch runs the busiest rank's number of passes."""
        for _ in self.gradient_plan([], adapter, critic):
            pass  # every micro-batch of an empty plan is padding

    def _padding_pass(self, adapter, critic: bool) -> None:
        # FSDP's all-gathers and the reduce-scatter of the adapter's (zero) gradients, as on the other ranks.
        if critic:
            out = values(self.policy, self.head, self.empty_pack(), False)
        else:
            with self.policy.grad_mode():
                out = self.forward(adapter, [], grad=True)[3]
        (out.sum() * 0).backward()

    def forward(self, adapter, samples: list[Sample], grad: bool, entropy: bool = False):
        """(token log-probs, token entropies, the packed batch, hidden states) of one micro-batch."""
        packed = pack([s.obs_ids for s in samples], [s.act_ids for s in samples], self.policy.pad_id,
                      self.device) if samples else self.empty_pack()
        temp = torch.tensor([s.temperature for s in samples for _ in s.act_ids], device=self.device)
        mask = TokenMask.build([s.allowed for s in samples], [len(s.act_ids) for s in samples],
                               self.policy.vocab_size, self.device)  # None when nothing was sampled masked
        with torch.set_grad_enabled(grad):
            logp, ent, h = self.policy.token_logprobs(adapter, packed, temp, with_entropy=entropy, mask=mask)
        return logp, ent, packed, h

    @torch.no_grad()
    def token_logprobs(self, adapter, samples: list[Sample]) -> list[torch.Tensor]:
        """Per sample its (L_k,) token log-probs under ``adapter`` (None: the reference), micro-batched."""
        out: list = [None] * len(samples)
        for mb in self.plan(samples):
            ss = [samples[i] for i in mb]
            logp = self.forward(adapter, ss, grad=False)[0]
            for i, lp in zip(mb, logp.split([len(s.act_ids) for s in ss])):
                out[i] = lp
        return out

    @torch.no_grad()
    def rollout_stats(self, samples: list[Sample]):
        """Per-sample proximal and reference token log-probs, old values and, with a frozen critic
        backbone, the critic's input features (taken from the reference pass: same base hidden states);
        values and features None without a critic (``MarftConfig.critic``)."""
        c, token_level = self.config, self.config.mode == "marft_t"
        frozen = c.critic_backbone == "frozen"
        n = len(samples)
        prox, ref, vals, feats = [None] * n, [None] * n, [None] * n, [None] * n
        by_adapter: dict[str, list[int]] = {a: [] for a in self.policy.adapters}  # every adapter: fsdp2 lockstep
        for i, s in enumerate(samples):
            by_adapter.setdefault(self.policy.adapter_of[s.agent], []).append(i)
        for adapter, idx in by_adapter.items():
            for plan in self.plan([samples[i] for i in idx]):
                chunk = [idx[j] for j in plan]
                ss = [samples[i] for i in chunk]
                lens = [len(s.act_ids) for s in ss]
                logp, _, packed, _ = self.forward(adapter, ss, grad=False)
                logr, _, _, h_ref = self.forward(None, ss, grad=False)
                if not c.critic:  # a group estimator: no value pass at all
                    v, f = [None] * len(chunk), [None] * len(chunk)
                elif frozen:
                    f = features(h_ref, packed, token_level)
                    v = self.head(f)
                    f = f.split(lens) if token_level else f.unbind(0)
                else:
                    v, f = values(self.policy, self.head, packed, token_level), [None] * len(chunk)
                if c.critic:
                    v = v.split(lens) if token_level else v.unbind(0)
                for i, a, b, vv, ff in zip(chunk, logp.split(lens), logr.split(lens), v, f):
                    prox[i], ref[i], vals[i], feats[i] = a, b, vv, ff
        return prox, ref, vals, feats

    def empty_pack(self):
        """An fsdp2 rank's padding micro-batch: token 0 as the observation, no action token."""
        return pack([[0]], [[]], self.policy.pad_id, self.device)
