"""The critic: an fp32 value head on the hidden state of the last observation token.

Backbone: the base model with its own critic LoRA adapter (``critic_backbone: lora``) or the frozen
base (``frozen``). MARFT-A reads one value per action at the last observation token; MARFT-T reads
the value of every prefix (o, y_<t) at the position that predicts token t, whose first entry is the
same last-observation position. Rollout values and the bootstrap of the next action come from this
one function on the same packed input, so they can never be formatted differently.
"""

from __future__ import annotations

import torch

from .policy import CRITIC_ADAPTER, MultiAgentPolicy, Packed


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1, dtype=torch.float32)
        torch.nn.init.zeros_(self.linear.weight)  # V = 0 at start: no spurious advantages
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h.float()).squeeze(-1)


def values(policy: MultiAgentPolicy, head: ValueHead, packed: Packed, token_level: bool) -> torch.Tensor:
    """(B,) values at each sample's last observation token, or (N,) per action token when token_level."""
    adapter = CRITIC_ADAPTER if policy.config.critic_backbone == "lora" else None
    with policy.activate(adapter):
        h = policy.hidden(packed)
    if token_level:
        return head(h[packed.rows, packed.cols])
    rows = torch.arange(h.shape[0], device=h.device)
    return head(h[rows, packed.last_obs])


def critic_params(policy: MultiAgentPolicy, head: ValueHead) -> list[torch.nn.Parameter]:
    lora = policy.adapter_params(CRITIC_ADAPTER) if policy.config.critic_backbone == "lora" else []
    return lora + list(head.parameters())
