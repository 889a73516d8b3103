"""Token sampling over raw logits, row by row with each request's own settings.

The server samples here rather than through ``generate`` so the log-probs it reports are exactly the
distribution it sampled from ("processed": log-softmax of logits/T after top-k and top-p masking, and
first ``allowed_token_ids``' mask, as vLLM applies them), which is what the trainer's importance
ratios need. Temperature 0 means greedy; its log-probs are the log-softmax of the (masked) logits.
"""

from __future__ import annotations

import torch


def processed_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs ``[B, V]`` after temperature, top-k (0 = off) and top-p (1 = off); masked tokens get -inf.

    ``logits`` is ``[B, V]``; the settings are ``[B]`` tensors, one value per row. ``allowed``
    (``[B, V]`` bool) is vLLM's ``allowed_token_ids``: every other token is masked to -inf first,
    before temperature, top-k and top-p, as vLLM's sampler does.
    """
    logits = logits.float()
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    vocab = logits.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = rank >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (always at least the most likely token).
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    drop &= ~greedy.unsqueeze(1)
    mask = torch.zeros_like(drop).scatter(1, order, drop)
    return scaled.masked_fill(mask, float("-inf")).log_softmax(dim=-1)


def allowed_mask(allowed: list, shape) -> torch.Tensor | None:
    """``[B, V]`` bool, True where a row may sample, from each row's allowed token ids (a LongTensor,
    or None for every token); None when no row is restricted."""
    if all(a is None for a in allowed):
        return None
    mask = torch.ones(shape, dtype=torch.bool)
    for i, ids in enumerate(allowed):
        if ids is not None:
            mask[i] = False
            mask[i, ids] = True
    return mask


def finite(logprob: float) -> float:
    """Masked tokens have -inf log-probs; JSON has no infinity, so vLLM's -9999.0 is reported instead."""
    return logprob if logprob > -9999.0 else -9999.0


def sample_row(logprobs: torch.Tensor, greedy: bool, generator: torch.Generator) -> int:
    """One token id for one row: the argmax when greedy, else a draw from ``exp(logprobs)`` with the
    request's own generator, which nothing else draws from: a seeded request samples the same
    tokens whatever else shares its batch."""
    if greedy:
        return int(logprobs.argmax())
    return int(torch.multinomial(logprobs.exp(), 1, generator=generator))
