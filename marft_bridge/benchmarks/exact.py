"""Exact expected reward of the codebook relay, by enumeration with teacher-forced passes.

Every action is one symbol (or one word) followed by end-of-turn, so hop h's policy over the valid
outputs is a matrix P_h[x, y] = pi_h(y + EOS | prompt(x)), computed for all x, y in one forward
pass per hop. Probability the policy puts on anything else (another string, no stop) is a failure.
With the chain's matrices,

    J = (1/8) sum_w (P_1 P_2 ... P_N)[w, w]
      = (1/8) sum_w sum_d sum_l pi_E(d|w) pi_R(l|d) pi_D(w|l)      (3 hops)

so evaluating a policy has no sampling noise.
"""

from __future__ import annotations

import weakref

import torch

from .relay import SIZE, RelaySpec

_INPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # policy -> {(spec, hop, masked): batch}


def allowed_ids(tokenizer, spec: RelaySpec, hop: int) -> list[int]:
    """The tokens hop ``hop`` may write when its sampling is masked: those of its output alphabet, and EOS."""
    ids = {t for out in spec.alphabet(hop + 1) for t in tokenizer(out, add_special_tokens=False)["input_ids"]}
    return sorted(ids | {tokenizer.eos_token_id})


def hop_matrix(trainer, spec: RelaySpec, hop: int, *, untrained: bool = False,
               temperature: float = 1.0, masked: bool = False) -> torch.Tensor:
    """P[x, y] (SIZE x SIZE, float64) for hop ``hop`` under the trainer's current adapter for that agent
    (or the base model, ``untrained``), at the sampling ``temperature``, over ``allowed_ids`` only when
    ``masked``; one teacher-forced pass."""
    from ..trainers.policy import TokenMask, pack

    policy = trainer.policy
    agent = spec.agents[hop]
    key = (spec, hop, masked)
    cache = _INPUTS.setdefault(policy, {})  # per policy: its tokenizer and device
    if key not in cache:  # the same (SIZE x SIZE) teacher-forced batch after every update
        tok = policy.tokenizer
        obs, acts = [], []
        for symbol in spec.alphabet(hop):
            prompt = list(tok.apply_chat_template(spec.messages(hop, symbol), add_generation_prompt=True,
                                                  tokenize=True)["input_ids"])
            for out in spec.alphabet(hop + 1):
                obs.append(prompt)
                acts.append(list(tok(out, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id])
        packed = pack(obs, acts, policy.pad_id, policy.device)
        allowed = tuple(allowed_ids(tok, spec, hop)) if masked else None
        mask = TokenMask.build([allowed] * len(acts), [len(a) for a in acts], policy.vocab_size, policy.device)
        cache[key] = (packed, mask)
    packed, mask = cache[key]
    temp = torch.full((len(packed.targets),), float(temperature), device=policy.device)
    with torch.no_grad():
        logp, _, _ = policy.token_logprobs(None if untrained else policy.adapter_of[agent], packed, temp, mask=mask)
    seq = torch.zeros(SIZE * SIZE, dtype=torch.float64)
    seq.index_add_(0, packed.rows.cpu(), logp.double().cpu())
    return seq.exp().view(SIZE, SIZE)


def chain_matrices(trainer, spec: RelaySpec, *, untrained: bool = False, temperature: float = 1.0,
                   masked: bool = False):
    return [hop_matrix(trainer, spec, h, untrained=untrained, temperature=temperature, masked=masked)
            for h in range(spec.hops)]


def valid_mass(matrices: list[torch.Tensor]) -> list[float]:
    """Per hop, the mean over inputs of the probability on a valid output (the rest is a failure)."""
    return [float(m.sum(1).mean()) for m in matrices]


def j_from_matrices(matrices: list[torch.Tensor]) -> float:
    """J = trace(P_1 ... P_N) / SIZE."""
    prod = matrices[0]
    for m in matrices[1:]:
        prod = prod @ m
    return float(torch.diagonal(prod).sum() / SIZE)


def exact_j(trainer, spec: RelaySpec, *, untrained: bool = False, temperature: float = 1.0,
            masked: bool = False) -> float:
    """The relay's exact expected reward under the trainer's current adapters."""
    return j_from_matrices(chain_matrices(trainer, spec, untrained=untrained, temperature=temperature, masked=masked))
