"""MarftConfig: every knob of the MARFT trainer in one typed, YAML-loadable object.

Defaults follow the MARFT authors' code (LoRA r=8/alpha=16 on q_proj/v_proj, clip 0.2, entropy
0.01, gamma 0.99, lambda 0.95, grad-norm 0.5, 5 PPO epochs, 4 minibatches, lr 5e-7, critic lr 5e-4)
except where the notes say the reference falls short (KL to the reference is used, the approx-KL
early stop is off unless set, behaviour weights are capped, the sequential trust region weights each
action by its updated ancestors in D, clipped, and GAE runs along D).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class MarftConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Algorithm.
    mode: Literal["marft_a", "marft_t", "single_agent"] = "marft_a"
    # Sequential trust region (factor.py). Agents are updated in a topological order of D across the
    # batch (``random``: a fresh seeded permutation per update); each action's advantage is weighted by
    # M, the product of whole-action ratios pi_new/pi_old (sum log-probs, whatever logprob_reduction)
    # of its sources already updated: ``ancestors`` its ancestors in D within its round, ``step`` the
    # other actions of its (episode, step) (HAPPO, parallel agents), ``round`` every other action of
    # its round whatever its place in D (HAPPO for any order), ``episode`` every other action of its
    # episode (trajectory-level variant), ``none`` M = 1 (independent per-agent PPO).
    agent_order: Literal["dependency", "random"] = "dependency"
    factor_scope: Literal["ancestors", "round", "step", "episode", "none"] = "ancestors"
    # ``stale``: every agent is updated from one iteration's episodes (the later agents' through M).
    # ``rerollout`` (``train(env_fn)``; ``marft service``: one agent per round): the iteration's
    # episodes are split over the agents in update order; after agent k's update its new adapter
    # serves the fresh episodes agent k+1 is updated on.
    # Their behaviour policy already holds agents 1..k's updates, so M = 1 on them (no stale
    # correction is needed); same episodes per iteration, same optimiser steps per agent.
    update_scheme: Literal["stale", "rerollout"] = "stale"
    factor_clip: float | None = Field(0.2, gt=0, lt=1)  # M in [(1-eps)^n, (1+eps)^n], n ratios folded; None: off
    logprob_reduction: Literal["sum", "mean"] = "sum"  # MARFT-A surrogate's action log-prob (M always sums)
    gamma: float = Field(0.99, ge=0, le=1)  # discount per hop between actions (along D)
    gae_lambda: float = Field(0.95, ge=0, le=1)  # GAE lambda between actions (along D)
    token_gamma: float = Field(1.0, ge=0, le=1)  # MARFT-T: discount between tokens of one action
    token_lambda: float = Field(1.0, ge=0, le=1)  # MARFT-T: GAE lambda between tokens of one action
    clip: float = Field(0.2, gt=0)
    value_clip: float = Field(0.2, gt=0)
    huber_delta: float = Field(10.0, gt=0)
    entropy_coef: float = Field(0.01, ge=0)
    kl_coef: float = Field(0.01, ge=0)  # beta: k2 KL(pi || ref) to the reference (adapter disabled)
    value_coef: float = Field(1.0, ge=0)
    # Per minibatch. Under a group estimator (``advantage`` not gae) it defaults to off unless set:
    # GRPO's A is already scaled per group, and ``reward`` exists precisely not to centre the return.
    normalize_advantages: bool = True
    behaviour_weight_cap: float = Field(5.0, gt=0)  # decoupled PPO: cap on exp(proximal - behaviour)
    target_kl: float | None = Field(None, gt=0)  # approx-KL early stop per agent (None: off)

    # Advantage estimator (groups.py). ``gae``: the critic's GAE along D (above). Critic-free, from the
    # rollouts of one task (``Episode.group``; no critic is built or run): ``grpo`` (r - group mean)
    # / group std (``advantage_scale: none``: no std division, Dr.GRPO), ``rloo`` r - mean of the
    # other members, ``reward`` r itself (no baseline, no group needed). r is the acting agent's
    # return in its episode: team rewards + its own agent and action rewards. ``group_by``: ``task``
    # (one group per task and agent over the task's rollouts) or ``task_agent_round`` (AT-GRPO: one
    # agent's actions of one round, rounds as factor.py defines them, across the task's rollouts).
    advantage: Literal["gae", "grpo", "rloo", "reward"] = "gae"
    advantage_scale: Literal["std", "none"] = "std"  # grpo only
    group_by: Literal["task", "task_agent_round"] = "task"
    # Policy-loss reduction over tokens (MARFT-T, whose PPO units are tokens): the mean over all the
    # minibatch's tokens (DAPO), the mean over actions of their token sums (Dr.GRPO, no length
    # normalisation) or of their token means (GRPO). MARFT-A's unit is the whole action already.
    loss_aggregation: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"

    # Which recorded actions an update may learn from (admission.py). max_version_lag: drop (and count
    # ``stale_version``) actions played by an adapter version more than this many versions behind the
    # trainer's current one (None: keep all). allow_foreign: also train on actions a model other than
    # this trainer's adapters or base produced (a hosted model): their tokens were never sampled by our
    # policy, so a PPO ratio against them is biased; off, they are excluded and counted ``foreign_policy``.
    max_version_lag: int | None = Field(None, ge=0)
    allow_foreign: bool = False
    init_adapters: str | None = None  # start each agent's LoRA from <dir>/<agent>/ (peft dir, safetensors)

    # Optimisation.
    lr: float = Field(5e-7, gt=0)
    critic_lr: float = Field(5e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(0.5, gt=0)
    ppo_epochs: int = Field(5, ge=1)
    num_minibatches: int = Field(4, ge=1)
    forward_batch_size: int = Field(16, ge=1)  # at most this many sequences per micro-batch (every pass)
    seed: int = 0

    # Model.
    lora_r: int = Field(8, ge=1)
    lora_alpha: int = Field(16, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"])
    # Parameter sharing: one adapter for every agent. MARFT modes then update it once per PPO epoch on
    # all agents' samples (one group, M = 1): a per-agent sequence would re-update the same weights
    # against stale proximal log-probs, and M would count the earlier groups' change twice.
    shared_adapter: bool = False
    critic_backbone: Literal["frozen", "lora"] = "frozen"  # reference: frozen LM + MLP head
    frozen_agents: list[str] = Field(default_factory=list)  # have adapters, never updated
    default_temperature: float = Field(1.0, gt=0)  # when an action recorded no temperature
    max_context: int | None = Field(None, ge=2)  # None: the base model's max_position_embeddings
    device: Literal["auto", "cpu", "cuda"] = "auto"

    # Scale: memory and multi-GPU (README "Training on GPUs").
    # Padded tokens (rows x longest sequence) per forward/backward in every pass; sequences are sorted
    # by length into micro-batches and gradients accumulate over a minibatch (same step as one batch).
    micro_batch_tokens: int = Field(16384, ge=1)
    # LM-head rows per chunk for log-probs and entropy: peak ~2 x rows x vocab x 4 bytes (0.6 GB at 152k).
    logits_chunk_tokens: int = Field(512, ge=1)
    gradient_checkpointing: bool | None = None  # decoder layers recomputed in backward; None: on for CUDA
    # The frozen base's weights; bfloat16 runs its matmuls under bf16 autocast. auto: bfloat16 on CUDA,
    # float32 on CPU. Adapters, the value head and all loss math are fp32 either way.
    base_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # replicated: every rank holds the base, gradients all-reduced (DDP-style; bases up to ~30B on 80 GB).
    # fsdp2: base and adapters sharded over the torchrun ranks (fully_shard per decoder layer + root,
    # fsdp.py), for bases that do not fit one GPU; refused without a process group.
    parallelism: Literal["replicated", "fsdp2"] = "replicated"

    # Guards.
    collapse_entropy_min: float | None = Field(None, ge=0)  # mean token entropy below this: collapse
    collapse_ref_kl_max: float | None = Field(None, gt=0)  # mean KL to reference above this: collapse

    # Offline data and rollouts.
    batch_episodes: int = Field(64, ge=1)  # episodes per update (`marft train`, on-policy rollouts)
    checkpoint_every: int | None = Field(10, ge=1)  # updates between checkpoints with an out dir (None: never)

    @model_validator(mode="after")
    def _consistent(self) -> MarftConfig:
        if self.loss_aggregation != "token_mean" and self.mode != "marft_t":
            raise ValueError(f"loss_aggregation {self.loss_aggregation} needs mode marft_t (per-token units); "
                             f"mode {self.mode}'s PPO unit is the whole action")
        if self.advantage != "gae" and "normalize_advantages" not in self.model_fields_set:
            self.normalize_advantages = False  # see the field
        return self

    @property
    def critic(self) -> bool:
        """Whether a critic is built and run: only GAE needs values."""
        return self.advantage == "gae"

    @classmethod
    def from_yaml(cls, path: str | Path) -> MarftConfig:
        from ..config_files import load_yaml_config

        return load_yaml_config(cls, path)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
