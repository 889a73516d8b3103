"""The MARFT training loop: per-agent LoRA PPO with a sequential trust-region update.

One update on a batch of episodes (``MarftTrainer.train_on``):

1. Build samples (batch.py): trainable actions in topological order, rewards placed.
2. With no gradient: proximal log-probs (current adapters), reference log-probs (adapters
   disabled), values (critic). Behaviour log-probs from the trace, or the proximal ones when the
   trace has none (flagged, treated as on-policy).
3. GAE by backward induction over D, per action (MARFT-A) or per token (MARFT-T): each action
   bootstraps from its successors in D (advantages.py).
4. Sequential trust region (factor.py): agents in a topological order of D (or random); M = 1 per
   sample. For each agent i_m: ppo_epochs x minibatches of the clipped surrogate on M*A with the
   decoupled behaviour weight, + beta*KL_k2(pi || ref) - c_H*H; then, with no gradient, its
   whole-action ratios (sum log-probs) fold into the M of the actions they are sources of (default:
   its descendants in D within their round), M clipped to [(1-eps)^n, (1+eps)^n]. One adapter for
   all agents (``shared_adapter``, ``single_agent``): one group, M = 1. ``update_scheme: rerollout``
   (``iteration``): one update per agent, each on fresh episodes its predecessors' new adapters
   played, so M = 1 there.
5. Critic: clipped Huber value loss towards the GAE returns.
6. Guards: a non-finite loss skips that step (logged, counted); an approx-KL above ``target_kl``
   stops that agent's epochs (logged); entropy / reference-KL collapse or non-finite weights roll
   everything back to the last stable state.

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
from . import checkpoint
from . import distributed as D
from . import losses as L
from .batch import Batch, build_batch
from .config import MarftConfig
from .critic import ValueHead, critic_params, values
from .factor import agent_graph_stats, clip_factor, factor_sources, factor_stats, fold_factor, update_order
from .passes import SamplePasses
from .policy import CRITIC_ADAPTER, MultiAgentPolicy, pack, pick_device
from .progress import ProgressBar
from .rollout import RolloutPolicy, evaluate
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
        self.head = ValueHead(self.policy.hidden_size).to(self.device)
        self.passes = SamplePasses(self.policy, self.head, lambda: self.config)
        self.optims = {a: torch.optim.AdamW(self.policy.adapter_params(a), lr=config.lr, eps=1e-5,
                                            weight_decay=config.weight_decay) for a in self.policy.adapters}
        self.critic_optim = torch.optim.AdamW(critic_params(self.policy, self.head), lr=config.critic_lr, eps=1e-5,
                                              weight_decay=config.weight_decay)
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
        metrics = self._update(self._batch(list(episodes)[self.rank::self.world]), only=agents)
        self.update_count += 1
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
        """On-policy MARFT: each iteration rolls out fresh episodes with the current adapters, then updates
        (``update_scheme: rerollout``: one update per agent, each on fresh episodes; ``iteration``)."""
        n = episodes_per_iteration or self.config.batch_episodes

        def rollout(policy, k):
            seed = self.config.seed * 1_000_003 + self.update_count  # from the counter: resumable
            return env_fn(policy, k, seed)

        history = []
        with ProgressBar(iterations, progress) as bar:
            for _ in range(iterations):
                history += self.iteration(rollout, n)
                bar(history[-1])
        return history

    def iteration(self, rollout, n: int) -> list[dict]:
        """One on-policy iteration of ``n`` episodes, ``rollout(policy, k) -> k episodes`` played with the
        adapters ``policy`` (a RolloutPolicy) holds now; the metrics of its updates.

        ``stale``: one rollout of n, one update of every agent. ``rerollout``: n split over the trained
        agents in update order (the order from the first share's batch; the first shares one episode
        larger when n does not divide): agent k is updated alone on its share, which agent k-1's new
        adapter has just played (a swap); M = 1 there. A server-backed ``rollout`` publishes first
        (``policy.save_adapters``). Each update's metrics carry ``rerollout``: agent, episodes, swap."""
        c = self.config
        trained = [a for a in self.policy.agents if a not in c.frozen_agents]
        if c.update_scheme == "stale" or c.mode == "single_agent" or c.shared_adapter or len(trained) < 2:
            return [self.train_on(rollout(RolloutPolicy(self), n))]
        shares = [n // len(trained) + (k < n % len(trained)) for k in range(len(trained))]
        episodes = rollout(RolloutPolicy(self), shares[0])
        order = self.update_order(episodes)
        out = []
        for k, agent in enumerate(order):
            if k:  # the previous agent's new adapter plays this agent's episodes
                episodes = rollout(RolloutPolicy(self), shares[k])
            m = self.train_on(episodes, agents=[agent])
            m["rerollout"] = {"agent": agent, "episodes": len(episodes), "swap": k > 0}
            out.append(m)
        return out

    def update_order(self, episodes) -> list[str]:
        """The trained agents in the order a sequential update of these episodes visits them (by D, or
        a draw of the seeded order generator for ``agent_order: random``); agents without samples last."""
        batch = self._batch(list(episodes)[self.rank::self.world])
        order = self._agent_order(batch, self._sources(batch, "ancestors"))
        return order + [a for a in self.agents if a not in order and a not in self.config.frozen_agents]

    def fit(self, episodes, iterations: int, progress: bool = False) -> list[dict]:
        """Offline MARFT on stored traces: update ``iterations`` times on successive slices of
        ``batch_episodes`` episodes (cycling; the slice comes from the update counter, so resume is exact)."""
        episodes = list(episodes)
        if not episodes:
            raise MarftError("no episodes to train on")
        n = min(self.config.batch_episodes, len(episodes))
        history = []
        with ProgressBar(iterations, progress) as bar:
            for _ in range(iterations):
                start = (self.update_count * n) % len(episodes)
                chunk = (episodes + episodes)[start:start + n]
                history.append(self.train_on(chunk))
                bar(history[-1])
        return history

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

    def _batch(self, episodes: list) -> Batch:
        p = self.policy
        return build_batch(episodes, p.tokenizer, set(p.agents), p.vocab_size, p.max_context,
                           self.config.default_temperature)

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
        c = self.config
        S = batch.samples
        K = len(S)

        # 1-2. Rollout statistics (no gradient) and GAE along D, as flat tensors (update.py).
        rb = rollout_batch(S, self.passes, c, self.device)

        m = {"reward_mean": sum(batch.episode_returns) / len(batch.episode_returns), "episodes": batch.episodes,
             "samples": K, "tokens": batch.n_tokens, "skipped": dict(batch.skipped), "flagged": dict(batch.flagged),
             "skipped_nonfinite": 0, "early_stops": [], "agent_order": [], "per_agent": {}}
        acc: dict[str, list[float]] = {k: [] for k in ("policy_loss", "kl_ref", "entropy", "approx_kl", "clipfrac",
                                                     "behaviour_weight", "value_loss")}

        # 3. Sequential trust region (factor.py). M_k = product of exp(sum new - sum prox) over the
        #    sources j of sample k (pairs k <- j) whose agent is already updated; clipped per ratio.
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
            params = self.policy.adapter_params(adapter)
            factor, clipped = clip_factor(log_m, n_m, c.factor_clip)  # (K,), (K,)
            seen_m[idx], seen_clip[idx], seen_n[idx] = factor[idx], clipped[idx], n_m[idx]
            rb.b_factor = factor.float().to(self.device)
            diag = {"samples": len(idx), "epochs": 0, "optimizer_steps": 0, "clipfrac": []}

            # 3a. PPO epochs on this agent's samples: clipped surrogate on M * A (+ KL, - entropy).
            gen = self.gens[f"agent/{agent}" if agent is not None else "group/all"]
            with self.policy.grad_mode():  # train mode once for all its minibatches (each walks every module)
                for epoch in range(c.ppo_epochs):
                    kls = []
                    for mb in self._minibatches(idx, gen):
                        loss = None
                        units, tokens = self._global_counts(rb, mb)
                        if mb:
                            loss, stats = self._policy_backward(adapter, rb, mb, units, tokens)
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

            # 3b. After its update (no gradient): its whole-action log-ratios new - proximal fold into
            # the M of the samples they are sources of; new - behaviour is its KL step (diagnostics).
            # (A rank without this agent's samples still joins the pass: fsdp2 passes are collectives.)
            with torch.no_grad():
                new_tok = self.passes.token_logprobs(adapter, [S[i] for i in idx])  # (L_k,) per sample
                if idx:
                    log_ratio_new = rb.action_log_ratios(idx, new_tok, rb.b_prox)  # (k,) sum new - sum prox
                    log_ratio_beh = rb.action_log_ratios(idx, new_tok, rb.b_beh)  # (k,) sum new - sum beh
                    # KL(behaviour || new) of its whole actions, k3 on the samples the behaviour drew
                    diag["kl_step"] = float(((log_ratio_beh.exp() - 1) - log_ratio_beh).mean())
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
            diag["clipfrac"] = sum(diag["clipfrac"]) / len(diag["clipfrac"]) if diag["clipfrac"] else 0.0
            m["per_agent"][name] = diag

        # 4. Critic: clipped Huber value loss towards the GAE returns.
        critic = critic_params(self.policy, self.head)
        for _ in range(c.ppo_epochs):
            for mb in self._minibatches(list(range(K)), self.gens["critic"]):
                loss = None
                units, _ = self._global_counts(rb, mb)
                if mb:
                    loss = self._critic_backward(rb, mb, units)
                    acc["value_loss"].append(loss * units / rb.n_units(mb))  # local mean
                elif self.policy.sharded and c.critic_backbone == "lora":
                    self.passes.idle(None, critic=True)
                self._step(critic, self.critic_optim, loss, m, "critic", "critic")

        # 5. Metrics: means over minibatches; M as each sample's update used it (quantiles, clipfrac).
        for k, v in acc.items():
            m[k] = self._mean_all(v)
        m.update(factor_stats(seen_m, seen_clip, seen_n))
        self.last_factor = seen_m.tolist()  # diagnostics: per sample, in batch order
        return m

    def _global_counts(self, rb: RolloutBatch, mb: list[int]) -> tuple[float, float]:
        """(units, tokens) of this minibatch summed over all ranks: every rank divides its loss sums by
        these, so the summed gradients are the token-weighted mean over ranks (distributed.py)."""
        counts = [float(rb.n_units(mb)), float(rb.n_tokens(mb))] if mb else [0.0, 0.0]
        if self.world > 1:
            counts = D.sum_floats(counts, self.device)
        return counts[0], counts[1]

    def _policy_backward(self, adapter: str, rb: RolloutBatch, mb: list[int], units: float, tokens: float):
        """Backward of the minibatch's policy loss, micro-batch by micro-batch (gradients accumulate);
        returns (the loss value, its stats). Each micro-batch's means are weighted by its share of the
        minibatch's units / tokens over all ranks (``units``, ``tokens``), so the accumulated gradient
        is the whole minibatch's."""
        c, S, token_level = self.config, rb.samples, rb.token_level
        mb_adv = rb.b_adv[rb.units(mb)]  # (u,) this minibatch's advantages
        if c.normalize_advantages:  # over the whole minibatch, before it is split
            mb_adv = L.normalize(mb_adv)
        adv = torch.empty_like(rb.b_adv)  # (U,) scatter back, so micro-batches index by unit
        adv[rb.units(mb)] = mb_adv
        local_units, local_tokens = rb.n_units(mb), rb.n_tokens(mb)
        total, stats = 0.0, dict.fromkeys(("policy_loss", "kl_ref", "entropy", "approx_kl", "clipfrac",
                                           "behaviour_weight"), 0.0)
        with self.policy.grad_mode():
            for plan in self.passes.gradient_plan([S[i] for i in mb], adapter):  # fsdp2: pads run inside
                sub = [mb[j] for j in plan]
                lm = rb.lens[sub].tolist()  # L_b per sample of the micro-batch
                tok = rb.tokens(sub)  # (N,) flat token positions: N = sum L_b
                new_tok, ent, _, _ = self.passes.forward(adapter, [S[i] for i in sub], grad=True, entropy=True)  # (N,)
                prox_tok, beh_tok, ref_tok = rb.b_prox[tok], rb.b_beh[tok], rb.b_ref[tok]  # (N,)
                mfac = rb.b_factor[sub]  # (B,) M per sample
                if token_level:  # MARFT-T: one PPO sample per token
                    new, old, b = new_tok, prox_tok, beh_tok  # (N,)
                    mfac = mfac.repeat_interleave(rb.lens[sub].to(self.device))  # (N,)
                    a = adv[tok]  # (N,)
                else:  # MARFT-A: one PPO sample per action
                    new, old, b = (L.action_logprobs(t, lm, c.logprob_reduction) for t in (new_tok, prox_tok, beh_tok))
                    a = adv[sub]  # (B,)
                su, st = new.numel() / units, new_tok.numel() / tokens  # shares of the minibatch (all ranks)
                w = L.behaviour_weights(old, b, c.behaviour_weight_cap)  # w = min(exp(prox - beh), cap)
                # L_clip = -E[w * min(r M A, clip(r, 1 - eps, 1 + eps) M A)],  r = exp(new - prox)
                pg_loss = L.clipped_surrogate(new, old, a * mfac, w, c.clip)
                # L_KL = E_tokens[1/2 (log pi - log ref)^2]  (k2: its gradient is that of KL(pi || ref))
                kl_loss = L.kl_k2(new_tok, ref_tok).mean()
                # H = E_tokens[-sum_v p_v log p_v]
                entropy = ent.mean()
                loss = su * pg_loss + st * (c.kl_coef * kl_loss - c.entropy_coef * entropy)
                loss.backward()
                total += float(loss.detach())
                with torch.no_grad():  # stats: this rank's minibatch means
                    lu, lt = new.numel() / local_units, new_tok.numel() / local_tokens
                    ratio = torch.exp(new - old)  # the surrogate's ratio: per action (A) or per token (T)
                    stats["policy_loss"] += lu * float(pg_loss)
                    stats["kl_ref"] += lt * float(L.kl_k3(new_tok, ref_tok).mean())
                    stats["entropy"] += lt * float(entropy)
                    stats["approx_kl"] += lu * float(L.approx_kl(new, old))
                    stats["clipfrac"] += lu * float(((ratio - 1).abs() > c.clip).float().mean())
                    stats["behaviour_weight"] += lu * float(w.mean())
        return total, stats

    def _critic_backward(self, rb: RolloutBatch, mb: list[int], units: float) -> float:
        """Backward of the minibatch's value loss (micro-batched through a LoRA critic backbone); its value."""
        c, S = self.config, rb.samples
        frozen = rb.b_feat is not None
        plans = [list(range(len(mb)))] if frozen else self.passes.gradient_plan([S[i] for i in mb], None, critic=True)
        total = 0.0
        for plan in plans:
            sub = [mb[j] for j in plan]
            u = rb.units(sub)
            if frozen:  # the reference pass's features, head only
                v = self.head(rb.b_feat[u])
            else:
                ss = [S[i] for i in sub]
                packed = pack([s.obs_ids for s in ss], [s.act_ids for s in ss], self.policy.pad_id, self.device)
                v = values(self.policy, self.head, packed, rb.token_level)
            # L_V = c_V * E[max(huber(V - R), huber(V_old + clip(V - V_old, -eps_V, eps_V) - R))]
            value_loss = c.value_coef * L.clipped_value_loss(v, rb.b_val[u], rb.b_ret[u], c.value_clip, c.huber_delta)
            loss = value_loss * (v.numel() / units)
            loss.backward()
            total += float(loss.detach())
        return total

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
        """Every trained parameter: the LoRA weights of all adapters and the value head."""
        return [p for n, p in self.policy.model.named_parameters() if "lora_" in n] + list(self.head.parameters())

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The trained parameters by name, as checkpoints store them."""
        out = {n: p for n, p in self.policy.model.named_parameters() if "lora_" in n}
        out.update({f"value_head.{n}": p for n, p in self.head.named_parameters()})
        return out

    def _groups(self) -> dict[str, tuple[dict[str, torch.Tensor], torch.optim.Optimizer]]:
        """Rollback groups: each adapter's named weights with its optimiser, and the critic's."""
        pol = self.policy
        out = {f"policy.{a}": (pol.adapter_named_params(a), o) for a, o in self.optims.items()}
        critic = pol.adapter_named_params(CRITIC_ADAPTER) if self.config.critic_backbone == "lora" else {}
        critic.update({f"value_head.{n}": p for n, p in self.head.named_parameters()})
        out["critic"] = (critic, self.critic_optim)
        return out

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Each adapter's optimiser and the critic's, by checkpoint key."""
        return {**{f"policy.{a}": o for a, o in self.optims.items()}, "critic": self.critic_optim}

    def save_checkpoint(self, directory) -> Path:
        """Adapters (peft dirs), all trainable weights, optimiser states, RNG states and counters
        (checkpoint.py; with several ranks every rank calls it, rank 0 writes)."""
        return checkpoint.save(self, directory)

    def load_checkpoint(self, directory) -> None:
        """Restore exactly what ``save_checkpoint`` wrote (same agents and model shapes required)."""
        checkpoint.load(self, directory)
        self._stable.take(self._groups())
