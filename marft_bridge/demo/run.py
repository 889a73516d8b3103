"""``marft demo``: the whole loop on embedded defaults, and the comparison that says whether it helps.

For every method (MARFT-A, MARFT-T, single-agent PPO) and seed, on one embedded server:

1. publish the untrained adapters as v1 of each agent and hot-load them;
2. each iteration: run the instrumented LangGraph app on training questions (every request goes
   through the server, every run is captured into the store with token ids, log-probs and the
   adapter version that served it), train one update from the store's new episodes, publish the
   new adapters as the next registry version and hot-swap them into the running server, then
   measure held-out accuracy through the server.

The untrained system is each run's iteration 0. At the end: a table of held-out accuracy (mean ±
std over seeds) and a learning-curve PNG, both under ``out``.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import statistics
import time
from pathlib import Path

from pydantic import BaseModel

log = logging.getLogger("marft_bridge.demo")

METHODS = {"marft_a": "MARFT-A", "marft_t": "MARFT-T", "single_agent": "single-agent PPO"}


class DemoSettings(BaseModel):
    seeds: int = 2
    iterations: int = 6
    episodes_per_iteration: int = 48
    heldout: int = 96
    concurrency: int = 16
    temperature: float = 0.7
    methods: list[str] = list(METHODS)
    warmstart: dict = {}  # WarmStartConfig overrides (the model is cached per setting)
    trainer: dict = {
        "lr": 1e-3,
        "critic_lr": 1e-3,
        "ppo_epochs": 4,
        "num_minibatches": 2,
        "kl_coef": 0.0,
        "entropy_coef": 0.0,
        "lora_r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    }

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(seeds=1, iterations=2, episodes_per_iteration=16, heldout=24)


class _Run:
    """One (method, seed): its trainer, its adapter names on the server, its instrumented app."""

    def __init__(self, method: str, seed: int, base: Path, server, key: str, registry, store, s: DemoSettings):
        from ..integrations.langgraph import instrument
        from ..serving import EmbeddedServerPublisher
        from ..trainers.config import MarftConfig
        from ..trainers.marft import MarftTrainer
        from . import app as demo_app
        from . import task

        self.registry, self.store = registry, store
        self.publisher = EmbeddedServerPublisher(server.url, key)
        self.source = f"demo/{method}/s{seed}"
        single = method == "single_agent"
        # Captured agents are the graph's node names; the server names adapters per run.
        agents = ["agent"] if single else ["planner", "solver"]
        self.served = {a: f"{a}-{method}-s{seed}".replace("_", "-") for a in agents}
        self.trainer = MarftTrainer(MarftConfig(mode=method, seed=seed, **s.trainer), base, agents=agents)
        if single:
            build = lambda: demo_app.build_single_agent_app(server.url, key, model=self.served["agent"],  # noqa: E731
                                                            temperature=s.temperature)
        else:
            build = lambda: demo_app.build_app(server.url, key, planner_model=self.served["planner"],  # noqa: E731
                                               solver_model=self.served["solver"], temperature=s.temperature)
        self.eval_app = build()
        self.app = instrument(build(), store=store, source=self.source,
                              reward_fn=lambda inputs, outputs: task.reward(inputs["question"], outputs.get("answer")))
        self.versions: list[dict[str, int]] = []
        self.publish()

    def publish(self, metrics: dict | None = None) -> dict[str, int]:
        """Save the trainer's adapters as each agent's next version and hot-swap them in."""
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            self.trainer.save_adapters(tmp)
            versions = {}
            for agent, name in self.served.items():
                v = self.registry.publish(name, Path(tmp) / agent, metrics=metrics or {},
                                          config=self.trainer.config.model_dump(mode="json"))
                self.registry.promote(name, v, publisher=self.publisher)
                versions[agent] = v
        self.versions.append(versions)
        return versions

    def rollout(self, problems, concurrency: int) -> list:
        """Run the instrumented app; return the captured episodes (as the store holds them)."""
        cursor = self.store.cursor()
        self.app.batch([{"question": p.question} for p in problems], config={"max_concurrency": concurrency})
        self.store.flush()
        _, ids = self.store.changed_since(cursor)
        return [e for e in (self.store.get_episode(i) for i in ids) if e.source == self.source]

    def accuracy(self, problems, concurrency: int) -> float:
        from . import task

        outs = self.eval_app.batch([{"question": p.question} for p in problems], config={"max_concurrency": concurrency})
        return sum(task.reward(p.question, o.get("answer")) for p, o in zip(problems, outs)) / len(problems)


def run_demo(out: str | Path = ".marft/demo", quick: bool = False, seeds: int | None = None,
             iterations: int | None = None, settings: DemoSettings | None = None,
             model_cache: str | Path | None = None) -> dict:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers.utils import logging as hf_logging

    from ..serving import AdapterRegistry, ServerProcess
    from ..store import TraceStore
    from . import task
    from .warmstart import DEFAULT_CACHE_DIR, WarmStartConfig, warm_start

    s = settings or (DemoSettings.quick() if quick else DemoSettings())
    s = s.model_copy(update={k: v for k, v in {"seeds": seeds, "iterations": iterations}.items() if v})
    console = Console()
    out = _fresh_dir(Path(out))
    logging.getLogger("marft_bridge.trainers").setLevel(logging.WARNING)
    hf_logging.disable_progress_bar()  # one progress display: ours
    started = time.perf_counter()

    console.print("[bold]1/3[/] warm-started base model (cached under .marft/models)")
    warm = WarmStartConfig(**s.warmstart)
    base = warm_start(warm, cache_dir=model_cache or DEFAULT_CACHE_DIR)
    # The warm start's own split: its demonstrations never saw these held-out questions.
    splits = task.make_splits(seed=warm.split_seed, heldout_size=warm.heldout_size)
    heldout = splits.heldout[: s.heldout]
    store = TraceStore.open(out / "traces.db")
    registry = AdapterRegistry(out / "registry")
    key = secrets.token_hex(16)
    curves: dict[str, list[list[float]]] = {m: [] for m in s.methods}
    checks = {"episodes": 0, "versions_recorded": True}

    console.print(f"[bold]2/3[/] embedded server on {base.name}; {len(s.methods)} methods x {s.seeds} seeds x "
                  f"{s.iterations} iterations of {s.episodes_per_iteration} episodes")
    with ServerProcess(base, registry, api_key=key) as server, Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"), console=console,
    ) as bar:
        job = bar.add_task("runs", total=len(s.methods) * s.seeds * s.iterations, status="")
        for method in s.methods:
            for seed in range(s.seeds):
                run = _Run(method, seed, base, server, key, registry, store, s)
                curve = [run.accuracy(heldout, s.concurrency)]
                for it in range(s.iterations):
                    bar.update(job, description=f"{METHODS[method]} seed {seed}",
                               status=f"iter {it + 1}: held-out {curve[-1]:.2f}")
                    problems = task.sample_problems(splits.train, s.episodes_per_iteration, seed=seed * 1000 + it)
                    episodes = run.rollout(problems, s.concurrency)
                    checks["episodes"] += len(episodes)
                    live = run.versions[-1]
                    checks["versions_recorded"] &= all(
                        a.policy is not None and a.policy.version == live[a.agent]
                        for e in episodes for a in e.actions if a.kind == "llm")
                    metrics = run.trainer.train_on(episodes)
                    run.publish(metrics={"train_reward": metrics.get("reward_mean", 0.0)})
                    curve.append(run.accuracy(heldout, s.concurrency))
                    bar.advance(job)
                curves[method].append(curve)
                _write_metrics(out, method, seed, curve, run.versions)

    results = _summarise(curves, s, time.perf_counter() - started, checks, out)
    _print_table(console, results)
    _plot(curves, out / "learning_curve.png")
    console.print(f"[bold]3/3[/] results in {out / 'results.json'}, learning curve in {out / 'learning_curve.png'}")
    return results


MARKER = ".marft-demo"


def _fresh_dir(out: Path) -> Path:
    """Empty the output directory for a new run, but only one a demo made (never a user's folder)."""
    from ..errors import MarftError

    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).is_file():
            raise MarftError(f"{out} is not empty and was not made by marft demo; choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("made by marft demo; emptied at the start of every run\n")
    return out


def _write_metrics(out: Path, method: str, seed: int, curve: list[float], versions: list[dict]) -> None:
    with open(out / "curves.jsonl", "a") as f:
        f.write(json.dumps({"method": method, "seed": seed, "heldout_accuracy": curve, "versions": versions}) + "\n")


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _summarise(curves: dict, s: DemoSettings, seconds: float, checks: dict, out: Path) -> dict:
    untrained = [c[0] for runs in curves.values() for c in runs]
    rows = [{"system": "untrained system", "accuracy": _mean_std(untrained)}]
    rows += [{"system": METHODS[m], "accuracy": _mean_std([c[-1] for c in runs])} for m, runs in curves.items()]
    results = {"settings": s.model_dump(), "seeds": list(range(s.seeds)), "rows": rows, "seconds": seconds,
               "checks": checks, "curves": curves}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return results


def _print_table(console, results: dict) -> None:
    from rich.table import Table

    s = results["settings"]
    table = Table(title=f"held-out accuracy after {s['iterations']} iterations x {s['episodes_per_iteration']} "
                        f"episodes (seeds {results['seeds']}, {results['seconds']:.0f} s)")
    table.add_column("system")
    table.add_column("accuracy (mean ± std)", justify="right")
    for row in results["rows"]:
        mean, std = row["accuracy"]
        table.add_row(row["system"], f"{mean:.3f} ± {std:.3f}")
    console.print(table)


def _plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, runs in curves.items():
        if not runs:
            continue
        xs = range(len(runs[0]))
        means = [statistics.fmean(c[i] for c in runs) for i in xs]
        ax.plot(xs, means, marker="o", label=METHODS[method])
    ax.set_xlabel("iteration (0 = untrained)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("marft demo: planner/solver arithmetic")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
