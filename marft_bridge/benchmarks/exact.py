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

import torch

from .relay import SIZE, RelaySpec


def hop_matrix(trainer, spec: RelaySpec, hop: int, *, untrained: bool = False,
               temperature: float = 1.0) -> torch.Tensor:
    """P[x, y] (SIZE x SIZE, float64) for hop ``hop`` under the trainer's current adapter for that agent
    (or the base model, ``untrained``), at the sampling ``temperature``; one teacher-forced pass."""
    from ..trainers.policy import pack

    policy = trainer.policy
    tok = policy.tokenizer
    agent = spec.agents[hop]
    obs, acts = [], []
    for symbol in spec.alphabet(hop):
        prompt = list(tok.apply_chat_template(spec.messages(hop, symbol), add_generation_prompt=True,
                                              tokenize=True)["input_ids"])
        for out in spec.alphabet(hop + 1):
            obs.append(prompt)
            acts.append(list(tok(out, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id])
    packed = pack(obs, acts, policy.pad_id, policy.device)
    temp = torch.full((len(packed.targets),), float(temperature), device=policy.device)
    with torch.no_grad():
        logp, _, _ = policy.token_logprobs(None if untrained else policy.adapter_of[agent], packed, temp)
    seq = torch.zeros(len(obs), dtype=torch.float64)
    seq.index_add_(0, packed.rows.cpu(), logp.double().cpu())
    return seq.exp().view(SIZE, SIZE)


def chain_matrices(trainer, spec: RelaySpec, *, untrained: bool = False, temperature: float = 1.0):
    return [hop_matrix(trainer, spec, h, untrained=untrained, temperature=temperature) for h in range(spec.hops)]


def j_from_matrices(matrices: list[torch.Tensor]) -> float:
    """J = trace(P_1 ... P_N) / SIZE."""
    prod = matrices[0]
    for m in matrices[1:]:
        prod = prod @ m
    return float(torch.diagonal(prod).sum() / SIZE)


def exact_j(trainer, spec: RelaySpec, *, untrained: bool = False, temperature: float = 1.0) -> float:
    """The relay's exact expected reward under the trainer's current adapters."""
    return j_from_matrices(chain_matrices(trainer, spec, untrained=untrained, temperature=temperature))
