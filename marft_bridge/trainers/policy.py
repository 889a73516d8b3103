"""One base model, one named peft LoRA adapter per agent (plus the critic's), log-probs under temperature.

* Base weights: bf16 on CUDA, fp32 on CPU, frozen. Adapter weights and the value head: fp32 always
  (the reference trained LoRA in fp16 without loss scaling).
* ``shared_adapter`` (and ``single_agent`` mode) map every agent onto one adapter.
* Log-probs are computed under the temperature the action was sampled with: logits / T, then
  log-softmax. top-k / top-p are *not* re-applied: their truncation set moves as the policy changes,
  so a sampled token can fall outside it and the ratio becomes undefined; the tempered full
  distribution is the smooth policy the behaviour log-probs are compared against (serve with
  ``--logprobs-mode processed_logprobs`` and top-k/top-p off, or expect the capped behaviour weight
  to absorb the difference).
* Only the rows that predict action tokens go through the LM head, so no (batch, tokens, vocab)
  tensor is ever materialised.
* The reference policy for the KL term is the base model itself: ``disable_adapter()``.
"""

from __future__ import annotations

import warnings

import re
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..errors import MarftError
from . import losses as L
from .config import MarftConfig

CRITIC_ADAPTER = "marft_critic"


def pick_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise MarftError("device 'cuda' requested but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def adapter_name(agent: str) -> str:
    # peft adapter names become module keys (no dots) and must not occur inside "lora_": map, not refuse.
    name = re.sub(r"[^A-Za-z0-9_-]", "_", agent)
    return name if name not in "lora_" else f"agent_{name}"


@dataclass
class Packed:
    """A right-padded batch of (observation + action) sequences and where the action tokens are."""

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    rows: torch.Tensor  # (N,) batch row of each action token
    cols: torch.Tensor  # (N,) position whose hidden state predicts that token
    targets: torch.Tensor  # (N,) the action token ids
    last_obs: torch.Tensor  # (B,) position of each sample's last observation token


def pack(obs: list[list[int]], acts: list[list[int]], pad_id: int, device) -> Packed:
    lengths = [len(o) + len(a) for o, a in zip(obs, acts)]
    t = max(lengths)
    ids = torch.full((len(obs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(obs), t), dtype=torch.long)
    rows, cols, targets = [], [], []
    for b, (o, a) in enumerate(zip(obs, acts)):
        seq = o + a
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, : len(seq)] = 1
        for j, tok in enumerate(a):
            rows.append(b)
            cols.append(len(o) - 1 + j)
            targets.append(tok)
    as_t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return Packed(ids.to(device), mask.to(device), as_t(rows), as_t(cols), as_t(targets),
                  as_t([len(o) - 1 for o in obs]))


class MultiAgentPolicy:
    """Base model + per-agent LoRA adapters (+ critic adapter) via peft, on one device."""

    def __init__(self, base_model_path, agents: list[str], config: MarftConfig, device: torch.device):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.device = device
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(base_model_path))
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            base = AutoModelForCausalLM.from_pretrained(str(base_model_path), dtype=dtype)
        except (OSError, ValueError) as e:
            raise MarftError(f"cannot load base model {base_model_path}: {e}") from None
        base.to(device)
        base.requires_grad_(False)
        self.vocab_size = base.config.vocab_size
        self.max_context = config.max_context or getattr(base.config, "max_position_embeddings", None) or 2048
        if not agents:
            raise MarftError("no agents to train: pass agents=[...] or episodes with llm actions")
        self.agents = list(dict.fromkeys(agents))
        if config.mode == "single_agent":
            self.adapter_of = {a: "single" for a in self.agents}
        elif config.shared_adapter:
            self.adapter_of = {a: "shared" for a in self.agents}
        else:
            self.adapter_of = {a: adapter_name(a) for a in self.agents}
            clash = len(set(self.adapter_of.values())) != len(self.agents) or CRITIC_ADAPTER in self.adapter_of.values()
            if clash:
                raise MarftError(f"agent names map to clashing adapter names: {self.adapter_of}")
        self.adapters = list(dict.fromkeys(self.adapter_of.values()))
        lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                          target_modules=list(config.target_modules), task_type="CAUSAL_LM")
        with warnings.catch_warnings():  # peft 0.21 calls an API transformers 5 deprecated; not ours to act on
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            self.model = get_peft_model(base, lora, adapter_name=self.adapters[0])
        for name in self.adapters[1:]:
            self.model.add_adapter(name, lora)
        if config.critic_backbone == "lora":
            self.model.add_adapter(CRITIC_ADAPTER, lora)
        for n, p in self.model.named_parameters():
            if "lora_" in n:
                p.data = p.data.float()  # fp32 adapters even over a bf16 base
        self.model.eval()
        inner = self.model.get_base_model()
        self.backbone = inner.model  # decoder stack: LoRA layers live inside it
        self.lm_head = inner.lm_head
        self.hidden_size = inner.config.hidden_size
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    # -- adapters ------------------------------------------------------------------------------------

    def adapter_params(self, adapter: str) -> list[torch.nn.Parameter]:
        out = []
        for n, p in self.model.named_parameters():
            parts = n.split(".")
            if any(a.startswith("lora_") and b == adapter for a, b in zip(parts, parts[1:])):
                out.append(p)
        return out

    def activate(self, adapter: str | None):
        """Context: the named adapter active (only it trainable), or None for the base model."""
        if adapter is None:
            return self.model.disable_adapter()
        self.model.set_adapter(adapter)
        return nullcontext()

    # -- forward passes ------------------------------------------------------------------------------

    def hidden(self, packed: Packed) -> torch.Tensor:
        out = self.backbone(input_ids=packed.input_ids, attention_mask=packed.attention_mask)
        return out.last_hidden_state

    def token_logprobs(self, adapter: str | None, packed: Packed, temperature: torch.Tensor,
                       with_entropy: bool = False):
        """Per action token: log pi(y_t | o, y_<t) under logits / T, the entropy of that distribution
        (or None) and the hidden states (B, T, H)."""
        with self.activate(adapter):
            h = self.hidden(packed)
        logits = self.lm_head(h[packed.rows, packed.cols]).float() / temperature[:, None]
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, packed.targets[:, None]).squeeze(-1)
        ent = L.entropy(logp_all) if with_entropy else None
        return logp, ent, h

    @torch.no_grad()
    def sample(self, agent: str, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float,
               generator: torch.Generator | None = None, use_adapter: bool = True):
        """Sample completions with the agent's adapter (pure temperature sampling, seeded generator).

        Returns ``[(token_ids, logprobs)]`` per prompt; log-probs are under logits / temperature,
        exactly what the trainer recomputes. Prompts of equal length run as one batch.
        """
        adapter = self.adapter_of[agent] if use_adapter else None
        eos = self.tokenizer.eos_token_id
        results: list = [None] * len(prompt_ids)
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(prompt_ids):
            groups.setdefault(len(p), []).append(i)
        with self.activate(adapter):
            for idx in groups.values():
                seqs = torch.tensor([prompt_ids[i] for i in idx], dtype=torch.long, device=self.device)
                toks = [[] for _ in idx]
                lps = [[] for _ in idx]
                alive = [True] * len(idx)
                for _ in range(max_new_tokens):
                    h = self.backbone(input_ids=seqs).last_hidden_state[:, -1]
                    logp = torch.log_softmax(self.lm_head(h).float() / temperature, dim=-1)
                    nxt = torch.multinomial(logp.exp().cpu(), 1, generator=generator).squeeze(-1)
                    for j, tok in enumerate(nxt.tolist()):
                        if alive[j]:
                            toks[j].append(tok)
                            lps[j].append(float(logp[j, tok]))
                            alive[j] = tok != eos
                    if not any(alive):
                        break
                    seqs = torch.cat([seqs, nxt[:, None].to(self.device)], dim=1)
                for j, i in enumerate(idx):
                    results[i] = (toks[j], lps[j])
        return results
