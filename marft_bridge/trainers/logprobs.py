"""Chunked LM head: per-action-token log-prob and entropy without a (tokens x vocab) tensor.

For the hidden states h (N, H) of the positions that predict action tokens, the targets y (N,) and
the sampling temperatures T (N,), chunk by chunk of at most ``chunk_tokens`` rows:

    z      = (h W^T + b) / T                       (n, V) fp32, only this chunk's
    lse    = logsumexp_v z_v
    logp   = z_y - lse                             log pi(y | context) under logits / T
    H      = lse - sum_v p_v z_v,  p = softmax(z)  = -sum_v p_v log p_v

The gradient pass saves only h (a custom autograd function, i.e. activation checkpointing of the
head): backward recomputes each chunk's z and applies the closed forms, with a = dL/dlogp and
b = dL/dH per row,

    dlogp/dz_v = [v = y] - p_v         dH/dz_v = -p_v (z_v - sum_u p_u z_u)
    dL/dh      = (1/T) (a ([v = y] - p) - b p (z - E_p z)) W

in place in two (n, V) fp32 buffers.

With a mask (``TokenMask``: the action was sampled with ``allowed_token_ids``) z_v = -inf outside
each row's allowed set before the log-softmax, so p_v = 0 there; the expectations and the backward
read those entries as 0 (p_v z_v = 0, not nan) and the gradient there is 0. Peak memory is two to three (chunk_tokens x V) fp32 buffers
whatever the batch: at a 151,936-token vocabulary and 512-row chunks, under 1 GB; a 32k-token minibatch
unchunked would be 20 GB per copy. A trainable or wrapped LM head (LoRA on ``lm_head``) takes the
generic path: the same formulas through autograd under ``torch.utils.checkpoint`` per chunk.

Under FSDP2 ``lm_head.weight`` is read here outside the HF forward: the caller runs this inside the
root unit's forward (policy ``_call``), so the weight is the all-gathered one; the copy ``_FrozenHead``
saves for backward is re-gathered by FSDP's pre-backward hook, as for any layer's weight.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_TOKENS = 512


def _logits(h, head, temperature, inplace=False, allowed=None):
    z = head(h)  # (n, V), bf16 on CUDA
    z = z.to(torch.promote_types(z.dtype, torch.float32))  # fp32 (fp64) math
    z = z.div_(temperature[:, None]) if inplace else z / temperature[:, None]
    if allowed is None:
        return z
    return z.masked_fill_(~allowed, -math.inf) if inplace else z.masked_fill(~allowed, -math.inf)


def _finite(z, allowed, inplace=False):
    # The masked entries as 0 for sums with p (p_v = 0 there; -inf * 0 would be nan).
    if allowed is None:
        return z
    return z.masked_fill_(~allowed, 0.0) if inplace else z.masked_fill(~allowed, 0.0)


def _expect(p, z):
    return torch.bmm(p[:, None, :], z[:, :, None]).view(-1)  # sum_v p_v z_v without an (n, V) product


def _lse_softmax(z):
    """(logsumexp (n,), softmax (n, V)) with one (n, V) buffer besides z (torch.logsumexp takes two)."""
    m = z.amax(dim=-1, keepdim=True)  # (n, 1)
    e = (z - m).exp_()
    total = e.sum(dim=-1, keepdim=True)
    return (total.log() + m).squeeze(-1), e.div_(total)


def _stats(h, head, targets, temperature, with_entropy, inplace=False, allowed=None):
    # In place (outside autograd) at most two (n, V) buffers are alive at once: z and p.
    z = _logits(h, head, temperature, inplace, allowed)  # (n, V)
    if inplace:
        lse, p = _lse_softmax(z)
    else:
        lse, p = torch.logsumexp(z, dim=-1), None
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    p = torch.softmax(z, dim=-1) if p is None else p
    return logp, lse - _expect(p, _finite(z, allowed, inplace))


class _FrozenHead(torch.autograd.Function):
    """log-prob and entropy through a frozen Linear head; backward recomputes z chunk by chunk."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temperature, chunk, with_entropy, mask):
        head = lambda x: F.linear(x, weight, bias)  # noqa: E731
        outs = [_stats(h[s:s + chunk], head, targets[s:s + chunk], temperature[s:s + chunk], with_entropy, True,
                       None if mask is None else mask.rows(slice(s, s + chunk)))
                for s in range(0, h.shape[0], chunk)]
        ctx.save_for_backward(h, weight, bias, targets, temperature)
        ctx.chunk, ctx.mask = chunk, mask
        logp = torch.cat([o[0] for o in outs])
        ent = torch.cat([o[1] for o in outs]) if with_entropy else logp.new_zeros(0)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, weight, bias, targets, temperature = ctx.saved_tensors
        chunk, grads = ctx.chunk, []
        for s in range(0, h.shape[0], chunk):
            sl = slice(s, s + chunk)
            a, y, t = g_logp[sl, None], targets[sl, None], temperature[sl, None]
            allowed = None if ctx.mask is None else ctx.mask.rows(sl)
            z = _logits(h[sl], lambda x: F.linear(x, weight, bias), temperature[sl], True, allowed)  # (n, V)
            p = _lse_softmax(z)[1]  # (n, V)
            z = _finite(z, allowed, inplace=True)
            if g_ent.numel():
                b = g_ent[sl, None]
                gz = z.sub_(_expect(p, z)[:, None]).mul_(-b).sub_(a).mul_(p)  # -b p (z - Ez) - a p
            else:
                gz = p.mul_(-a)
            gz.scatter_add_(1, y, a).div_(t)  # + a [v = y]; through z = logits / T
            grads.append((gz.to(weight.dtype) @ weight).to(h.dtype))  # (n, H)
            del z, p, gz  # before the next chunk allocates its own
        return torch.cat(grads), None, None, None, None, None, None, None


def chunked_logprobs(h: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: torch.Tensor,
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS, with_entropy: bool = False, mask=None):
    """(logp (N,), entropy (N,) or None) for the rows ``h`` (N, H) through ``lm_head``; ``mask``
    (policy.TokenMask or None): each row's allowed tokens.

    Without autograd the chunks simply run one after another and free their logits.
    """
    if chunk_tokens < 1:
        raise ValueError(f"logits_chunk_tokens must be >= 1, got {chunk_tokens}")
    if h.shape[0] == 0:  # no action tokens
        empty = h.new_zeros(0, dtype=torch.promote_types(h.dtype, torch.float32))
        return empty, (empty if with_entropy else None)
    params = list(lm_head.parameters())
    frozen_linear = type(lm_head) is torch.nn.Linear and not any(p.requires_grad for p in params)
    if frozen_linear:
        h = h.to(lm_head.weight.dtype)
    if frozen_linear and torch.is_grad_enabled() and h.requires_grad:
        logp, ent = _FrozenHead.apply(h, lm_head.weight, lm_head.bias, targets, temperature, chunk_tokens,
                                      with_entropy, mask)
        return logp, (ent if with_entropy else None)
    grad = torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in params))
    outs = []
    for s in range(0, h.shape[0], chunk_tokens):
        sl = slice(s, s + chunk_tokens)
        allowed = None if mask is None else mask.rows(sl)
        args = (h[sl], lm_head, targets[sl], temperature[sl], with_entropy)
        outs.append(checkpoint(_stats, *args, False, allowed, use_reentrant=False) if grad
                    else _stats(*args, True, allowed))
    logp = torch.cat([o[0] for o in outs])
    return logp, (torch.cat([o[1] for o in outs]) if with_entropy else None)
