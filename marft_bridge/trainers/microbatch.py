"""Token-budget micro-batches: which sequences run together in one forward (and backward).

Every pass over the samples (proximal, reference and value no-grad passes, the policy and critic
gradient passes, the M fold) walks the micro-batches this plans instead of a fixed number of
sequences. Sequences are sorted by length, longest first, and cut greedily so that each
micro-batch's *padded* size (rows x its longest sequence) stays within ``budget`` tokens; sorting
keeps right-padding small even when observations grow along the agent chain. A sequence longer
than the budget runs alone (it cannot be split: attention spans the whole sequence).

Gradient accumulation over the micro-batches of one minibatch weights each micro-batch's mean loss
by its share of the minibatch (``weights``), so the accumulated gradient is the whole minibatch's.
"""

from __future__ import annotations


def plan(lengths: list[int], budget: int, max_rows: int | None = None) -> list[list[int]]:
    """Indices into ``lengths`` grouped into micro-batches of padded size <= budget (one per
    over-long sequence) and at most ``max_rows`` sequences, longest first; every index exactly once."""
    if budget < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        # Sorted longest first: the current micro-batch's width is its first sequence's length.
        if cur and (lengths[cur[0]] * (len(cur) + 1) > budget or (max_rows and len(cur) >= max_rows)):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def weights(counts: list[int]) -> list[float]:
    """Each micro-batch's share of the minibatch (by samples or tokens, whichever the loss averages
    over): sum_k share_k * mean_k = the minibatch mean."""
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


def padded_tokens(lengths: list[int], batches: list[list[int]]) -> int:
    """Tokens the planned forwards compute, padding included (for benchmarks and logs)."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
