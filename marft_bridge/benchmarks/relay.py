"""The codebook relay: a task where each agent's best action depends on what its upstream agents do.

An *encoder* sees one of 8 secret words and writes one symbol; each *relay* sees only the previous
symbol and writes one symbol of its own alphabet; the *decoder* sees only the last symbol and must
write the secret word. Reward 1 iff the word is right. ``hops`` is the number of agents (2: encoder
and decoder; 3: encoder, relay, decoder; 4: two relays). Roles write different alphabets (digits,
capital letters, punctuation) unless ``same_alphabet``, where every intermediate symbol is a digit
and one shared adapter would have to implement the different maps from the role prompt alone.

Codes. Each position of the chain has a canonical order of its 8 symbols (a
random relabelling from the seed; the words keep theirs). Code A maps canonical index c to c at
every hop, so the chain composes to the identity. Code B shifts code A by one: every non-final hop
writes the *next* symbol (c + 1 mod 8) and the decoder the *previous* word (c - 1 mod 8). A chain is right for a word iff its shifts sum
to 0 mod 8: all-A, or exactly one upstream B followed by a decoder B. The warm start teaches every
hop the 50/50 mixture of A and B, so the untrained team scores hops / 2**hops (0.5, 0.375, 0.25 for
2, 3, 4 hops) while any consistent choice scores 1.0; an agent's best move depends on the
convention its upstream agents are drifting to, which is what a sequential trust region is for.

The warm start (:func:`warm_start`) trains a tiny character-level Llama on exactly that mixture
(full batch, every prompt with both targets, so the optimum is 50/50 per prompt) and caches it.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
from functools import cached_property
from pathlib import Path

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

WORDS = ("ant", "bee", "cat", "dog", "elk", "fox", "gnu", "hen")
# Intermediate alphabets, one per non-final hop (cycled when there are more hops than alphabets).
ALPHABETS = ("01234567", "ABCDEFGH", "!#$%&*+?")
SIZE = len(WORDS)
RECIPE_VERSION = 2  # bump when the warm-start recipe changes in a way the settings do not show


class RelaySpec(BaseModel):
    """One relay task: number of hops, alphabet variant and the seed its code A is drawn from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hops: int = Field(3, ge=2, le=4)
    same_alphabet: bool = False
    seed: int = 0

    @property
    def agents(self) -> list[str]:
        """Agent (graph node) names in chain order."""
        if self.hops == 2:
            return ["encoder", "decoder"]
        if self.hops == 3:
            return ["encoder", "relay", "decoder"]
        return ["encoder"] + [f"relay{k}" for k in range(1, self.hops - 1)] + ["decoder"]

    def alphabet(self, position: int) -> tuple[str, ...]:
        """Symbols at ``position`` of the chain: 0 and ``hops`` are the words, 1..hops-1 what hops write."""
        if position in (0, self.hops):
            return WORDS
        letters = ALPHABETS[0] if self.same_alphabet else ALPHABETS[(position - 1) % len(ALPHABETS)]
        return tuple(letters)

    @cached_property
    def labels(self) -> list[list[int]]:
        """Per chain position, the canonical index -> symbol index relabelling (random from the seed;
        the words at both ends keep their order)."""
        rng = random.Random(f"relay-code-{self.seed}")
        out = [list(range(SIZE))]
        for _ in range(self.hops - 1):
            perm = list(range(SIZE))
            rng.shuffle(perm)
            out.append(perm)
        return out + [list(range(SIZE))]

    def _code(self, shifts: list[int]) -> list[list[int]]:
        # Hop h maps canonical index c to c + shift_h: symbol x -> labels[h+1][labels[h]^-1[x] + shift_h].
        maps = []
        for h, shift in enumerate(shifts):
            inverse = {s: c for c, s in enumerate(self.labels[h])}
            maps.append([self.labels[h + 1][(inverse[x] + shift) % SIZE] for x in range(SIZE)])
        return maps

    @cached_property
    def code_a(self) -> list[list[int]]:
        """Per hop h, the index map alphabet(h) -> alphabet(h+1) of code A; the chain composes to the identity."""
        return self._code([0] * self.hops)

    @cached_property
    def code_b(self) -> list[list[int]]:
        """Code A shifted by one: upstream hops write the next symbol, the decoder the previous word
        (next and previous in the canonical order, so shifts add up along the chain)."""
        return self._code([1] * (self.hops - 1) + [-1])

    def targets(self, hop: int, index: int) -> tuple[str, str]:
        """What hop ``hop`` writes for input symbol ``index`` under code A and under code B."""
        out = self.alphabet(hop + 1)
        return out[self.code_a[hop][index]], out[self.code_b[hop][index]]

    def messages(self, hop: int, symbol: str) -> list[dict[str, str]]:
        """The chat prompt of hop ``hop``: its role, then only the symbol it was handed."""
        return [{"role": "system", "content": self.agents[hop]}, {"role": "user", "content": symbol}]

    def untrained_j(self) -> float:
        """J of the exact 50/50 mixture: P(shifts sum to 0) = hops / 2**hops."""
        return self.hops / 2 ** self.hops


def reward(secret: str, answer: str | None) -> float:
    """1.0 iff the decoder wrote the secret word (surrounding whitespace ignored)."""
    return 1.0 if answer is not None and answer.strip() == secret else 0.0


# -- warm start ---------------------------------------------------------------------------------------


class WarmStartConfig(BaseModel):
    """The tiny base model and its supervised warm start; their hash names the cache directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 64
    steps: int = Field(800, ge=1)
    lr: float = Field(1e-2, gt=0)
    # even: every hop 50/50 code A / code B (J = hops / 2**hops). miscoordinated: upstream hops 70%
    # code A, the decoder 70% code B, so the team starts at a worse saddle each agent alone cannot leave.
    mix: Literal["even", "miscoordinated"] = "even"


def demonstrations(spec: RelaySpec, mix: str = "even") -> list[tuple[list[dict[str, str]], str]]:
    """Every (prompt, reply) pair of the mixture: each hop, each input symbol, both codes (even:
    once each; miscoordinated: 7 and 3 copies, code A the 7 upstream and code B at the decoder)."""
    out = []
    for hop in range(spec.hops):
        weights = (1, 1) if mix == "even" else (7, 3) if hop < spec.hops - 1 else (3, 7)
        for i, symbol in enumerate(spec.alphabet(hop)):
            for target, w in zip(spec.targets(hop, i), weights):
                out += [(spec.messages(hop, symbol), target)] * w
    return out


def warm_start(spec: RelaySpec, cache_dir: str | Path, config: WarmStartConfig | None = None) -> Path:
    """The warm-started model directory for ``spec`` (seeded by ``spec.seed``), built once and cached.

    Full-batch SFT on :func:`demonstrations` with Adam and a cosine schedule; written atomically.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..demo.warmstart import encode_examples, pad_examples
    from ..demo.tinymodel import build_tiny_model

    config = config or WarmStartConfig()
    # The even mix hashes as before the field existed: its cached models stay valid.
    dumped = config.model_dump(exclude={"mix"} if config.mix == "even" else None)
    blob = json.dumps({"recipe": RECIPE_VERSION, "spec": spec.model_dump(), "config": dumped,
                       "words": WORDS, "alphabets": ALPHABETS}, sort_keys=True)
    target = Path(cache_dir) / f"relay-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"
    if (target / "relay.json").exists():
        return target
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(tmp, seed=spec.seed, hidden_size=config.hidden_size, num_layers=config.num_layers,
                     num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                     intermediate_size=config.intermediate_size, max_positions=64)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    input_ids, attention, labels = pad_examples(encode_examples(tokenizer, demonstrations(spec, config.mix)),
                                                tokenizer.pad_token_id)
    torch.manual_seed(spec.seed)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / config.steps)))
    model.train()
    for _ in range(config.steps):
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    model.save_pretrained(tmp)
    (tmp / "relay.json").write_text(json.dumps({"spec": spec.model_dump(), "config": config.model_dump(),
                                                "final_loss": loss.item()}, indent=2) + "\n")
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target
