"""Continuous fine-tuning: poll the store → train MARFT → evaluate → gate → publish → watch → roll back.

One ``ContinuousService`` round:

1. Read the store's change log from the saved cursor; collect episodes that carry a reward.
2. When at least ``min_new_episodes`` have arrived, run ``updates_per_round`` MARFT updates on the
   newest ``max_train_episodes`` of them, starting from the last *accepted* trainer checkpoint.
3. Evaluate the candidate adapters and the live ones with the same evaluation function.
4. Gate: promote (publish to the registry, load into every configured server) only if the
   candidate is not worse than the live system by more than ``gate_margin``; otherwise discard it
   and restore the accepted trainer state.
5. Watch: once ``rollback_window`` rewarded live episodes were produced by the promoted versions
   (every captured action records the adapter version that produced it), compare their mean reward
   with the episodes of the previous versions; a drop larger than ``rollback_margin`` rolls every
   agent back to its previous version.

State (cursor, pending episode ids, versions, the accepted checkpoint) lives in ``state_dir``, so a
restarted service resumes where it stopped. Every decision is logged with its reason and appended
to ``state_dir/decisions.jsonl``; ``marft service status`` prints them.

A kill -9 at any point of a round leaves exactly one published version per agent per round: the round
writes a journal (``round.json``: round id, phase, the candidate adapters' sha256) before it trains and
again before it publishes; each published version's manifest carries the round id. A restart reads the
journal first: a round killed while training or gating published nothing and runs again from the
accepted checkpoint; one killed while publishing adopts the versions it already published (found by
round id and checked by sha256), publishes the rest and finishes; one killed while replacing the
accepted checkpoint completes the replacement (written beside, fsynced, renamed; the old copy is kept
until the new one is whole). The restart logs a ``resume`` decision saying what it found and did.

With ``trainer: {update_scheme: rerollout}`` a round trains, gates and publishes one agent, the next in
the cycle's update order, on episodes every live version played (stale ones, served by a replaced
version, are dropped and counted): fresh rollouts between agents' updates, so M = 1 on its samples.

Every promotion is a team release (``serving.releases``); a regression rolls the whole team back. With
``canary:`` a gated release first serves a share of live episodes (``service.canary``, ``service.releasing``).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import shutil
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from .. import durable
from .config import DECISIONS_FILE, JOURNAL_FILE, STATE_FILE, ServiceConfig, ServiceJournal, ServiceState
from ..errors import MarftError

log = logging.getLogger("marft_bridge.service")

def heldout(episode_id: str, fraction: float) -> bool:
    """A stable split by id, so an episode stays on its side across restarts and processes."""
    import hashlib

    h = int.from_bytes(hashlib.sha256(episode_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def load_function(spec: str) -> Callable:
    mod, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise MarftError(f"cannot load evaluation function {spec!r}: {e}") from None


class ContinuousService:
    def __init__(self, config: ServiceConfig, *, eval_fn: Callable | None = None, publishers=None):
        from ..serving.publishers import EmbeddedServerPublisher, VLLMPublisher
        from ..serving.registry import AdapterRegistry
        from ..store import TraceStore

        self.config = config
        self.dir = Path(config.state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store = TraceStore.open(config.store)
        self.registry = AdapterRegistry(config.registry)
        if publishers is None:
            kinds = {"embedded": EmbeddedServerPublisher, "vllm": VLLMPublisher}
            publishers = [kinds[p.kind](p.url, os.environ.get(p.api_key_env) if p.api_key_env else None)
                          for p in config.publishers]
        self.publishers = list(publishers)
        self.eval_fn = eval_fn or (load_function(config.eval_function) if config.eval_function else None)
        self._recovered: str | None = None
        self._recovery_done = False
        self.state = self._load_state()
        self._trainer = None
        from .releasing import TeamReleases

        self.team = TeamReleases(config, self.registry, self.publishers, self.state, save=self._save_state,
                                 log=self.decide, accept=self._accept_canary, restore=self._restore_accepted)

    # -- state ---------------------------------------------------------------------------------

    def _load_state(self) -> ServiceState:
        p = self.dir / STATE_FILE
        return ServiceState.model_validate_json(p.read_text()) if p.is_file() else ServiceState()

    def _save_state(self) -> None:
        durable.write_json(self.dir / STATE_FILE, self.state.model_dump(mode="json"))

    def _journal(self) -> dict | None:
        p = self.dir / JOURNAL_FILE
        return ServiceJournal.model_validate_json(p.read_text()).model_dump() if p.is_file() else None

    def _write_journal(self, journal: dict) -> None:
        durable.write_json(self.dir / JOURNAL_FILE, ServiceJournal(**journal).model_dump(mode="json"))

    def _end_journal(self) -> None:
        (self.dir / JOURNAL_FILE).unlink(missing_ok=True)

    def decide(self, decision: str, reason: str, **details: Any) -> dict:
        row = {"time": datetime.now(timezone.utc).isoformat(), "round": self.state.round,
               "decision": decision, "reason": reason, **details}
        log.info("service %s: %s", decision, reason)
        durable.append_json_line(self.dir / DECISIONS_FILE, row)
        return row

    def _recover(self) -> None:
        """Once, before the accepted checkpoint is read: after a kill while it was being replaced, keep the
        whole copy (reported in the resume decision). Not in __init__: ``status`` must change nothing."""
        if not self._recovery_done:
            self._recovered = durable.recover_dir(self.dir / "accepted")
            self._recovered = self.team.store.recover(self.publishers) or self._recovered  # a team swap a kill cut
            self._recovery_done = True

    @property
    def trainer(self):
        self._recover()
        if self._trainer is None:
            from ..trainers.marft import MarftTrainer

            self._trainer = MarftTrainer(self.config.trainer, self.config.base_model,
                                         agents=self.config.agents)
            ckpt = self.dir / "accepted"
            if ckpt.is_dir():
                self._trainer.load_checkpoint(ckpt)
        return self._trainer

    # -- the loop ------------------------------------------------------------------------------

    def poll(self) -> int:
        """Move the cursor over the change log; return how many rewarded episodes are pending."""
        cursor, ids = self.store.changed_since(self.state.cursor)
        known = set(self.state.pending) | set(self.state.heldout)
        self.team.begin_poll()
        for eid in ids:
            try:
                ep = self.store.get_episode(eid, exact=True)
            except KeyError:  # gone, or unreadable (the store moved it to its dead letters): not trainable
                continue
            if not ep.rewards or (self.config.source and ep.source != self.config.source):
                continue
            if self.state.watch:
                self._watch(ep)
            self.team.file(ep)
            if eid in known:
                continue
            (self.state.heldout if heldout(eid, self.config.heldout_fraction) else self.state.pending).append(eid)
            known.add(eid)
        self.state.cursor = cursor
        self._save_state()
        return len(self.state.pending)

    def _watch(self, ep) -> None:
        """File a rewarded live episode under the promoted or the previous versions, by what served it."""
        watch, reward = self.state.watch, ep.team_reward()
        served = {a.agent: (a.policy.version if a.policy else None) for a in ep.actions if a.agent in watch["versions"]}
        if not served or reward is None:
            return
        for group, versions in (("new", watch["versions"]), ("old", watch["previous"])):
            if all(served[a] == versions[a] for a in served):
                watch.setdefault(group, {})[ep.id] = reward
                return

    def step(self) -> dict:
        """One round: finish an interrupted one, poll, watch for regressions, train/gate when enough data arrived."""
        self._recover()
        journal = self._journal()
        if journal is not None:
            finished = self._resume(journal)
            if finished is not None:
                return finished
        n = self.poll()
        unhealthy = self.team.maybe_probe()  # after a swap and every probe.every_minutes
        if unhealthy is not None:
            return unhealthy
        if self.team.running():
            return self.team.canary.check()  # one canary at a time: no training until it is decided
        if self.state.watch:
            rolled = self._check_regression()
            if rolled:
                return rolled
        if n < self.config.min_new_episodes:
            return {"decision": "wait", "pending": n}
        self._ensure_baseline()
        return self._train_round()

    def _ensure_baseline(self) -> None:
        """Publish the untrained adapters (LoRA B = 0: exactly the base model) as each new agent's
        first version, so the live system always has a registry version to compare with and to
        roll back to."""
        fresh = [a for a in self.config.agents if self.registry.current(a) is None]
        if not fresh:
            return
        baseline = self.dir / "baseline"
        shutil.rmtree(baseline, ignore_errors=True)
        self.trainer.save_adapters(baseline)
        durable.fsync_tree(baseline)
        journal = {"id": uuid.uuid4().hex, "round": self.state.round, "phase": "baseline", "started": _now(),
                   "agents": fresh, "sha256": _weights_sha(baseline, fresh)}
        self._write_journal(journal)
        self._publish_baseline(journal)

    def _publish_baseline(self, journal: dict) -> None:
        versions = self.promote(self.dir / "baseline", metrics={}, agents=journal["agents"],
                                round_id=journal["id"], sha256=journal["sha256"])
        rel = self.team.adopt(journal["id"], None, None)
        self.decide("baseline", "published the untrained adapters as the first live version", versions=versions,
                    round_id=journal["id"], release=rel.id)
        self._end_journal()

    def run(self, max_rounds: int | None = None, stop: Callable[[], bool] | None = None) -> None:
        rounds = 0
        while not (stop and stop()):
            result = self.step()
            rounds += 1
            if max_rounds is not None and rounds >= max_rounds:
                break
            if result.get("decision") == "wait":
                time.sleep(self.config.poll_interval_s)

    def _rerollout(self) -> bool:
        return self.trainer.config.update_scheme == "rerollout" and len(self.config.agents) > 1

    def _fresh(self, episodes: list) -> tuple[list, list[str]]:
        """The episodes every agent's live version played, and the ids of the stale rest (an action
        served by another registry version). An action without a recorded version cannot be judged:
        it counts as fresh."""
        live = {a: self.registry.current(a) for a in self.config.agents}
        fresh, stale = [], []
        for ep in episodes:
            served = [(a.agent, a.policy.version) for a in ep.actions if a.agent in live and a.policy]
            if all(v is None or v == live[agent] for agent, v in served):
                fresh.append(ep)
            else:
                stale.append(ep.id)
        return fresh, stale

    def _rerollout_stage(self, episodes: list) -> list[str]:
        """The one agent this round trains: the next in the cycle's update order (drawn afresh, from
        this round's episodes, when a cycle starts)."""
        if self.state.stage == 0 or not self.state.order:
            self.state.order, self.state.stage = self.trainer.update_order(episodes), 0
        return [self.state.order[self.state.stage]]

    def _next_stage(self, journal: dict) -> None:
        if journal.get("stage") is not None and self.state.order:  # from the journal: a resumed round advances once
            self.state.stage = (journal["stage"] + 1) % len(self.state.order)

    def _train_round(self) -> dict:
        cfg = self.config
        trainer = self.trainer
        ids = self.state.pending[-cfg.max_train_episodes:]
        episodes = [self.store.get_episode(i, exact=True) for i in ids]
        agents, stage, extra = list(cfg.agents), None, {}
        if self._rerollout():  # fresh rollouts between agents' updates: one agent per round
            episodes, stale = self._fresh(episodes)
            ids = [ep.id for ep in episodes]
            if stale:  # played by versions no longer live: not this round's behaviour policy
                gone = set(stale)
                self.state.pending = [i for i in self.state.pending if i not in gone]
                self._save_state()
                if len(ids) < cfg.min_new_episodes:
                    return {"decision": "wait", "pending": len(self.state.pending), "stale": len(stale)}
            agents = self._rerollout_stage(episodes)
            stage = self.state.stage
            self._save_state()  # the cycle's order, before the journal that names its stage
            extra = {"rerollout": {"agent": agents[0], "stage": stage, "order": self.state.order,
                                   "stale_dropped": len(stale)}}
        self.state.round += 1
        journal = {"id": uuid.uuid4().hex, "round": self.state.round, "phase": "training", "started": _now(),
                   "agents": agents, "stage": stage}
        self._write_journal(journal)  # a kill from here to the gate publishes nothing: the round reruns
        metrics = {}
        for _ in range(cfg.updates_per_round):
            metrics = trainer.train_on(episodes, agents=agents if stage is not None else None)
        candidate = self.dir / "candidate"
        shutil.rmtree(candidate, ignore_errors=True)
        trainer.save_adapters(candidate / "adapters")
        trainer.save_checkpoint(candidate / "checkpoint")
        durable.fsync_tree(candidate)
        new_score = self.evaluate({a: candidate / "adapters" / a for a in cfg.agents}, candidate=True)
        live_score = self.evaluate({a: self.registry.path(a) for a in cfg.agents}, candidate=False)
        summary = {"candidate_score": new_score, "live_score": live_score, "episodes": len(ids),
                   "reward_mean": metrics.get("reward_mean"), **extra}
        if new_score < live_score - cfg.gate_margin:
            self._restore_accepted()
            self.state.pending = []
            self._next_stage(journal)  # a refused agent waits for the next cycle; the next agent goes on
            self._save_state()
            row = self.decide("refuse", f"candidate scored {new_score:.4f} < live {live_score:.4f} - margin "
                              f"{cfg.gate_margin}", round_id=journal["id"], **summary)
            self._end_journal()
            return row
        journal.update(phase="publishing", episodes=ids, summary=summary,
                       sha256=_weights_sha(candidate / "adapters", agents),
                       previous={a: self.registry.current(a) for a in agents})
        self._write_journal(journal)  # from here on a restart finishes this round instead of rerunning it
        return self._finish_round(journal)

    def _finish_round(self, journal: dict) -> dict:
        """Publish (adopting what this round already published), replace the accepted checkpoint, start
        watching, log the promotion. Idempotent: a restart after a kill anywhere in it runs it again."""
        cfg, summary = self.config, journal["summary"]
        if self.team.canary is not None:
            return self._start_canary(journal)
        candidate = self.dir / "candidate"
        versions = self.promote(candidate / "adapters", metrics={"eval_score": summary["candidate_score"]},
                                agents=journal["agents"], round_id=journal["id"], sha256=journal["sha256"])
        if journal["phase"] != "checkpointing":
            journal["phase"] = "checkpointing"
            self._write_journal(journal)
        durable.replace_dir(candidate / "checkpoint", self.dir / "accepted")
        self.state.pending = []
        self._next_stage(journal)
        self.state.watch = {"versions": versions, "previous": journal["previous"]}
        for eid in journal["episodes"]:  # the baseline: what the previous versions earned on the training episodes
            self._watch(self.store.get_episode(eid, exact=True))
        self._save_state()
        rel = self.team.adopt(journal["id"], journal["round"], summary)
        row = self.decide("promote", f"candidate scored {summary['candidate_score']:.4f} >= live "
                          f"{summary['live_score']:.4f} - margin {cfg.gate_margin}", versions=versions,
                          round_id=journal["id"], release=rel.id, **summary)
        self._end_journal()
        return row

    def _start_canary(self, journal: dict) -> dict:
        """Publish the gated candidate without serving it, make it a release and canary it (idempotent)."""
        summary = journal["summary"]
        versions = self._publish(self.dir / "candidate" / "adapters", {"eval_score": summary["candidate_score"]},
                                 journal["agents"], journal["id"], journal["sha256"])
        rel = self.team.start_canary(versions, journal)
        self.state.pending = []
        self._next_stage(journal)
        self._save_state()
        row = self.decide("canary", f"candidate scored {summary['candidate_score']:.4f} >= live "
                          f"{summary['live_score']:.4f} - margin {self.config.gate_margin}; release {rel.id} serves "
                          f"{self.config.canary.fraction:.0%} of episodes", versions=rel.versions, release=rel.id,
                          round_id=journal["id"], **summary)
        self._end_journal()
        return row

    def _accept_canary(self, release) -> None:
        """The canary was promoted: its trained state becomes the accepted checkpoint (idempotent)."""
        checkpoint = self.dir / "candidate" / "checkpoint"
        if checkpoint.is_dir():
            durable.replace_dir(checkpoint, self.dir / "accepted")
        self._trainer = None  # reloaded from the accepted checkpoint on next use
        self.trainer.policy_versions.update(release.versions)

    def _resume(self, journal: dict) -> dict | None:
        """A restart found the journal of a round a kill interrupted: finish it or let it rerun, and say so."""
        phase, rid = journal["phase"], journal["id"]
        extra = {"checkpoint": self._recovered} if self._recovered else {}
        self.state.round = journal["round"]
        if phase == "training":
            self.state.round -= 1  # the round runs again under its number
            self._save_state()
            self._end_journal()
            self.decide("resume", f"round {journal['round']} was interrupted while training or gating; nothing "
                        "was published; it runs again from the accepted checkpoint", round_id=rid, phase=phase,
                        adopted={}, **extra)
            return None
        adopted = {a: v for a in journal["agents"] if (v := self.registry.version_of_round(a, rid)) is not None}
        what = "the baseline publication" if phase == "baseline" else f"round {journal['round']}"
        done = ", ".join(f"{a} v{v}" for a, v in adopted.items()) or "none"
        self.decide("resume", f"{what} was interrupted while {'publishing' if phase == 'baseline' else phase}; "
                    f"adopting the versions it had published ({done}), publishing the rest and finishing it",
                    round_id=rid, phase=phase, adopted=adopted, **extra)
        if phase == "baseline":
            self._publish_baseline(journal)
            return None
        return self._finish_round(journal)

    def _publish(self, adapters_dir: Path, metrics: dict, agents: list[str], round_id: str | None,
                 sha256: dict[str, str] | None) -> dict[str, int]:
        """Publish each agent's adapter as a new registry version (not served yet). With a ``round_id``, a
        version that round already published (a restart after a kill) is adopted instead."""
        versions = {}
        for agent in agents:
            v = self.registry.version_of_round(agent, round_id) if round_id else None
            if v is not None and sha256 and self.registry.manifest(agent, v).sha256 != sha256.get(agent):
                raise MarftError(f"registry {agent} v{v} carries round {round_id} but not its adapter (sha256 "
                                 "differs); refusing to adopt it")
            if v is None:
                v = self.registry.publish(agent, adapters_dir / agent, metrics=metrics, round_id=round_id,
                                          config=self.trainer.config.model_dump(mode="json"))
            versions[agent] = v
        self.team.record_probes(versions)  # with ``probe:``: what each version must answer, recorded now
        return versions

    def promote(self, adapters_dir: Path, metrics: dict, agents: list[str] | None = None, *,
                round_id: str | None = None, sha256: dict[str, str] | None = None) -> dict[str, int]:
        """Publish each agent's adapter (``_publish``) and load it into every server."""
        versions = {}
        for agent in agents or self.config.agents:  # one agent at a time: published, then served
            v = self._publish(adapters_dir, metrics, [agent], round_id, sha256)[agent]
            versions[agent] = v if self.registry.current(agent) == v else self._serve(agent, v)
        # the trainer's versions are the registry's: max_version_lag and logprob_gap compare with them
        self.trainer.policy_versions.update(versions)
        return versions

    def _serve(self, agent: str, version: int | None = None) -> int:
        """Make ``version`` (None: the previous one) live: the registry marks it current only once
        the first server accepted it, then every other server loads it too."""
        first = self.publishers[0] if self.publishers else None
        if version is None:
            version = self.registry.rollback(agent, publisher=first)
        else:
            self.registry.promote(agent, version, publisher=first)
        for pub in self.publishers[1:]:
            pub.load(agent, self.registry.path(agent, version), version=version)
        return version

    def _restore_accepted(self) -> None:
        accepted = self.dir / "accepted"
        if accepted.is_dir():
            self.trainer.load_checkpoint(accepted)
        else:  # nothing accepted yet: start again from fresh adapters
            self._trainer = None

    def evaluate(self, adapters: dict[str, Path], candidate: bool) -> float:
        if self.eval_fn is not None:
            return float(self.eval_fn(adapters))
        return self._recorded_score(candidate)

    def _recorded_score(self, candidate: bool) -> float:
        """Held-out recorded episodes (served by the live versions): their mean team reward estimates
        the live system; the candidate (the trainer's adapters now) is estimated off-policy by
        weighted importance sampling, w = exp(sum log pi_candidate - sum behaviour log-prob)."""
        episodes = [ep for ep in (self.store.get_episode(i, exact=True) for i in self.state.heldout) if ep.team_reward() is not None]
        if not episodes:
            raise MarftError("no evaluation function and no held-out recorded episodes yet; set eval_function "
                             "or heldout_fraction > 0")
        rewards = [ep.team_reward() for ep in episodes]
        if not candidate:
            return sum(rewards) / len(rewards)
        logw = self.trainer.log_importance_weights(episodes)
        lw = [logw.get(ep.id, 0.0) for ep in episodes]
        top = max(lw)  # normalise before exp: the weights' ratios are what matter
        w = [math.exp(x - top) for x in lw]
        return sum(wi * r for wi, r in zip(w, rewards)) / sum(w)

    def _check_regression(self) -> dict | None:
        """Compare live rewards of episodes served by the promoted versions with the previous ones."""
        watch = self.state.watch
        new_v, old_v = watch["versions"], watch["previous"]
        new_r, old_r = list(watch.get("new", {}).values()), list(watch.get("old", {}).values())
        if len(new_r) < self.config.rollback_window or not old_r:
            return None
        new_mean, old_mean = sum(new_r) / len(new_r), sum(old_r) / len(old_r)
        self.state.watch = None
        if new_mean >= old_mean - self.config.rollback_margin:
            row = self.decide("keep", f"live reward {new_mean:.4f} on {len(new_r)} episodes vs {old_mean:.4f} "
                              f"before", versions=new_v)
            self._save_state()
            return None
        rolled = self.team.rollback(f"live reward {new_mean:.4f} fell below {old_mean:.4f}")
        rolled = {a: rolled[a] for a in old_v} if rolled else {agent: self._serve(agent) for agent in old_v}
        row = self.decide("rollback", f"live reward {new_mean:.4f} on {len(new_r)} episodes fell below "
                          f"{old_mean:.4f} - margin {self.config.rollback_margin}", versions=rolled)
        self._save_state()
        return row

    def status(self) -> dict:
        decisions = durable.read_json_lines(self.dir / DECISIONS_FILE)
        return {"state": self.state.model_dump(exclude={"live"}), "versions": {a: self.registry.current(a) for a in self.config.agents},
                "interrupted_round": self._journal(),  # a round a kill stopped; the next start finishes or reruns it
                "resumes": [d for d in decisions if d.get("decision") == "resume"][-10:],
                "recent_decisions": decisions[-10:], **self.team.status()}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _weights_sha(adapters_dir: Path, agents: list[str]) -> dict[str, str]:
    import hashlib

    from ..serving.adapter_files import WEIGHTS_FILE

    return {a: hashlib.sha256((adapters_dir / a / WEIGHTS_FILE).read_bytes()).hexdigest() for a in agents}
