"""``marft_bridge.fit(...)`` / ``marft fit``: train your own app on a task set, the app as the environment.

Per iteration: K tasks x G rollouts (distinct sampling seeds) through the user's app, concurrently, into
the store (each episode with its group: task id, rollout index); one MARFT update on the rewarded ones;
each agent's new adapter published as its next registry version and hot-swapped into the server; the val
tasks replayed with the same seeds; one metrics line. At the end the best-val versions are promoted and
``results.json`` and the learning curve are written.

Kill -9 at any point, then ``resume=True``: the iteration journal (``state/journal.json``, the service's
round journal in miniature) says what was done. Killed before publishing: the iteration runs again from
the accepted checkpoint (nothing was published). Killed while publishing or after: the versions it had
published are adopted (found by the journal's round id, checked by sha256), the rest published, and the
iteration finishes, so no version is published twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from ..errors import MarftError
from .. import durable
from . import report, tasks as T
from .settings import FitSettings, load_callable, marft_config

log = logging.getLogger("marft_bridge.fitting")

STATE_DIR = "state"
PRE_PUBLISH = ("rollouts", "training")  # a kill in these phases published nothing: the iteration reruns


def fit(app: str | Callable, tasks: str | Path, reward: str | Callable, base_model: str | Path, agents: list[str],
        out: str | Path, **options: Any) -> dict:
    """Train ``agents``' adapters of the app ``app(endpoint)`` builds on ``tasks`` with ``reward``; returns the
    results (also in ``out/results.json``). Options: FitSettings' fields (``marft fit --help``)."""
    from pydantic import ValidationError

    try:
        s = FitSettings(app=app, tasks=tasks, reward=reward, base_model=base_model, agents=agents, out=out, **options)
    except ValidationError as e:
        raise MarftError(f"fit options: {e}") from None
    from .ranks import TrainStep, rank_and_world

    rank, world = rank_and_world()
    if world > 1 and s.algorithm != "ppo":
        raise MarftError(f"--algorithm {s.algorithm} runs in one process; under torchrun use --algorithm ppo")
    if rank != 0:  # torchrun: the other ranks train what rank 0 broadcasts
        from ..store import TraceStore

        trainer = _trainer(s)
        TrainStep(trainer, TraceStore.open(s.store_url())).follow()
        return {}
    return _Fit(s).run()


def _trainer(s: FitSettings):
    from ..trainers.marft import MarftTrainer

    if not Path(s.base_model).is_dir():
        raise MarftError(f"--base-model {s.base_model} is not a directory")
    return MarftTrainer(marft_config(s), s.base_model, agents=list(s.agents), out_dir=Path(s.out))


class _Fit:
    def __init__(self, s: FitSettings):
        from rich.console import Console

        self.s = s
        self.out = Path(s.out)
        self.dir = self.out / STATE_DIR
        self.console = s.console or Console()
        self.train_tasks, self.val_tasks = self._tasks()  # bad task files are refused before anything starts
        self.reward_fn = load_callable(s.reward, "reward function")
        self.factory = load_callable(s.app, "app factory")
        self._check_out()
        self.state = self._load_state()

    # -- start ------------------------------------------------------------------------------------

    def _tasks(self) -> tuple[list[T.Task], list[T.Task]]:
        train = T.read_tasks(self.s.tasks)
        if self.s.val:
            return train, T.read_tasks(self.s.val)
        train, val = T.split_val(train, self.s.seed)
        self._say(f"no --val: holding out a fixed {T.VAL_FRACTION:.0%} of --tasks ({len(val)} of "
                  f"{len(train) + len(val)} tasks, seed {self.s.seed}) for validation")
        return train, val

    def _say(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def _check_out(self) -> None:
        has_state = (self.dir / "state.json").is_file() or (self.dir / "journal.json").is_file()
        if has_state and not self.s.resume:
            raise MarftError(f"{self.out} holds a fit run; pass --resume to continue it, or choose another --out")
        self.dir.mkdir(parents=True, exist_ok=True)

    def _load_state(self) -> dict:
        p = self.dir / "state.json"
        return json.loads(p.read_text()) if p.is_file() else {"iteration": -1, "rows": [], "attempts": 0}

    def _save_state(self) -> None:
        durable.write_json(self.dir / "state.json", self.state)

    def _journal(self) -> dict | None:
        p = self.dir / "journal.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def _write_journal(self, journal: dict) -> None:
        durable.write_json(self.dir / "journal.json", journal)

    def _end_journal(self) -> None:
        (self.dir / "journal.json").unlink(missing_ok=True)

    # -- the run ----------------------------------------------------------------------------------

    def run(self) -> dict:
        from ..serving.registry import AdapterRegistry
        from ..store import TraceStore
        from .endpoint import Endpoint
        from .ranks import TrainStep
        from .rollouts import prepare_app
        from .serving import Serving

        s, started = self.s, time.perf_counter()
        self.step = None
        self.store = TraceStore.open(s.store_url())
        self.registry = AdapterRegistry(s.registry or self.out / "registry")
        self.served = s.served_names()
        self.loop = asyncio.new_event_loop()
        try:
            serving = Serving(s.base_model, self.registry, server=s.server, api_key=s.api_key,
                              api_key_env=s.api_key_env, publisher=s.publisher,
                              start_timeout=s.server_start_timeout)  # bad options: refused first
            self.step = TrainStep(_trainer(s), self.store)
            with serving as srv, report.Progress(self.console, s.progress) as bar:
                self.publisher, self.bar = srv.publisher, bar
                self.app = prepare_app(self.factory(Endpoint(srv.url, srv.api_key, self.served)),
                                       self.store)
                self._resume()
                for it in range(self.state["iteration"] + 1, s.iterations + 1):
                    self._iteration(it) if it > 0 else self._baseline()
                return self._finish(time.perf_counter() - started)
        finally:
            if self.step is not None:
                self.step.stop()  # torchrun: the other ranks leave their loop
            self.loop.close()
            self.store.close()

    def _resume(self) -> None:
        """Recover the accepted checkpoint, finish or drop an interrupted iteration, and load what is live."""
        what = durable.recover_dir(self.dir / "accepted")
        journal = self._journal()
        if journal is not None:
            if journal["phase"] in PRE_PUBLISH:
                self._say(f"resume: iteration {journal['iteration']} was interrupted while "
                                   f"{journal['phase']}; nothing was published; it runs again")
                self._end_journal()
            else:
                self._say(f"resume: iteration {journal['iteration']} was interrupted while "
                                   f"{journal['phase']}; adopting what it published and finishing it")
                self._finish_iteration(journal)
        elif self.state["iteration"] >= 0:
            self._say(f"resume: {self.state['iteration']} iterations done" + (f"; {what}" if what else ""))
        if (self.dir / "accepted").is_dir():
            self.step.load(self.dir / "accepted")
        for name in self.served.values():  # a restarted server holds nothing: load each agent's live version
            if self.registry.current(name) is not None:
                self.publisher.deploy(self.registry, name)

    def _baseline(self) -> None:
        """Iteration 0: the untrained adapters (LoRA B = 0: the base model) published as each agent's
        first version, and evaluated."""
        cand = self.dir / "candidate"
        durable.replace_dir(self._save_adapters(self.dir / "baseline-new"), cand / "adapters")
        journal = {"id": uuid.uuid4().hex, "iteration": 0, "phase": "publishing", "metrics": {},
                   "counts": {}, "train_reward": None, "seconds": 0.0,
                   "sha256": _weights_sha(cand / "adapters", self.s.agents)}
        self._write_journal(journal)
        self._finish_iteration(journal)

    def _save_adapters(self, directory: Path) -> Path:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
        self.step.save_adapters(directory)
        return directory

    def _iteration(self, it: int) -> None:
        s, started = self.s, time.perf_counter()
        rid = uuid.uuid4().hex
        journal = {"id": rid, "iteration": it, "phase": "rollouts"}
        self._write_journal(journal)
        picked = T.iteration_tasks(self.train_tasks, it, s.tasks_per_iteration, s.seed)
        jobs = [(t, g, T.rollout_seed(s.seed, it, k, g, s.group_size))
                for k, t in enumerate(picked) for g in range(s.group_size)]
        outcomes = self._play(jobs, {"iteration": it, "split": "train", "attempt": rid},
                              f"iteration {it}/{s.iterations}")
        counts = _count(outcomes)
        trainable = [o.episode for o in outcomes if o.status == "ok" and o.episode is not None]
        rewards = [o.reward for o in outcomes if o.status == "ok" and o.reward is not None]
        journal.update(counts=counts, train_reward=sum(rewards) / len(rewards) if rewards else None)
        if not trainable:  # nothing to learn from: no update, nothing published; val still measured
            self.bar.print(f"iteration {it}: every rollout failed or was excluded ({counts}); no update")
            journal.update(phase="evaluating", metrics={}, versions={}, seconds=time.perf_counter() - started)
            self._write_journal(journal)
            return self._evaluate_and_close(journal)
        _check_trainable(trainable, s.agents)
        journal["phase"] = "training"
        self._write_journal(journal)  # a kill from here to "publishing" reruns the iteration
        metrics = self._update(it, outcomes, trainable)
        if metrics.get("kept_rollouts", 0) is None:  # expert iteration kept nothing: no update, nothing published
            self.bar.print(f"iteration {it}: no rollout passed the expert-iteration bar; no update")
            journal.update(phase="evaluating", metrics=_small(metrics), versions={},
                           seconds=time.perf_counter() - started)
            self._write_journal(journal)
            return self._evaluate_and_close(journal)
        durable.fsync_tree(self.dir / "candidate")
        journal.update(phase="publishing", metrics=_small(metrics), seconds=time.perf_counter() - started,
                       sha256=_weights_sha(self.dir / "candidate" / "adapters", s.agents))
        self._write_journal(journal)  # from here on a restart finishes the iteration
        self._finish_iteration(journal)

    def _update(self, it: int, outcomes: list, trainable: list) -> dict:
        """The iteration's update; the new adapters and checkpoint in state/candidate."""
        if self.s.algorithm == "ppo":
            return self.step.train([e.id for e in trainable], self.dir / "candidate", episodes=trainable)
        from . import expert

        metrics = expert.update(self.step.trainer, outcomes, self.s, it, self.dir / "candidate")
        durable.append_json_line(self.out / "metrics.jsonl", {"update": it, **metrics})  # as the trainer's rows
        return metrics

    def _finish_iteration(self, journal: dict) -> None:
        """Publish (adopting what this round published before a kill), replace the accepted checkpoint,
        evaluate, save. Idempotent: a restart after a kill anywhere in it runs it again."""
        if journal["phase"] == "publishing":
            journal["versions"] = self._publish(journal)
            journal["phase"] = "checkpointing"
            self._write_journal(journal)
        if journal["phase"] == "checkpointing":
            ckpt = self.dir / "candidate" / "checkpoint"
            if ckpt.is_dir():
                durable.replace_dir(ckpt, self.dir / "accepted")
            journal["phase"] = "evaluating"
            self._write_journal(journal)
        self._evaluate_and_close(journal)

    def _publish(self, journal: dict) -> dict[str, int]:
        adapters, rid = self.dir / "candidate" / "adapters", journal["id"]
        # finite numbers only: a manifest records NaN (value_loss without a critic) as null, unreadable
        metrics = {k: v for k, v in journal.get("metrics", {}).items()
                   if isinstance(v, (int, float)) and math.isfinite(v)}
        versions = {}
        for agent, name in self.served.items():
            v = self.registry.version_of_round(name, rid)
            if v is not None and self.registry.manifest(name, v).sha256 != journal["sha256"][agent]:
                raise MarftError(f"registry {name} v{v} carries round {rid} but not its adapter (sha256 differs); "
                                 "refusing to adopt it")
            if v is None:
                v = self.registry.publish(name, adapters / agent, metrics=metrics, round_id=rid,
                                          config=self.step.trainer.config.model_dump(mode="json"))
            if self.registry.current(name) != v:
                self.registry.promote(name, v, publisher=self.publisher)  # hot-swap: the server loads it
            versions[name] = v
        return versions

    def _evaluate_and_close(self, journal: dict) -> None:
        it = journal["iteration"]
        versions = journal.get("versions") or (self.state["rows"][-1]["versions"] if self.state["rows"] else {})
        val = self._validate(it, journal["id"])
        row = {"iteration": it, "train_reward": journal.get("train_reward"), "counts": journal.get("counts", {}),
               "versions": versions, **val, "seconds": journal.get("seconds", 0.0),
               "metrics": journal.get("metrics", {})}
        self.state["rows"] = [r for r in self.state["rows"] if r["iteration"] != it] + [row]
        self.state["iteration"] = it
        self._save_state()
        report.append_row(self.out, row)
        self._end_journal()
        if it > 0:
            self.bar.print(report.metrics_line(row, self.s.iterations))
        else:
            self.bar.print(f"iter 0 (untrained): val {row['val_reward']:.3f} ± {row['val_sem']:.3f} "
                           f"({row['val_n']} tasks)")

    def _validate(self, it: int, rid: str) -> dict:
        jobs = [(t, 0, T.val_seed(k)) for k, t in enumerate(self.val_tasks)]
        outcomes = self._play(jobs, {"iteration": it, "split": "val", "attempt": rid}, f"val after iteration {it}")
        return report.val_summary([o.reward if o.status == "ok" else None for o in outcomes])

    def _play(self, jobs: list, meta: dict, description: str) -> list:
        from .rollouts import play_all

        s = self.s
        last = self.state["rows"][-1]["val_reward"] if self.state["rows"] else None
        self.bar.start(description, len(jobs), f"val {last:.3f}" if last is not None else "")
        return self.loop.run_until_complete(play_all(
            self.app, jobs, concurrency=s.concurrency, on_done=lambda o: self.bar.advance(), store=self.store,
            source=s.source, meta=meta, reward_fn=self.reward_fn, timeout=s.rollout_timeout, registry=self.registry))

    def _finish(self, seconds: float) -> dict:
        rows = self.state["rows"]
        best = max(rows, key=lambda r: (r["val_reward"], -r["iteration"]))
        for name, v in best["versions"].items():
            if self.registry.current(name) != v:
                self.registry.promote(name, v, publisher=self.publisher)
        durable.replace_dir(self.dir / "candidate" / "adapters", self.out / "adapters")  # the last adapters
        best_info = {"iteration": best["iteration"], "val_reward": best["val_reward"], "versions": best["versions"]}
        settings = self.s.public_dict()
        results = report.write_results(self.out, rows, best_info, settings, seconds)
        report.plot_curve(rows, self.out / report.CURVE_FILE, f"marft fit: {', '.join(self.s.agents)}")
        self._say(f"best val {best['val_reward']:.3f} at iteration {best['iteration']}: promoted "
                           + ", ".join(f"{a} v{v}" for a, v in best["versions"].items())
                           + f"; results in {self.out / report.RESULTS_FILE}, curve in {self.out / report.CURVE_FILE}")
        return results


def _check_trainable(episodes: list, agents: list[str]) -> None:
    """Refuse a run whose model calls the trainer cannot attribute to any of ``agents`` (the app's models
    do not send ``model=endpoint.model(agent)``): it would train nothing, silently."""
    from ..trainers.batch import trained_name

    calls = [a for e in episodes for a in e.actions if a.kind == "llm"]
    if not any(trained_name(a, set(agents)) for a in calls):
        used = sorted({a.policy.name if a.policy else a.agent for a in calls})
        raise MarftError(f"no model call of the {len(episodes)} rewarded episodes belongs to --agents {agents} "
                         f"(the calls used {used or 'no model at all'}); each agent's model must send "
                         "model=endpoint.model(AGENT) to endpoint.base_url")


def _count(outcomes: list) -> dict[str, int]:
    from .rollouts import Counts

    return dict(Counts().add(outcomes))


def _small(metrics: dict) -> dict:
    """The update's scalar metrics and flat tables of them (the journal and results keep no deeper nesting)."""
    def scalar(v: Any) -> bool:
        return isinstance(v, (int, float, str, bool)) or v is None

    def finite(v: Any) -> Any:  # NaN (value_loss without a critic) is not JSON: None
        return None if isinstance(v, float) and not math.isfinite(v) else v

    return {k: ({x: finite(y) for x, y in v.items()} if isinstance(v, dict) else finite(v)) for k, v in metrics.items()
            if scalar(v) or (isinstance(v, dict) and all(isinstance(x, str) and scalar(y) for x, y in v.items()))}


def _weights_sha(adapters_dir: Path, agents: list[str]) -> dict[str, str]:
    import hashlib

    from ..serving.adapter_files import WEIGHTS_FILE

    return {a: hashlib.sha256((adapters_dir / a / WEIGHTS_FILE).read_bytes()).hexdigest() for a in agents}
