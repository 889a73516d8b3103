"""The running batch's tensors and each row's decoding state, for the engine's worker thread.

``Batch`` holds the rows' KV cache left-padded to one length (merging a newly prefilled group into
it, dropping finished rows); ``RowState`` turns a row's sampled ids into text, with stop strings and
the streaming hold-back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .adapter_slots import Slot
from .types import GenerationRequest


class Batch:
    """The running batch: rows, their KV cache (left-padded to one length), attention mask,
    next position ids and the sampled tokens not yet fed to the model."""

    def __init__(self, rows: list[Row], cache, attn, pos, last):
        self.rows, self.cache, self.attn, self.pos, self.last = rows, cache, attn, pos, last

    def merge(self, other: Batch) -> Batch:
        import torch
        import torch.nn.functional as F

        width = max(self.attn.shape[1], other.attn.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            # Left-pad the shorter cache with zeros; the attention mask hides them.
            mine.keys = torch.cat([pad_left(mine.keys, width, dim=2), pad_left(theirs.keys, width, dim=2)])
            mine.values = torch.cat([pad_left(mine.values, width, dim=2), pad_left(theirs.values, width, dim=2)])
        self.attn = torch.cat([F.pad(self.attn, (width - self.attn.shape[1], 0)), F.pad(other.attn, (width - other.attn.shape[1], 0))])
        self.rows = self.rows + other.rows
        self.pos = torch.cat([self.pos, other.pos])
        self.last = torch.cat([self.last, other.last])
        return self

    def select(self, keep: list[int]) -> None:
        import torch

        idx = torch.tensor(keep)
        self.rows = [self.rows[i] for i in keep]
        self.attn, self.pos, self.last = self.attn[idx], self.pos[idx], self.last[idx]
        start = int((self.attn.sum(0) > 0).nonzero()[0])  # columns that are padding for every row left
        self.attn = self.attn[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx, :, start:]
            layer.values = layer.values[idx, :, start:]


def pad_left(t, width: int, dim: int):
    import torch.nn.functional as F

    missing = width - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.dim() - dim - 1) + [missing, 0]
    return F.pad(t, pad)


@dataclass
class Row:
    """One request in the batch."""

    req: GenerationRequest
    slot: Slot | None  # bound when the request joins the batch; never changes afterwards
    state: RowState
    gen: Any  # torch.Generator: the request's own, so batch-mates never change what it samples
    allowed: Any = None  # LongTensor of the token ids it may sample (allowed_token_ids), or None for all


class RowState:
    """Decoded text, stop-string handling and held-back streaming text for one row."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.text = ""
        self.sent = 0
        self.finish: str | None = None

    def add(self, tok: int, logprob: float, top, is_eos: bool, at_limit: bool) -> str:
        self.token_ids.append(tok)
        self.logprobs.append(logprob)
        self.top.append(top)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if is_eos:
            self.finish = "stop"
        for s in self.stop:
            # Search only where the newest token could have completed a stop string.
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                self.finish = "stop"
                break
        if self.finish is None and at_limit:
            self.finish = "length"
        # Hold back text that might be the start of a stop string until it is decided.
        upto = len(self.text) if self.finish else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return delta
