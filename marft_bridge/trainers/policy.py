"""One base model, one named peft LoRA adapter per agent (plus the critic's), log-probs under temperature.

* Base weights: frozen, ``base_dtype`` (auto: bf16 on CUDA, fp32 on CPU). Adapter weights and the
  value head: fp32 always (the reference trained LoRA in fp16 without loss scaling). Over a bf16
  base the base and LoRA matmuls run under bf16 autocast; the LM head's logits and all loss math
  are fp32.
* Attention: ``sdpa`` (PyTorch's fused kernels: flash / memory-efficient on CUDA, no (T x T)
  matrix kept for backward), falling back to the model's default where a model has no sdpa path.
* Gradient checkpointing of the decoder layers (``gradient_checkpointing``; ``None`` = on for CUDA):
  non-reentrant ``torch.utils.checkpoint`` through transformers, plus peft's input-grad hook
  (``enable_input_require_grads``) so checkpointed segments see an input that needs a gradient.
  It is active only in train mode, i.e. in the gradient passes; the no-grad passes keep nothing.
* ``shared_adapter`` (and ``single_agent`` mode) map every agent onto one adapter.
* Log-probs are computed under the temperature the action was sampled with: logits / T, then
  log-softmax. top-k / top-p are *not* re-applied: their truncation set moves as the policy changes,
  so a sampled token can fall outside it and the ratio becomes undefined; the tempered full
  distribution is the smooth policy the behaviour log-probs are compared against (serve with
  ``--logprobs-mode processed_logprobs`` and top-k/top-p off, or expect the capped behaviour weight
  to absorb the difference).
* Only the rows that predict action tokens go through the LM head, in chunks of at most
  ``logits_chunk_tokens`` rows (logprobs.py), so no (tokens, vocab) tensor is ever materialised.
* The reference policy for the KL term is the base model itself: every LoRA layer disabled.
  Switching adapters walks only the LoRA layers, found once, and only when the active one changes
  (peft's ``set_adapter`` / ``disable_adapter`` walk every module on every call: a third of a
  small model's update).
* ``allowed_token_ids`` (vLLM's sampling parameter, recorded in the action's SamplingParams): the
  action was sampled among these tokens only, so every log-prob of it (behaviour, proximal, new,
  reference) is the masked log-softmax over them; a ratio between differently-masked
  distributions would be wrong.
* On-policy sampling (``sample``) is KV-cached: one prefill of the left-padded prompts, then one
  token per step, O(L) per sequence rather than re-running the whole sequence for every token.
* ``parallelism: fsdp2``: the base is built on the meta device and sharded (fsdp.py); every model
  call (hidden states, the chunked head, a decoding step) runs inside the root unit's forward.
"""

from __future__ import annotations

import itertools
import math
import re
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ..errors import MarftError
from . import distributed as D
from . import fsdp
from .config import MarftConfig
from .logprobs import chunked_logprobs

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
class TokenMask:
    """Per action token, the set it was sampled from (allowed_token_ids): row ``index[n]`` of
    ``allowed`` (U, V) bool, or no mask where ``index[n]`` is -1."""

    allowed: torch.Tensor  # (U, V) bool: one row per distinct allowed set
    index: torch.Tensor  # (N,) long: the row of each action token, -1 = every token allowed

    @classmethod
    def build(cls, sets: list[tuple[int, ...] | None], lens: list[int], vocab: int, device) -> TokenMask | None:
        """From each sample's allowed set (None: unmasked) and action length; None when no sample is masked."""
        if all(a is None for a in sets):
            return None
        rows: dict[tuple[int, ...], int] = {}
        per_sample = [-1 if a is None else rows.setdefault(a, len(rows)) for a in sets]
        allowed = torch.zeros((max(len(rows), 1), vocab), dtype=torch.bool)
        for a, r in rows.items():
            allowed[r, list(a)] = True
        index = torch.repeat_interleave(torch.tensor(per_sample, dtype=torch.long), torch.tensor(lens, dtype=torch.long))
        return cls(allowed.to(device), index.to(device))

    def rows(self, sl: slice | None = None) -> torch.Tensor:
        """(n, V) bool for the tokens ``sl``: their allowed set, or all True."""
        idx = self.index if sl is None else self.index[sl]
        return torch.where((idx >= 0)[:, None], self.allowed[idx.clamp(min=0)], True)


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
    """Right-pad the sequences o + a into (B, T) with vectorised index arithmetic (no per-token loop)."""
    olen = torch.tensor([len(o) for o in obs], dtype=torch.long)  # (B,)
    alen = torch.tensor([len(a) for a in acts], dtype=torch.long)  # (B,)
    lengths = olen + alen
    t = int(lengths.max())
    mask = torch.arange(t)[None, :] < lengths[:, None]  # (B, T): row-major order = concatenation order
    ids = torch.full((len(obs), t), pad_id, dtype=torch.long)
    ids[mask] = torch.tensor(list(itertools.chain.from_iterable(o + a for o, a in zip(obs, acts))), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(obs)), alen)  # (N,)
    start = torch.cumsum(alen, 0) - alen  # (B,) first action token of each row in the flat order
    j = torch.arange(int(alen.sum())) - torch.repeat_interleave(start, alen)  # (N,) index inside its action
    cols = torch.repeat_interleave(olen - 1, alen) + j  # position o_len - 1 + j predicts action token j
    targets = torch.tensor(list(itertools.chain.from_iterable(acts)), dtype=torch.long)
    return Packed(ids.to(device), mask.long().to(device), rows.to(device), cols.to(device), targets.to(device),
                  (olen - 1).to(device))


class _TrainMode:
    """Train mode for a block; re-entrant (an fsdp2 idle pass opens one inside a gradient pass)."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.was_training = self.model.training
        if not self.was_training:  # a nested block (a minibatch inside an agent's epochs) walks no modules
            self.model.train()

    def __exit__(self, *exc):
        if not self.was_training:
            self.model.train(False)


def _with_sdpa(build, *args, **kwargs):
    """``build(..., attn_implementation="sdpa")``, or without it for an architecture with no sdpa path."""
    try:
        return build(*args, attn_implementation="sdpa", **kwargs)
    except ValueError as e:
        if "sdpa" not in str(e).lower():
            raise
        return build(*args, **kwargs)


def _load_base(path, dtype):
    from transformers import AutoModelForCausalLM

    return _with_sdpa(AutoModelForCausalLM.from_pretrained, str(path), dtype=dtype)


def _meta_base(path, dtype):
    """The base's architecture on the meta device (fsdp2): no memory, no weights read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return _with_sdpa(AutoModelForCausalLM.from_config, AutoConfig.from_pretrained(str(path)), dtype=dtype)


class MultiAgentPolicy:
    """Base model + per-agent LoRA adapters (+ critic adapter) via peft, on one device (or sharded)."""

    def __init__(self, base_model_path, agents: list[str], config: MarftConfig, device: torch.device):
        from transformers import AutoTokenizer

        self.config = config
        self.device = device
        # fsdp2: the base on the meta device, sharded in place, filled from rank 0 (fsdp.py).
        self.sharded = config.parallelism == "fsdp2"
        auto = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.base_dtype = dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(config.base_dtype, auto)
        source = rng = None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(base_model_path))
            if self.sharded:
                import torch.distributed as dist

                # Rank 0's full copy on the CPU first: it draws the LoRA init as a single process would.
                if dist.get_rank() == 0:
                    source = self._peft(_load_base(base_model_path, dtype), agents)
                rng = torch.get_rng_state()  # rank 0's after the LoRA init (meta-device init may draw)
                base = _meta_base(base_model_path, dtype)
            else:
                base = _load_base(base_model_path, dtype).to(device)
        except (OSError, ValueError) as e:
            raise MarftError(f"cannot load base model {base_model_path}: {e}") from None
        self.vocab_size = base.config.vocab_size
        self.max_context = config.max_context or getattr(base.config, "max_position_embeddings", None) or 2048
        self.chunk_tokens = config.logits_chunk_tokens
        self.model = self._peft(base, agents)
        self.root = fsdp.shard(self.model, source, device, rng) if self.sharded else None
        del source  # rank 0's host copy: every tensor has been sent out
        self.model.eval()
        inner = self.model.get_base_model()
        self.backbone = inner.model  # decoder stack: LoRA layers live inside it
        self.lm_head = inner.lm_head
        self.hidden_size = inner.config.hidden_size
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        from peft.tuners.tuners_utils import BaseTunerLayer

        self._lora_layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        self._active: str | None = self.adapters[0]  # what the LoRA layers run now (None: disabled)
        self._named: dict[str, dict[str, torch.nn.Parameter]] = {}

    def _peft(self, base, agents: list[str]):
        """The peft model over the frozen ``base``: gradient checkpointing, one LoRA adapter per agent
        (and the critic's), fp32 adapter weights; sets the agent -> adapter maps."""
        from peft import LoraConfig, get_peft_model

        config = self.config
        base.requires_grad_(False)
        ckpt = config.gradient_checkpointing
        self.gradient_checkpointing = self.device.type == "cuda" if ckpt is None else ckpt
        if self.gradient_checkpointing:
            if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.23's name
                base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.enable_input_require_grads()  # peft's hook: checkpointed inputs need a gradient
            base.config.use_cache = False
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
            model = get_peft_model(base, lora, adapter_name=self.adapters[0])
        for name in self.adapters[1:]:
            model.add_adapter(name, lora)
        if config.critic and config.critic_backbone == "lora":  # no critic at all under a group estimator
            model.add_adapter(CRITIC_ADAPTER, lora)
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.float()  # fp32 adapters even over a bf16 base
        return model

    # -- adapters ------------------------------------------------------------------------------------

    def adapter_named_params(self, adapter: str) -> dict[str, torch.nn.Parameter]:
        if adapter not in self._named:  # the parameters never change identity after __init__
            out = {}
            for n, p in self.model.named_parameters():
                parts = n.split(".")
                if any(a.startswith("lora_") and b == adapter for a, b in zip(parts, parts[1:])):
                    out[n] = p
            self._named[adapter] = out
        return dict(self._named[adapter])

    def adapter_params(self, adapter: str) -> list[torch.nn.Parameter]:
        return list(self.adapter_named_params(adapter).values())

    def activate(self, adapter: str | None):
        """Context: the named adapter active (only it trainable), or None for the base model."""
        if adapter is None:
            return self._disabled()
        if adapter != self._active:
            # peft's set_adapter on the LoRA layers found once (no modules_to_save here, never merged)
            for layer in self._lora_layers:
                layer.set_adapter(adapter)
            self.model.base_model.active_adapter = adapter
            self._active = adapter
        return nullcontext()

    @contextmanager
    def _disabled(self):
        # What peft's disable_adapter does for LoRA, on the LoRA layers only (found once).
        for layer in self._lora_layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in self._lora_layers:
                layer.enable_adapters(True)

    def grad_mode(self):
        """Context for a gradient pass: train mode (gradient checkpointing and LoRA dropout are active
        only in train mode), back to eval afterwards."""
        return _TrainMode(self.model)

    def autocast(self):
        """bf16 autocast over a bf16 base (base and LoRA matmuls; fp32 master weights stay fp32), else nothing."""
        if self.base_dtype == torch.bfloat16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def gradient_sync(self, on: bool) -> None:
        """fsdp2: whether the next backward reduce-scatters the gradients (off: they accumulate
        unsharded, LoRA-sized, for a later backward to reduce-scatter); a no-op when replicated."""
        if self.sharded:
            self.root.set_requires_gradient_sync(on)

    # -- forward passes ------------------------------------------------------------------------------

    def _call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``; under fsdp2 inside the root unit's forward (fsdp.Root), so the
        embeddings and LM head are all-gathered around it and re-gathered for its backward."""
        return self.root(fn, *args, **kwargs) if self.sharded else fn(*args, **kwargs)

    def hidden(self, packed: Packed) -> torch.Tensor:
        return self._call(self._hidden, packed)

    def _hidden(self, packed: Packed) -> torch.Tensor:
        with self.autocast():
            out = self.backbone(input_ids=packed.input_ids, attention_mask=packed.attention_mask, use_cache=False)
        return out.last_hidden_state

    def token_logprobs(self, adapter: str | None, packed: Packed, temperature: torch.Tensor,
                       with_entropy: bool = False, mask: TokenMask | None = None):
        """Per action token: log pi(y_t | o, y_<t) under logits / T (masked to its allowed set), the
        entropy of that distribution (or None) and the hidden states (B, T, H). The LM head runs
        chunked (logprobs.py)."""
        with self.activate(adapter):
            return self._call(self._token_logprobs, packed, temperature, with_entropy, mask)

    def _token_logprobs(self, packed: Packed, temperature: torch.Tensor, with_entropy: bool, mask):
        h = self._hidden(packed)
        logp, ent = chunked_logprobs(h[packed.rows, packed.cols], self.lm_head, packed.targets, temperature,
                                     self.chunk_tokens, with_entropy, mask)
        return logp, ent, h

    @torch.no_grad()
    def sample(self, agent: str, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float,
               generator: torch.Generator | None = None, use_adapter: bool = True,
               allowed_token_ids: list[int] | None = None):
        """Sample completions with the agent's adapter (pure temperature sampling, seeded generator;
        only among ``allowed_token_ids`` when given, every other logit -inf, as vLLM applies it).

        Returns ``[(token_ids, logprobs)]`` per prompt; log-probs are log-softmax(logits / T), exactly
        what the trainer recomputes and what ``marft serve`` reports with top-k/top-p off. All prompts
        run as one left-padded batch with a KV cache: a prefill, then one token per step. Under fsdp2
        each step is a collective: every rank must call this as often (``train`` does: every rank rolls
        out the same episodes from the same seed); steps go on while any rank has a row unfinished.
        """
        adapter = self.adapter_of[agent] if use_adapter else None
        eos = self.tokenizer.eos_token_id
        n = len(prompt_ids)
        if n == 0:
            return []
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompt_ids):  # left padding: every row's next token is in the last column
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (B, T) positions as if unpadded
        toks: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        alive = [True] * n
        allowed = None
        if allowed_token_ids is not None:
            allowed = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            allowed[list(allowed_token_ids)] = True
        with self.activate(adapter), self.autocast():
            out = self._call(self.model, input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                             logits_to_keep=1)
            for _ in range(max_new_tokens):
                if any(alive):  # fsdp2: a rank whose rows have all ended keeps stepping (below), unsampled
                    z = out.logits[:, -1].float() / temperature  # (B, V)
                    logp = torch.log_softmax(z if allowed is None else z.masked_fill(~allowed, -math.inf), dim=-1)
                    nxt = torch.multinomial(logp.exp().cpu(), 1, generator=generator).squeeze(-1)  # (B,)
                    chosen = logp.gather(-1, nxt.to(self.device)[:, None]).squeeze(-1).tolist()
                    for j, tok in enumerate(nxt.tolist()):
                        if alive[j]:
                            toks[j].append(tok)
                            lps[j].append(float(chosen[j]))
                            alive[j] = tok != eos
                if not (D.any_rank(any(alive), self.device) if self.sharded else any(alive)):
                    break
                attn = torch.cat([attn, attn.new_ones((n, 1))], dim=1)
                pos = pos[:, -1:] + 1
                out = self._call(self.model, input_ids=nxt[:, None].to(self.device), attention_mask=attn,
                                 position_ids=pos, past_key_values=out.past_key_values, use_cache=True)
        return list(zip(toks, lps))
