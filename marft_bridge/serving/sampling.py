"""Token sampling over raw logits, row by row with each request's own settings.

The server samples here rather than through ``generate`` so the log-probs it reports are exactly the
distribution it sampled from ("processed": log-softmax of logits/T after top-k and top-p masking),
which is what the trainer's importance ratios need. Temperature 0 means greedy; its log-probs are
the plain log-softmax of the logits.
"""

from __future__ import annotations

import torch


def processed_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Log-probs ``[B, V]`` after temperature, top-k (0 = off) and top-p (1 = off); masked tokens get -inf.

    ``logits`` is ``[B, V]``; the settings are ``[B]`` tensors, one value per row.
    """
    logits = logits.float()
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


def sample_row(logprobs: torch.Tensor, greedy: bool, generator: torch.Generator) -> int:
    """One token id for one row: the argmax when greedy, else a draw from ``exp(logprobs)`` with the
    request's own generator, which nothing else draws from: a seeded request samples the same
    tokens whatever else shares its batch."""
    if greedy:
        return int(logprobs.argmax())
    return int(torch.multinomial(logprobs.exp(), 1, generator=generator))
