"""The critic: an fp32 value head on the hidden state of the last observation token.

Backbone: the base model with its own critic LoRA adapter (``critic_backbone: lora``) or the frozen
base (``frozen``). MARFT-A reads one value per action at the last observation token; MARFT-T reads
the value of every prefix (o, y_<t) at the position that predicts token t, whose first entry is the
same last-observation position. Rollout values and the bootstrap of the next action come from this
one function on the same packed input, so they can never be formatted differently. With a frozen
backbone the features are the reference pass's hidden states (computed once per update), so the
critic costs only its head.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .policy import CRITIC_ADAPTER, MultiAgentPolicy, Packed


class ValueHead(torch.nn.Module):
    """MLP value head as in the reference (hidden -> hidden -> 1), fp32."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden_size, hidden_size), torch.nn.GELU(),
                                       torch.nn.Linear(hidden_size, 1)).float()
        torch.nn.init.zeros_(self.mlp[2].weight)  # V = 0 at start: no spurious advantages
        torch.nn.init.zeros_(self.mlp[2].bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(h.float()).squeeze(-1)


def features(h: torch.Tensor, packed: Packed, token_level: bool) -> torch.Tensor:
    """Hidden states the head reads: (B, H) at the last observation token, or (N, H) per action token."""
    if token_level:
        return h[packed.rows, packed.cols]
    return h[torch.arange(h.shape[0], device=h.device), packed.last_obs]


def values(policy: MultiAgentPolicy, head: ValueHead, packed: Packed, token_level: bool) -> torch.Tensor:
    """Values through the critic backbone (critic adapter, or the frozen base) and the head."""
    adapter = CRITIC_ADAPTER if policy.config.critic_backbone == "lora" else None
    train = adapter is not None and torch.is_grad_enabled()  # gradient pass: checkpointing on
    with policy.activate(adapter), (policy.grad_mode() if train else nullcontext()):
        h = policy.hidden(packed)
    return head(features(h, packed, token_level))


def critic_params(policy: MultiAgentPolicy, head: ValueHead) -> list[torch.nn.Parameter]:
    lora = policy.adapter_params(CRITIC_ADAPTER) if policy.config.critic_backbone == "lora" else []
    return lora + list(head.parameters())
