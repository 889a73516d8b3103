"""Chunked LM head: per-action-token log-prob and entropy without a (tokens x vocab) tensor.

For the hidden states h (N, H) of the positions that predict action tokens, the targets y (N,) and
the sampling temperatures T (N,), chunk by chunk of at most ``chunk_tokens`` rows:

    z      = (h W^T + b) / T                       (n, V) fp32, only this chunk's
    lse    = logsumexp_v z_v
    logp   = z_y - lse                             log pi(y | context) under logits / T
    H      = lse - sum_v softmax(z)_v z_v          = -sum_v p_v log p_v

In the gradient pass each chunk runs under activation checkpointing, so backward keeps only the
chunk's input rows and recomputes its logits: peak memory is a few (chunk_tokens x V) fp32
buffers whatever the batch. At a 151,936-token vocabulary one 1,024-row chunk is 0.6 GB per copy;
a 32k-token minibatch unchunked would be 20 GB per copy.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_TOKENS = 1024


def _logits(h, weight, bias, temperature):
    z = F.linear(h, weight, bias)  # (n, V), bf16 on CUDA
    return z.to(torch.promote_types(z.dtype, torch.float32)) / temperature[:, None]  # fp32 (or fp64) math


def _chunk_logp(h, weight, bias, targets, temperature):
    z = _logits(h, weight, bias, temperature)  # (n, V)
    lse = torch.logsumexp(z, dim=-1)  # (n,)
    return z.gather(-1, targets[:, None]).squeeze(-1) - lse


def _chunk_logp_entropy(h, weight, bias, targets, temperature):
    z = _logits(h, weight, bias, temperature)  # (n, V)
    lse = torch.logsumexp(z, dim=-1)  # (n,)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1)  # H = lse - E_p[z]
    return logp, ent


def chunked_logprobs(h: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: torch.Tensor,
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS, with_entropy: bool = False):
    """(logp (N,), entropy (N,) or None) for the rows ``h`` (N, H) through ``lm_head`` (a Linear).

    Under autograd every chunk is checkpointed (recomputed in backward); without it, chunks simply
    run one after another and free their logits.
    """
    if chunk_tokens < 1:
        raise ValueError(f"logits_chunk_tokens must be >= 1, got {chunk_tokens}")
    weight, bias = lm_head.weight, lm_head.bias
    h = h.to(weight.dtype)
    fn = _chunk_logp_entropy if with_entropy else _chunk_logp
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    logps, ents = [], []
    for s in range(0, h.shape[0], chunk_tokens):
        args = (h[s:s + chunk_tokens], weight, bias, targets[s:s + chunk_tokens], temperature[s:s + chunk_tokens])
        out = checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args)
        if with_entropy:
            logps.append(out[0])
            ents.append(out[1])
        else:
            logps.append(out)
    if not logps:  # no action tokens
        empty = h.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)
