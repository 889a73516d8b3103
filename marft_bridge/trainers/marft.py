"""The MARFT training loop: per-agent LoRA PPO with a sequential trust-region update.

One update on a batch of episodes (``MarftTrainer.train_on``):

1. Build samples (batch.py): trainable actions in topological order, rewards placed; actions of a
   foreign policy or a stale adapter version excluded and counted (admission.py).
2. With no gradient: proximal log-probs (current adapters), reference log-probs (adapters
   disabled), values (critic). Behaviour log-probs from the trace, or the proximal ones when the
   trace has none (flagged, treated as on-policy). Advantages: GAE by backward induction over D,
   per action (MARFT-A) or per token (MARFT-T), each action bootstrapping from its successors in D
   (advantages.py); or critic-free and group-relative (``advantage: grpo | rloo | reward``,
   groups.py: no critic is built, no value pass runs).
3. Sequential trust region (factor.py): agents in a topological order of D (or random); M = 1 per
   sample. For each agent i_m: ppo_epochs x minibatches of the clipped surrogate on M*A with the
   decoupled behaviour weight, + beta*KL_k2(pi || ref) - c_H*H (backward.py); then, with no gradient,
   its whole-action ratios (sum log-probs) fold into the M of the actions they are sources of
   (default: its descendants in D within their round), M clipped to [(1-eps)^n, (1+eps)^n]. One
   adapter for all agents (``shared_adapter``, ``single_agent``): one group, M = 1.
   ``update_scheme: rerollout`` (loops.py): one update per agent, each on fresh episodes its
   predecessors' new adapters played, so M = 1 there.
4. Critic (GAE only): clipped Huber value loss towards the GAE returns.
5. Metrics, and guards: a non-finite loss skips that step (logged, counted); an approx-KL above
   ``target_kl`` stops that agent's epochs (logged); entropy / reference-KL collapse or non-finite
   weights roll everything back to the last stable state. Per agent, the train-inference log-prob
   gap on the actions its current version played (``logprob_gap``).

Python API::

    trainer = MarftTrainer(MarftConfig(...), "path/to/base", agents=["planner", "coder"], out_dir="run")
    metrics = trainer.train_on(episodes)          # one update from stored traces
    history = trainer.train(env_fn, iterations=20)  # on-policy: env_fn(policy, n, seed) -> episodes
    trainer.evaluate(env_fn, n=64, seed=1)        # mean return; untrained=True for the base model
    trainer.save_adapters("run/adapters")          # <dir>/<agent>/adapter_model.safetensors
    trainer.load_adapters("registry/current")      # warm start from published <dir>/<agent>/ adapters
    trainer.save_checkpoint("run/ckpt"); trainer.load_checkpoint("run/ckpt")   # exact resume

Every pass runs in token-budget micro-batches (``micro_batch_tokens``, passes.py); the
gradient passes accumulate over a minibatch, each loss term weighted by its share of the minibatch,
so the step is that of the whole minibatch. Under ``torchrun`` / ``accelerate launch`` each rank
trains on its share of the episodes (by episode, so all actions of one step stay together); the
shares are of the minibatch summed over all ranks and each adapter's gradients are summed in one
flat all-reduce on the trainer's device (distributed.py): token-weighted averaging, and every rank
ends each step with identical adapters. ``parallelism: fsdp2`` shards the base and the adapters
instead (fsdp.py): the same losses and steps, FSDP reduce-scatters the gradients, and every pass runs
as many micro-batches on every rank (a rank out of samples runs empty ones: passes.py).
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from pathlib import Path

import torch

from ..errors import MarftError
from . import checkpoint, loops
from . import distributed as D
from .admission import Admission, base_names, count_foreign, foreign_line
from . import backward
from .backward import STATS, Counts
from .batch import Batch, build_batch
from .config import MarftConfig
from .critic import ValueHead, critic_params
from .factor import (action_rounds, agent_graph_stats, clip_factor, factor_sources, factor_stats, fold_factor,
                     update_order)
from .groups import group_advantages, missing_groups
from .passes import SamplePasses
from .policy import CRITIC_ADAPTER, MultiAgentPolicy, pick_device
from .rollout import evaluate
from .snapshot import RollbackSnapshot
from .update import RolloutBatch, rollout_batch

log = logging.getLogger("marft_bridge.trainers")


class MarftTrainer:
    def __init__(self, config: MarftConfig | None, base_model_path, agents: list[str], *,
                 device: str | None = None, out_dir: str | Path | None = None):
        self.config = config = config or MarftConfig()
        self.rank, self.world = D.init_from_env()
        torch.manual_seed(config.seed)  # identical LoRA init on every rank
        self.device = pick_device(device or config.device)
        D.check_strategy(config.parallelism, self.device)
        self.policy = MultiAgentPolicy(base_model_path, agents, config, self.device)
        unknown = set(config.frozen_agents) - set(self.policy.agents)
        if unknown:
            raise MarftError(f"frozen_agents names unknown agents: {sorted(unknown)}")
        # The critic only where GAE needs values: a group estimator builds none (no head, no optimiser).
        self.head = ValueHead(self.policy.hidden_size).to(self.device) if config.critic else None
        self.passes = SamplePasses(self.policy, self.head, lambda: self.config)
        self.optims = {a: torch.optim.AdamW(self.policy.adapter_params(a), lr=config.lr, eps=1e-5,
                                            weight_decay=config.weight_decay) for a in self.policy.adapters}
        self.critic_optim = torch.optim.AdamW(critic_params(self.policy, self.head), lr=config.critic_lr, eps=1e-5,
                                              weight_decay=config.weight_decay) if config.critic else None
        # Current adapter versions (admission.py): set by whoever publishes them (registry versions);
        # an agent without one is at the update count, the version in-process rollouts record.
        self.policy_versions: dict[str, int] = {}
        self.base_names = base_names(base_model_path, getattr(self.policy.tokenizer, "name_or_path", None))
        self._foreign_told: set[str] = set()
        # Minibatch shuffles: one seeded generator per update group (each agent, the one shared group,
        # the critic), so an agent's shuffles never depend on which agents were updated before it.
        labels = [f"agent/{a}" for a in self.policy.agents] + ["group/all", "critic"]
        self.gens = {k: torch.Generator().manual_seed(zlib.crc32(f"{config.seed}/{k}".encode())) for k in labels}
        self.order_gen = torch.Generator().manual_seed(config.seed + 1)  # agent orders (same on every rank)
        self.update_count = 0
        self.out_dir = Path(out_dir) if out_dir else None
        # Last stable state for the collapse guard: host copies, refreshed for the groups that changed.
        self._stable = RollbackSnapshot(pin=self.device.type == "cuda")
        self._stable.take(self._groups())
        self._changed: set[str] = set()
        if config.init_adapters:  # e.g. `marft sft`'s adapters: every agent starts from its own
            checkpoint.check_adapter_dirs(config.init_adapters, self.policy.agents)
            self.load_adapters(config.init_adapters)
        log.info("MARFT config:\n%s", config.to_yaml())
        if self.out_dir and self.rank == 0:  # the effective config, beside metrics.jsonl
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.yaml").write_text(config.to_yaml())

    # -- public API --------------------------------------------------------------------------------

    @property
    def agents(self) -> list[str]:
        return self.policy.agents

    def train_on(self, episodes, agents: list[str] | None = None) -> dict:
        """One MARFT update on these episodes (list, or any iterable of Episode); returns its metrics.
        ``agents``: update only these (and the critic), as ``update_scheme: rerollout`` does."""
        episodes = list(episodes)
        missing_groups(episodes, self.config.advantage)  # every rank sees all episodes: all refuse alike
        metrics = self._update(self._batch(episodes[self.rank::self.world]), only=agents)
        self.update_count += 1
        if (line := foreign_line(metrics.get("foreign_policy", {}))) and line not in self._foreign_told:
            self._foreign_told.add(line)
            log.warning("update %d: %s", self.update_count, line)
        metrics["update"] = self.update_count
        self._guard_collapse(metrics)
        if self.out_dir and self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
        every = self.config.checkpoint_every
        if self.out_dir and every and self.update_count % every == 0:  # every rank: rank 0 writes
            self.save_checkpoint(self.out_dir / "checkpoint")
        return metrics

    @torch.no_grad()
    def log_importance_weights(self, episodes) -> dict[str, float]:
        """Per episode id: sum over its trainable actions of log pi_current(y|o) - behaviour log-prob,
        the log weight of replaying that recorded episode under the current adapters (off-policy
        evaluation). Actions recorded without behaviour log-probs count as on-policy (0)."""
        batch = self._batch(list(episodes))
        out: dict[str, float] = {}
        for agent in self.agents:  # the same order on every rank (fsdp2 passes are collectives)
            ss = [s for s in batch.samples if s.agent == agent]
            for s, lp in zip(ss, self.passes.token_logprobs(self.policy.adapter_of[agent], ss)):
                w = 0.0 if s.beh_logp is None else lp.sum().item() - sum(s.beh_logp)
                out[s.episode_id] = out.get(s.episode_id, 0.0) + w
        return out

    def train(self, env_fn, iterations: int, episodes_per_iteration: int | None = None, progress: bool = False):
        """On-policy MARFT: each iteration rolls out fresh episodes with the current adapters, then
        updates (loops.py; ``env_fn(policy, n, seed) -> episodes``)."""
        return loops.train(self, env_fn, iterations, episodes_per_iteration, progress)

    def iteration(self, rollout, n: int) -> list[dict]:
        """One on-policy iteration of ``n`` episodes from ``rollout(policy, k)`` (loops.py: ``stale``
        one update, ``rerollout`` one per agent on fresh episodes); the metrics of its updates."""
        return loops.iteration(self, rollout, n)

    def update_order(self, episodes) -> list[str]:
        """The trained agents in the order a sequential update of these episodes visits them (by D, or
        a draw of the seeded order generator for ``agent_order: random``); agents without samples last."""
        batch = self._batch(list(episodes)[self.rank::self.world])
        order = self._agent_order(batch, self._sources(batch, "ancestors"))
        return order + [a for a in self.agents if a not in order and a not in self.config.frozen_agents]

    def fit(self, episodes, iterations: int, progress: bool = False) -> list[dict]:
        """Offline MARFT on stored traces: ``iterations`` updates on successive slices (loops.py)."""
        return loops.fit(self, episodes, iterations, progress)

    def evaluate(self, env_fn, n: int, seed: int, untrained: bool = False) -> float:
        return evaluate(self, env_fn, n, seed, untrained=untrained)

    def save_adapters(self, directory) -> Path:
        """``<dir>/<agent>/adapter_model.safetensors + adapter_config.json`` for every agent (checkpoint.py;
        under fsdp2 every rank calls it, rank 0 writes)."""
        return checkpoint.save_adapters(self.policy, directory)

    def load_adapters(self, directory, agents: list[str] | None = None) -> None:
        """Start from published adapters (warm start, continuous training): ``<dir>/<agent>/`` peft dirs
        as ``save_adapters`` writes them. Safetensors only; shapes must match this trainer's LoRA config."""
        checkpoint.load_adapters(self.policy, directory, agents or self.agents)
        self._stable.take(self._groups())

    # -- one update ----------------------------------------------------------------------------------

    def current_version(self, agent: str) -> int:
        """The version of ``agent``'s adapter now: ``policy_versions``, else the update count."""
        return self.policy_versions.get(agent, self.update_count)

    def admission(self) -> Admission:
        """Which recorded actions an update learns from (admission.py)."""
        c = self.config
        return Admission(frozenset(self.policy.agents), self.base_names, c.allow_foreign, c.max_version_lag,
                         self.current_version)

    def foreign_actions(self, episodes) -> dict[str, int]:
        """Per model name, the llm actions of ``episodes`` excluded as ``foreign_policy`` (``foreign_line``
        says it in one line)."""
        return count_foreign(episodes, self.admission())

    def _batch(self, episodes: list) -> Batch:
        p = self.policy
        return build_batch(episodes, p.tokenizer, set(p.agents), p.vocab_size, p.max_context,
                           self.config.default_temperature, admission=self.admission())

    @staticmethod
    def _sources(batch: Batch, scope: str) -> tuple[torch.Tensor, torch.Tensor]:
        S = batch.samples
        return factor_sources([s.parents for s in S], [s.agent for s in S], [s.episode for s in S],
                              [s.step for s in S], scope)

    def _agent_order(self, batch: Batch, anc: tuple[torch.Tensor, torch.Tensor]) -> list[str]:
        """Trained agents with samples (on any rank), in the order factor.update_order picks."""
        trained = [a for a in self.policy.agents if a not in self.config.frozen_agents]
        stats = agent_graph_stats(trained, [s.agent for s in batch.samples], [s.episode for s in batch.samples], anc)
        if self.world > 1:
            stats = D.all_reduce_sum(stats, self.device)
        return update_order(trained, stats, self.config.agent_order, self.order_gen)

    def _update(self, batch: Batch, only: list[str] | None = None) -> dict:
        c, S = self.config, batch.samples

        # 1-2. Rollout statistics (no gradient) and advantages as flat tensors (update.py): GAE along D,
        #      or a group estimator's (groups.py: no critic, no value pass).
        adv, group_stats = (None, {}) if c.critic else self._group_advantages(batch)
        rb = rollout_batch(S, self.passes, c, self.device, adv)
        m = {"reward_mean": sum(batch.episode_returns) / len(batch.episode_returns), "episodes": batch.episodes,
             "samples": len(S), "tokens": batch.n_tokens, "skipped": dict(batch.skipped), "flagged": dict(batch.flagged),
             "skipped_nonfinite": 0, "early_stops": [], "agent_order": [], "per_agent": {}}
        if group_stats:
            m["group_advantage"] = group_stats
        if batch.foreign:
            m["foreign_policy"] = dict(batch.foreign)
        m["logprob_gap"] = self._logprob_gap(rb)
        acc: dict[str, list[float]] = {k: [] for k in (*STATS, "value_loss")}

        # 3. Sequential trust region (factor.py): each agent's PPO epochs on M * A, then its ratios fold into M.
        seen_m, seen_clip, seen_n = self._sequential_update(batch, rb, only, m, acc)

        # 4. Critic: clipped Huber value loss towards the GAE returns.
        if c.critic:
            self._critic_update(rb, m, acc)

        # 5. Metrics: means over minibatches; M as each sample's update used it (quantiles, clipfrac).
        for k, v in acc.items():
            m[k] = self._mean_all(v)
        m.update(factor_stats(seen_m, seen_clip, seen_n))
        self.last_factor = seen_m.tolist()  # diagnostics: per sample, in batch order
        return m

    def _sequential_update(self, batch: Batch, rb: RolloutBatch, only: list[str] | None, m: dict, acc: dict):
        """Section 3. M_k = product of exp(sum new - sum prox) over the sources j of sample k (pairs
        k <- j) whose agent is already updated, clipped per ratio; returns M as each sample's update
        used it (M, clipped, ratios folded), each (K,)."""
        c, S, K = self.config, batch.samples, len(batch.samples)
        anc = self._sources(batch, "ancestors")
        sources = anc if c.factor_scope == "ancestors" else self._sources(batch, c.factor_scope)
        log_m = torch.zeros(K, dtype=torch.float64)  # (K,) log M, unclipped
        n_m = torch.zeros(K, dtype=torch.float64)  # (K,) ratios folded into M
        seen_m = torch.ones(K, dtype=torch.float64)  # (K,) the clipped M each sample's update used
        seen_clip = torch.zeros(K, dtype=torch.bool)
        seen_n = torch.zeros(K, dtype=torch.float64)  # (K,) ratios folded into the M each sample's update used
        one_group = c.mode == "single_agent" or c.shared_adapter  # one adapter: one group, M = 1
        order = self._agent_order(batch, anc)
        if only is not None:  # update_scheme rerollout: this batch trains these agents only
            order = [a for a in order if a in only]
        groups = ([(None, list(range(K)))] if one_group else
                  [(a, [i for i, s in enumerate(S) if s.agent == a]) for a in order])
        for g_i, (agent, idx) in enumerate(groups):
            adapter = self.policy.adapters[0] if agent is None else self.policy.adapter_of[agent]
            name = agent or adapter
            m["agent_order"].append(name)
            factor, clipped = clip_factor(log_m, n_m, c.factor_clip)  # (K,), (K,)
            seen_m[idx], seen_clip[idx], seen_n[idx] = factor[idx], clipped[idx], n_m[idx]
            rb.b_factor = factor.float().to(self.device)
            # 3a. PPO epochs on this agent's samples: clipped surrogate on M * A (+ KL, - entropy).
            diag = self._agent_epochs(agent, adapter, name, rb, idx, m, acc)
            # 3b. After its update (no gradient): its whole-action log-ratios new - proximal fold into
            # the M of the samples they are sources of; new - behaviour is its KL step (diagnostics).
            log_ratio_new = self._after_update(adapter, rb, idx, diag)
            diag.update({k.replace("factor_", "m_"): v for k, v in
                         factor_stats(seen_m[idx], seen_clip[idx], seen_n[idx]).items()
                         if k in ("factor_q05", "factor_q50", "factor_q95", "factor_clipfrac")})
            if agent is not None and g_i + 1 < len(groups) and c.factor_scope != "none":
                log_ratio = torch.zeros(K, dtype=torch.float64)  # (K,) sum new - sum prox, this agent's
                if idx:
                    log_ratio[idx] = log_ratio_new
                updated = torch.zeros(K, dtype=torch.bool)
                updated[idx] = True
                log_m, n_m = fold_factor(log_m, n_m, sources, log_ratio, updated)
            m["per_agent"][name] = diag
        return seen_m, seen_clip, seen_n

    def _agent_epochs(self, agent, adapter: str, name: str, rb: RolloutBatch, idx: list[int], m: dict,
                      acc: dict) -> dict:
        """Section 3a: ``ppo_epochs`` x minibatches of one agent's (or the one group's) samples; its diagnostics."""
        c = self.config
        params = self.policy.adapter_params(adapter)
        diag = {"samples": len(idx), "epochs": 0, "optimizer_steps": 0, "clipfrac": []}
        gen = self.gens[f"agent/{agent}" if agent is not None else "group/all"]
        with self.policy.grad_mode():  # train mode once for all its minibatches (each walks every module)
            for epoch in range(c.ppo_epochs):
                kls = []
                for mb in self._minibatches(idx, gen):
                    loss = None
                    counts = self._global_counts(rb, mb)
                    if mb:
                        loss, stats = backward.policy_backward(self, adapter, rb, mb, counts)
                        for k, v in stats.items():
                            acc[k].append(v)
                        kls.append(stats["approx_kl"])
                        diag["clipfrac"].append(stats["clipfrac"])
                    elif self.policy.sharded:
                        self.passes.idle(adapter)
                    diag["optimizer_steps"] += self._step(params, self.optims[adapter], loss, m, f"policy {name}",
                                                          f"policy.{adapter}")
                diag["epochs"] = epoch + 1
                if c.target_kl is not None and (kl := self._mean_all(kls)) > c.target_kl:
                    log.warning("agent %s: approx-KL %.4g > target_kl %s after epoch %d; stopping its epochs",
                                name, kl, c.target_kl, epoch + 1)
                    m["early_stops"].append({"agent": name, "epoch": epoch + 1, "approx_kl": kl})
                    break
        diag["clipfrac"] = sum(diag["clipfrac"]) / len(diag["clipfrac"]) if diag["clipfrac"] else 0.0
        return diag

    @torch.no_grad()
    def _after_update(self, adapter: str, rb: RolloutBatch, idx: list[int], diag: dict) -> torch.Tensor | None:
        """Section 3b: (k,) whole-action log-ratios new - proximal of the agent's samples, and its KL
        step in ``diag``. (A rank without this agent's samples still joins the pass: fsdp2 passes are
        collectives.)"""
        new_tok = self.passes.token_logprobs(adapter, [rb.samples[i] for i in idx])  # (L_k,) per sample
        if not idx:
            return None
        log_ratio_new = rb.action_log_ratios(idx, new_tok, rb.b_prox)  # (k,) sum new - sum prox
        log_ratio_beh = rb.action_log_ratios(idx, new_tok, rb.b_beh)  # (k,) sum new - sum beh
        # KL(behaviour || new) of its whole actions, k3 on the samples the behaviour drew
        diag["kl_step"] = float(((log_ratio_beh.exp() - 1) - log_ratio_beh).mean())
        return log_ratio_new

    def _critic_update(self, rb: RolloutBatch, m: dict, acc: dict) -> None:
        """Section 4: ``ppo_epochs`` x minibatches of the clipped Huber value loss over every sample."""
        critic = critic_params(self.policy, self.head)
        for _ in range(self.config.ppo_epochs):
            for mb in self._minibatches(list(range(rb.K)), self.gens["critic"]):
                loss = None
                units = self._global_counts(rb, mb).units
                if mb:
                    loss = backward.critic_backward(self, rb, mb, units)
                    acc["value_loss"].append(loss * units / rb.n_units(mb))  # local mean
                elif self.policy.sharded and self.config.critic_backbone == "lora":
                    self.passes.idle(None, critic=True)
                self._step(critic, self.critic_optim, loss, m, "critic", "critic")

    def _group_advantages(self, batch: Batch) -> tuple[list[float], dict]:
        """Per sample its group-relative advantage (groups.py), groups gathered over all ranks."""
        S = batch.samples
        rounds = action_rounds([s.parents for s in S], [s.agent for s in S])
        gather = D.gather_objects if self.world > 1 else (lambda x: [x])
        return group_advantages(batch, self.policy.agents, rounds, self.config, gather)

    def _logprob_gap(self, rb: RolloutBatch) -> dict:
        """Per agent: mean and max |recorded behaviour - recomputed| token log-prob on the actions
        its current version played (the engine's mismatch with the trainer's forward), all ranks."""
        gap = rb.logprob_gap(lambda s: s.version is not None and s.version == self.current_version(s.agent))
        rows = [gap.get(a, [0.0, 0.0, 0.0]) for a in self.policy.agents]  # the same keys on every rank
        sums = [x for r in rows for x in r[:2]]
        maxes = [r[2] for r in rows]
        if self.world > 1:
            sums, maxes = D.sum_floats(sums, self.device), D.max_floats(maxes, self.device)
        return {a: {"mean": sums[2 * i] / sums[2 * i + 1], "max": maxes[i], "tokens": int(sums[2 * i + 1])}
                for i, a in enumerate(self.policy.agents) if sums[2 * i + 1] > 0}

    def _global_counts(self, rb: RolloutBatch, mb: list[int]) -> Counts:
        """(units, tokens, actions) of this minibatch summed over all ranks: every rank divides its loss
        sums by these, so the summed gradients are the token-weighted mean over ranks (distributed.py)."""
        counts = [float(rb.n_units(mb)), float(rb.n_tokens(mb)), float(len(mb))] if mb else [0.0, 0.0, 0.0]
        if self.world > 1:
            counts = D.sum_floats(counts, self.device)
        return Counts(*counts)

    def _minibatches(self, idx: list[int], gen: torch.Generator) -> list[list[int]]:
        # Exactly num_minibatches chunks (some may be empty) so every DDP rank takes the same steps.
        if not idx:
            return [[] for _ in range(self.config.num_minibatches)] if self.world > 1 else []
        perm = torch.randperm(len(idx), generator=gen).tolist()
        n = self.config.num_minibatches
        chunks = [[idx[j] for j in perm[k::n]] for k in range(n)]
        return chunks if self.world > 1 else [ch for ch in chunks if ch]

    def _step(self, params, optim, loss: float | None, metrics, what: str, group: str) -> int:
        """(Token-weighted all-reduced) accumulated gradient + clip + step; a non-finite loss on any rank
        skips the step, logged. The backward passes already ran (``_policy_backward``). 1 if it stepped."""
        bad = [0.0 if loss is None or math.isfinite(loss) else 1.0]
        if self.world > 1:
            bad = D.sum_floats(bad, self.device)
        if bad[0] > 0:
            optim.zero_grad(set_to_none=True)
            metrics["skipped_nonfinite"] += 1
            log.warning("update %d: non-finite %s loss; step skipped", self.update_count + 1, what)
            return 0
        if self.world > 1:
            D.all_reduce_gradients(params, self.device)  # one flat all-reduce per adapter
        elif loss is None:
            return 0
        D.clip_grad_norm_(params, self.config.max_grad_norm, self.device)  # sharded (fsdp2) or not
        optim.step()
        optim.zero_grad(set_to_none=True)
        self._changed.add(group)
        return 1

    def _mean_all(self, xs: list[float]) -> float:
        t = [sum(xs), float(len(xs))]
        if self.world > 1:
            t = D.sum_floats(t, self.device)
        return t[0] / t[1] if t[1] > 0 else float("nan")

    # -- guards ---------------------------------------------------------------------------------------

    def _guard_collapse(self, m: dict) -> None:
        c = self.config
        reasons = []
        if c.collapse_entropy_min is not None and not m["entropy"] >= c.collapse_entropy_min:
            reasons.append(f"entropy {m['entropy']:.4g} < {c.collapse_entropy_min}")
        if c.collapse_ref_kl_max is not None and not m["kl_ref"] <= c.collapse_ref_kl_max:
            reasons.append(f"KL to reference {m['kl_ref']:.4g} > {c.collapse_ref_kl_max}")
        if not D.all_finite(self.trainable(), self.device):
            reasons.append("non-finite weights")
        m["rolled_back"] = bool(reasons)
        if reasons:
            log.warning("update %d: collapse (%s); rolling back to the last stable state", self.update_count,
                        "; ".join(reasons))
            self._stable.restore(self._groups(), self._changed)
        else:
            self._stable.take(self._groups(), self._changed)
        self._changed = set()

    # -- state: snapshot, checkpoint, resume ----------------------------------------------------------

    def trainable(self) -> list[torch.nn.Parameter]:
        """Every trained parameter: the LoRA weights of all adapters and the value head (if any)."""
        head = list(self.head.parameters()) if self.head is not None else []
        return [p for n, p in self.policy.model.named_parameters() if "lora_" in n] + head

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The trained parameters by name, as checkpoints store them."""
        out = {n: p for n, p in self.policy.model.named_parameters() if "lora_" in n}
        if self.head is not None:
            out.update({f"value_head.{n}": p for n, p in self.head.named_parameters()})
        return out

    def _groups(self) -> dict[str, tuple[dict[str, torch.Tensor], torch.optim.Optimizer]]:
        """Rollback groups: each adapter's named weights with its optimiser, and the critic's."""
        pol = self.policy
        out = {f"policy.{a}": (pol.adapter_named_params(a), o) for a, o in self.optims.items()}
        if self.head is None:
            return out
        critic = pol.adapter_named_params(CRITIC_ADAPTER) if self.config.critic_backbone == "lora" else {}
        critic.update({f"value_head.{n}": p for n, p in self.head.named_parameters()})
        out["critic"] = (critic, self.critic_optim)
        return out

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Each adapter's optimiser and the critic's, by checkpoint key."""
        critic = {"critic": self.critic_optim} if self.critic_optim is not None else {}
        return {**{f"policy.{a}": o for a, o in self.optims.items()}, **critic}

    def save_checkpoint(self, directory) -> Path:
        """Adapters (peft dirs), all trainable weights, optimiser states, RNG states and counters
        (checkpoint.py; with several ranks every rank calls it, rank 0 writes)."""
        return checkpoint.save(self, directory)

    def load_checkpoint(self, directory) -> None:
        """Restore exactly what ``save_checkpoint`` wrote (same agents and model shapes required)."""
        checkpoint.load(self, directory)
        self._stable.take(self._groups())
