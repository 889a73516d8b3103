"""Per-agent supervised fine-tuning from captured traces (distillation, cold start): ``marft sft`` and
``marft_bridge.trainers.sft(...)``.

The actions of a hosted model carry no log-prob of *our* policy, so a policy-gradient step on them
is wrong (the trainer excludes them as ``foreign_policy``); what they are good for is imitation. One
LoRA adapter per agent on one base model (the LoRA settings, ``max_context``, micro-batching and
precision of ``MarftConfig``), each trained only on its own agent's ``llm`` actions (sft_data.py
renders them token-exactly as the RL trainer does):

    L_sft(theta_i) = - (1 / N) sum_{k in agent i's actions} sum_t log pi_theta_i(y_{k,t} | o_k, y_{k,<t})

with N the number of action tokens in the minibatch (token mean); observation tokens carry no loss
(labels -100 in the usual wording: here only action tokens are ever scored). Agents are trained one
after another, each with its own AdamW; only the active adapter runs and has gradients, so the other
adapters stay bit-identical.

Per agent and epoch: train loss and token accuracy (argmax = the recorded token) over the epoch,
val loss and token accuracy on the held-out episodes (split by episode), in ``OUT/metrics.jsonl``
(``marft plot OUT/metrics.jsonl --keys <agent>/train_loss,<agent>/val_loss,...``).

Out: ``OUT/adapters/<adapter>/`` (adapter_config.json + adapter_model.safetensors: what ``marft adapters
publish`` takes and ``--init-adapters`` starts from). Kill-safe: after every agent epoch the weights,
the agent's optimiser, the RNG and the metrics so far are written to ``OUT/checkpoint`` (a fresh copy
swapped in whole, fsynced); ``resume=True`` continues after the last finished epoch and ends with the
adapters an uninterrupted run writes.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ..errors import MarftError
from .config import MarftConfig
from .sft_data import Example, Examples, build_examples, split_episodes

log = logging.getLogger("marft_bridge.trainers.sft")

CHECKPOINT = "checkpoint"
METRICS = "metrics.jsonl"


class SftConfig(BaseModel):
    """The supervised run's own knobs; the model's (LoRA r/alpha/dropout/targets, context, precision,
    device, micro-batch budget) are the ``MarftConfig``'s."""

    model_config = ConfigDict(extra="forbid")

    epochs: int = Field(3, ge=1)
    lr: float = Field(1e-4, gt=0)  # LoRA SFT, not the 5e-7 of PPO
    batch_size: int = Field(8, ge=1)  # actions per optimiser step (micro-batched by micro_batch_tokens)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    val_fraction: float = Field(0.1, ge=0, lt=1)  # episodes held out (split by episode)
    min_reward: float | None = None  # keep episodes whose team reward >= this (None: every episode)
    per_agent_reward: bool = False  # judge each agent's actions by its own reward where it has one
    seed: int = 0


@dataclass
class SftResult:
    adapters_dir: Path
    metrics: list[dict]  # one row per agent epoch
    examples: dict[str, tuple[int, int]]  # adapter -> (train, val) actions
    skipped: dict[str, int] = field(default_factory=dict)
    flagged: dict[str, int] = field(default_factory=dict)


def _base_names(base_model) -> frozenset[str]:
    # Names the base may be recorded under (policy.base_model): its path and directory name.
    p = str(base_model)
    return frozenset({p, Path(p).name})


def sft_policy(base_model, adapters: list[str], config: MarftConfig, seed: int):
    """The base with one LoRA per adapter (``MarftConfig``'s settings), the init drawn from ``seed``."""
    import torch

    from .policy import MultiAgentPolicy, pick_device

    if config.parallelism != "replicated":
        raise MarftError("marft sft runs on one device (parallelism: replicated)")
    # One adapter per agent and no critic, whatever the RL run's mode.
    cfg = config.model_copy(update={"mode": "marft_a", "shared_adapter": False, "critic_backbone": "frozen"})
    torch.manual_seed(seed)  # the LoRA init
    return MultiAgentPolicy(base_model, adapters, cfg, pick_device(config.device))


def _token_argmax(policy, h_rows):
    # Predicted tokens chunk by chunk: no (tokens x vocab) tensor beyond one chunk.
    import torch

    out = []
    with torch.no_grad(), policy.autocast():
        for s in range(0, h_rows.shape[0], policy.chunk_tokens):
            out.append(policy.lm_head(h_rows[s:s + policy.chunk_tokens]).argmax(-1))
    return torch.cat(out) if out else h_rows.new_zeros(0, dtype=torch.long)


def action_nll(policy, adapter: str, exs: list[Example], denom: int, grad: bool) -> tuple[float, int]:
    """One micro-batch: (sum of -log p over its action tokens, tokens predicted right); backward of
    sum(-log p) / denom when ``grad`` (denom: the minibatch's action tokens, so gradients accumulate
    to the minibatch token mean)."""
    import torch

    from .policy import pack

    packed = pack([e.obs_ids for e in exs], [e.act_ids for e in exs], policy.pad_id, policy.device)
    temp = torch.ones(packed.targets.shape[0], device=policy.device)  # T = 1: the plain likelihood
    with torch.set_grad_enabled(grad):
        logp, _, h = policy.token_logprobs(adapter, packed, temp)  # (N,), (B, T, H)
        nll = -logp.sum()  # L_sft = -(1/N) sum_t log pi(y_t | o, y_<t), N = the minibatch's action tokens
        if grad:
            (nll / denom).backward()
    right = int((_token_argmax(policy, h[packed.rows, packed.cols].detach()) == packed.targets).sum())
    return float(nll.detach()), right


def _epoch(policy, adapter: str, exs: list[Example], opt, config: MarftConfig, sft: SftConfig,
           order: list[int] | None, tick: Callable[[], None]) -> dict:
    """One pass over ``exs`` (train when ``opt`` is given, in ``order``; else evaluation): token-mean
    loss and token accuracy over the pass."""
    import torch

    from . import microbatch

    idx = order if order is not None else list(range(len(exs)))
    nll = right = tokens = steps = 0
    params = policy.adapter_params(adapter)
    for s in range(0, len(idx), sft.batch_size):
        mb = [exs[i] for i in idx[s:s + sft.batch_size]]
        n = sum(len(e.act_ids) for e in mb)
        plan = microbatch.plan([len(e.obs_ids) + len(e.act_ids) for e in mb], config.micro_batch_tokens,
                               config.forward_batch_size)
        for part in plan:
            a, b = action_nll(policy, adapter, [mb[i] for i in part], n, opt is not None)
            nll, right = nll + a, right + b
        tokens += n
        if opt is not None:
            torch.nn.utils.clip_grad_norm_(params, sft.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps += 1
            tick()
    return {"loss": nll / tokens if tokens else math.nan, "token_accuracy": right / tokens if tokens else math.nan,
            "tokens": tokens, "actions": len(idx), "steps": steps}


def _optimizer(policy, adapter: str, sft: SftConfig):
    import torch

    return torch.optim.AdamW(policy.adapter_params(adapter), lr=sft.lr, weight_decay=sft.weight_decay)


def _lora_weights(policy) -> dict:
    return {n: p for n, p in policy.model.named_parameters() if "lora_" in n}


def _save_checkpoint(out: Path, policy, opt, state: dict) -> None:
    """The weights, the current agent's optimiser, the RNG and ``state`` to OUT/checkpoint: written
    beside, fsynced and swapped in whole (a kill leaves the old checkpoint or the new one)."""
    import shutil

    import torch

    from ..durable import replace_dir
    from . import checkpoint

    staging = out / (CHECKPOINT + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    weights = {n: p.detach().cpu() for n, p in _lora_weights(policy).items()}
    optim = {"sft": opt.state_dict()} if opt is not None else {}
    rng = {"torch": torch.get_rng_state()}
    checkpoint.write(staging, weights, optim, rng, state)
    replace_dir(staging, out / CHECKPOINT)
    shutil.rmtree(staging, ignore_errors=True)


def _load_checkpoint(out: Path, policy) -> tuple[dict, dict | None]:
    """(state, the optimiser state dict or None) of OUT/checkpoint, its weights and RNG restored."""
    import torch

    from ..durable import recover_dir
    from . import checkpoint

    if done := recover_dir(out / CHECKPOINT):
        log.warning("checkpoint: %s", done)
    state, weights, optim, rng = checkpoint.read(out / CHECKPOINT, policy.device)
    mine = _lora_weights(policy)
    if set(weights) != set(mine) or any(weights[n].shape != mine[n].shape for n in mine):
        raise MarftError(f"{out / CHECKPOINT} does not match this model / LoRA config")
    with torch.no_grad():
        for n, p in mine.items():
            p.copy_(weights[n])
    torch.set_rng_state(rng["torch"])
    return state, optim.get("sft")


def _fingerprint(adapters: list[str], split: dict[str, tuple[int, int]], config: MarftConfig, sft: SftConfig) -> dict:
    # What a resumed run must share with the one it continues (else the epochs would not add up).
    lora = {k: getattr(config, k) for k in ("lora_r", "lora_alpha", "lora_dropout", "target_modules")}
    return {"adapters": adapters, "examples": {a: list(v) for a, v in split.items()}, "lora": lora,
            "sft": sft.model_dump(mode="json")}


def _resume(out: Path, policy, fingerprint: dict) -> tuple[set, list[dict], dict | None]:
    """(finished (adapter, epoch) pairs, their metric rows, the current agent's optimiser state)."""
    if not (out / CHECKPOINT / "state.json").exists() and not (out / (CHECKPOINT + ".new")).exists() \
            and not (out / (CHECKPOINT + ".old")).exists():
        return set(), [], None
    state, optim = _load_checkpoint(out, policy)
    if state.get("fingerprint") != json.loads(json.dumps(fingerprint)):
        raise MarftError(f"{out / CHECKPOINT} is from another run (agents, data or options differ); "
                         f"use another --out or drop --resume")
    done = {(a, e) for a, e in state["done"]}
    return done, state["metrics"], optim


def _rewrite_metrics(out: Path, rows: list[dict]) -> None:
    # metrics.jsonl holds exactly the finished epochs (a kill between an epoch and its checkpoint
    # must not leave a row the resumed run writes again).
    tmp = out / (METRICS + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out / METRICS)


def _split(examples: Examples, sft: SftConfig) -> tuple[dict, dict]:
    val_ids = split_episodes([e.episode_id for e in examples.all()], sft.val_fraction, sft.seed)
    train = {a: [e for e in exs if e.episode_id not in val_ids] for a, exs in examples.by_adapter.items()}
    val = {a: [e for e in exs if e.episode_id in val_ids] for a, exs in examples.by_adapter.items()}
    return train, val


class _Progress:
    """A rich progress bar over optimiser steps with the last train loss (a no-op when disabled)."""

    def __init__(self, total: int, done: int, enabled: bool):
        self.total, self.done, self.enabled, self.stats = total, done, enabled, ""

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("[bold]SFT {task.fields[agent]}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TextColumn("{task.fields[stats]}"))
            self.bar.start()
            self.task = self.bar.add_task("sft", total=self.total, completed=self.done, agent="", stats="")
        return self

    def agent(self, name: str, stats: str = "") -> None:
        if self.enabled:
            self.bar.update(self.task, agent=name, stats=stats)

    def tick(self) -> None:
        if self.enabled:
            self.bar.update(self.task, advance=1)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()


def select_adapters(episodes: list, agents: list[str] | None = None) -> list[str]:
    """The adapters to train: ``agents`` (adapters, or agent paths mapped to their adapters), else every
    adapter an llm action trains (``adapter_names.adapters_by_agent``)."""
    from ..adapter_names import adapters_by_agent, resolve_adapters

    asked = [a for a in agents or () if a]
    known = adapters_by_agent(episodes, ours=asked)  # a name the user gives is one of ours
    names = resolve_adapters(asked or list(known), known)
    if not names:
        raise MarftError("the episodes have no llm actions to learn from")
    return names


def _agent_epoch(policy, adapter: str, epoch: int, train: list[Example], val: list[Example], opt,
                 config: MarftConfig, sft: SftConfig, bar: _Progress) -> dict:
    """Train ``adapter`` one epoch (a seeded shuffle of its own actions), evaluate it on its held-out
    actions; the metric row."""
    import zlib

    import torch

    internal = policy.adapter_of[adapter]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{sft.seed}/{adapter}/{epoch}".encode()))
    order = torch.randperm(len(train), generator=gen).tolist()
    with policy.grad_mode():  # dropout / checkpointing on in the gradient pass only
        tr = _epoch(policy, internal, train, opt, config, sft, order, bar.tick)
    ev = _epoch(policy, internal, val, None, config, sft, None, lambda: None) if val else None
    row = {"update": epoch, "agent": adapter, "epoch": epoch, "train_loss": tr["loss"],
           "train_token_accuracy": tr["token_accuracy"], "val_loss": ev["loss"] if ev else None,
           "val_token_accuracy": ev["token_accuracy"] if ev else None, "train_actions": tr["actions"],
           "train_tokens": tr["tokens"], "val_actions": ev["actions"] if ev else 0,
           "val_tokens": ev["tokens"] if ev else 0, "steps": tr["steps"]}
    # Per-agent keys too, so `marft plot --keys <agent>/val_loss` draws one curve per agent over epochs.
    row.update({f"{adapter}/{k}": row[k] for k in ("train_loss", "train_token_accuracy", "val_loss",
                                                   "val_token_accuracy") if row[k] is not None})
    return row


def _write_adapters(out: Path, policy) -> Path:
    import shutil

    from ..durable import replace_dir
    from .checkpoint import save_adapters

    staging = out / "adapters.staging"
    shutil.rmtree(staging, ignore_errors=True)
    save_adapters(policy, staging)
    replace_dir(staging, out / "adapters")
    shutil.rmtree(staging, ignore_errors=True)
    return out / "adapters"


def sft(episodes: list, base_model, out, *, agents: list[str] | None = None, config: MarftConfig | None = None,
        options: SftConfig | None = None, resume: bool = False, progress: bool = False,
        on_epoch: Callable[[dict], None] | None = None) -> SftResult:
    """Fine-tune one LoRA adapter per agent on its own recorded actions (see the module docstring).

    ``episodes``: ``schema.Episode`` records (a store's, a JSONL export's). ``agents``: adapters or
    agent paths (default: every adapter an llm action trains). ``config``: the model side
    (``MarftConfig``: LoRA settings, context, precision, device); ``options``: ``SftConfig``.
    ``on_epoch(row)`` is called after each agent epoch's checkpoint is on disk.
    """
    # 1. Options, adapters, the policy (base + one LoRA per adapter).
    config, options = config or MarftConfig(), options or SftConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    adapters = select_adapters(episodes, agents)
    policy = sft_policy(base_model, adapters, config, options.seed)

    # 2. Examples: each action rendered as the RL trainer renders it, reward-filtered, split by episode.
    examples = build_examples(episodes, policy.tokenizer, adapters, vocab_size=policy.vocab_size,
                              max_context=policy.max_context, base_names=_base_names(base_model),
                              min_reward=options.min_reward, per_agent_reward=options.per_agent_reward)
    if not examples.all():
        raise MarftError(f"nothing to learn from in {len(episodes)} episodes "
                         f"(skipped: {dict(examples.skipped) or 'nothing'})")
    if examples.skipped:
        log.warning("skipped: %s", dict(examples.skipped))
    train, val = _split(examples, options)
    split = {a: (len(train[a]), len(val[a])) for a in adapters}

    # 3. Resume after the last finished agent epoch.
    fingerprint = _fingerprint(adapters, split, config, options)
    done, rows, optim_state = _resume(out, policy, fingerprint) if resume else (set(), [], None)
    _rewrite_metrics(out, rows)
    steps = {a: math.ceil(len(train[a]) / options.batch_size) for a in adapters}

    # 4. Agents one after another; only the active adapter has gradients and an optimiser.
    total = sum(steps.values()) * options.epochs
    with _Progress(total, sum(steps[a] for a, _ in done), progress) as bar:
        for adapter in adapters:
            todo = [e for e in range(1, options.epochs + 1) if (adapter, e) not in done]
            if not train[adapter] or not todo:
                continue
            opt = _optimizer(policy, policy.adapter_of[adapter], options)
            if len(todo) < options.epochs and optim_state is not None:
                opt.load_state_dict(optim_state)  # the checkpoint holds this agent's optimiser
            for epoch in todo:
                bar.agent(adapter, f"epoch {epoch}/{options.epochs}")
                row = _agent_epoch(policy, adapter, epoch, train[adapter], val[adapter], opt, config, options, bar)
                rows.append(row)
                done.add((adapter, epoch))
                _save_checkpoint(out, policy, opt, {"done": sorted(done), "metrics": rows,
                                                    "fingerprint": fingerprint})
                _rewrite_metrics(out, rows)
                if on_epoch is not None:
                    on_epoch(row)

    # 5. The adapters, as `marft adapters publish` and `--init-adapters` take them.
    path = _write_adapters(out, policy)
    return SftResult(path, rows, split, dict(examples.skipped), dict(examples.flagged))


def sft_in_place(policy, episodes: list, *, config: MarftConfig, options: SftConfig, base_names=(),
                 name_of: Callable | None = None, keep: Callable | None = None) -> dict:
    """Fine-tune ``policy``'s current adapters in place on these episodes' actions (expert iteration:
    an RL trainer's policy on one round's kept rollouts). Each agent's own ``llm`` actions, rendered as
    ``sft`` renders them (``name_of`` / ``keep``: see ``build_examples``); per adapter a fresh AdamW
    from the weights it holds, ``options.epochs`` seeded passes, no held-out split, nothing written.
    An adapter without a kept action is not touched (bit-identical). Returns per adapter the kept
    actions and tokens, the last epoch's train loss and token accuracy, and the skip counts."""
    import zlib

    import torch

    # 1. Examples per agent, pooled per adapter (shared-adapter modes: several agents, one adapter).
    agents = list(policy.agents)
    examples = build_examples(episodes, policy.tokenizer, agents, vocab_size=policy.vocab_size,
                              max_context=policy.max_context, base_names=base_names, name_of=name_of, keep=keep)
    by_adapter: dict[str, list[Example]] = {}
    for agent in agents:
        by_adapter.setdefault(policy.adapter_of[agent], []).extend(examples.by_adapter[agent])

    # 2. Each adapter on its own examples only: L_sft, token mean per minibatch (see the module docstring).
    out: dict = {"actions": {}, "tokens": {}, "loss": {}, "token_accuracy": {}, "skipped": dict(examples.skipped)}
    for adapter, exs in by_adapter.items():
        out["actions"][adapter], out["tokens"][adapter] = len(exs), sum(len(e.act_ids) for e in exs)
        if not exs:
            continue
        opt = _optimizer(policy, adapter, options)
        for epoch in range(1, options.epochs + 1):
            gen = torch.Generator().manual_seed(zlib.crc32(f"{options.seed}/{adapter}/{epoch}".encode()))
            order = torch.randperm(len(exs), generator=gen).tolist()
            with policy.grad_mode():
                row = _epoch(policy, adapter, exs, opt, config, options, order, lambda: None)
        out["loss"][adapter], out["token_accuracy"][adapter] = row["loss"], row["token_accuracy"]
        opt.zero_grad(set_to_none=True)
    return out
