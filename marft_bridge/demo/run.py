"""``marft demo``: the whole loop on embedded defaults, and the comparison that says whether it helps.

For every method (MARFT-A, MARFT-T, single-agent PPO) and seed, one ``marft_bridge.fit`` run of the
demo app on one shared embedded server, registry and store (the demo is ``fit``'s first user):

1. publish the untrained adapters as v1 of each agent and hot-load them;
2. each iteration: run the LangGraph app on training questions (every request goes through the
   server, every run is captured into the store with token ids, log-probs, the adapter version that
   served it and its group), train one update from those episodes, publish the new adapters as the
   next registry version and hot-swap them into the running server, then measure held-out accuracy
   through the server (the same seeds every iteration).

Methods: MARFT-A (dependency order, M over ancestors, clipped), independent per-agent PPO (the same
adapters with M = 1: what the sequential trust region adds), MARFT-T, and single-agent PPO (one
agent does the whole task). Every request carries a seed, so a run samples reproducibly.

Evaluation. The learning curve is held-out accuracy through the server after every iteration
(``heldout`` questions, one sample each). The table evaluates in process, on the same held-out
questions, ``eval_samples`` samples per question plus the exact (teacher-forced) probability of
the correct plan: the untrained two-agent and single-agent systems separately (adapters start as
the identity, so one evaluation each), each trained run's final adapters, and each trained system
against its own untrained start. Intervals are 95% intervals of the sampling error with the
question set held fixed; seed-to-seed spread is reported beside them. Everything goes to
``results.json``; a learning-curve PNG with bands beside it.
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

METHODS = {"marft_a": "MARFT-A", "independent": "independent PPO", "marft_t": "MARFT-T",
           "single_agent": "single-agent PPO"}
# Trainer options per method on top of DemoSettings.trainer (MarftConfig defaults: dependency order,
# M over ancestors in D, clipped).
METHOD_CONFIG = {"marft_a": {"mode": "marft_a"}, "independent": {"mode": "marft_a", "factor_scope": "none"},
                 "marft_t": {"mode": "marft_t"}, "single_agent": {"mode": "single_agent"}}
UNTRAINED = {"two_agent": "untrained two-agent system", "single_agent": "untrained single-agent system"}


class DemoSettings(BaseModel):
    seeds: int = 2
    iterations: int = 6
    episodes_per_iteration: int = 48  # tasks x group_size
    group_size: int = 1  # rollouts per question (2+ for group advantages)
    heldout: int = 96
    eval_samples: int = 24  # in-process samples per held-out question for the table
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
        return cls(seeds=1, iterations=2, episodes_per_iteration=8, heldout=12, eval_samples=2)


def _write_tasks(out: Path, splits, heldout) -> tuple[Path, Path]:
    """The demo's questions as ``marft fit`` task files (one app input per line, the question as its id)."""
    d = out / "tasks"
    d.mkdir(exist_ok=True)
    for name, problems in (("train", splits.train), ("heldout", heldout)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps({"id": p.question, "question": p.question}) + "\n"
                                                 for p in problems))
    return d / "train.jsonl", d / "heldout.jsonl"


def _reward(inputs: dict, outputs: dict) -> float:
    from . import task

    return task.reward(inputs["question"], outputs.get("answer"))


def _factory(single: bool, temperature: float):
    """FACTORY(endpoint) for ``fit``: the demo app, each agent's model the adapter ``fit`` serves for it."""
    from . import app as demo_app

    def build(endpoint):
        if single:
            return demo_app.build_single_agent_app(endpoint.base_url, endpoint.api_key, model=endpoint.model("agent"),
                                                   temperature=temperature)
        return demo_app.build_app(endpoint.base_url, endpoint.api_key, planner_model=endpoint.model("planner"),
                                  solver_model=endpoint.model("solver"), temperature=temperature)

    return build


def _trainer_config(method: str, seed: int, s: DemoSettings) -> dict:
    # No periodic trainer checkpoints: fit keeps its own, once per iteration.
    return {"seed": seed, "checkpoint_every": None, **s.trainer, **METHOD_CONFIG[method]}


def _fit_run(method: str, seed: int, base: Path, server, key: str, s: DemoSettings, out: Path, files, console) -> dict:
    """One (method, seed) through ``marft_bridge.fit`` on the shared server, registry and store. Captured
    agents are the graph's node names; the server names their adapters per run."""
    from ..fitting import fit

    agents = ["agent"] if method == "single_agent" else ["planner", "solver"]
    served = {a: f"{a}-{method}-s{seed}".replace("_", "-") for a in agents}
    console.print(f"[bold]{METHODS[method]}[/] seed {seed}")
    return fit(_factory(method == "single_agent", s.temperature), files[0], _reward, base, agents,
               out / "runs" / f"{method}-s{seed}", val=files[1], config=_trainer_config(method, seed, s),
               iterations=s.iterations, tasks_per_iteration=max(1, s.episodes_per_iteration // s.group_size),
               group_size=s.group_size, concurrency=s.concurrency, seed=seed, server=server.url, api_key=key,
               publisher="embedded", registry=out / "registry", store=str(out / "traces.db"),
               source=f"demo/{method}/s{seed}", served=served, console=console)


def _final_trainer(method: str, seed: int, base: Path, s: DemoSettings, run_dir: Path):
    """A trainer holding the run's last adapters, for the in-process held-out table."""
    from ..trainers.config import MarftConfig
    from ..trainers.marft import MarftTrainer

    agents = ["agent"] if method == "single_agent" else ["planner", "solver"]
    from types import SimpleNamespace

    trainer = MarftTrainer(MarftConfig(**_trainer_config(method, seed, s)), base, agents=agents)
    trainer.load_adapters(run_dir / "adapters")
    return SimpleNamespace(trainer=trainer, single=method == "single_agent")


def _check_run(store, source: str, rows: list[dict]) -> tuple[int, bool]:
    """(training episodes, whether every one was served by the versions live in its iteration)."""
    n, ok = 0, True
    for ep in store.episodes(source=source):
        info = ep.metadata.get("fit", {})
        if info.get("split") != "train" or info.get("outcome") != "ok":
            continue
        n += 1
        live = next(r["versions"] for r in rows if r["iteration"] == info["iteration"] - 1)
        ok &= all(a.policy is not None and a.policy.version == live[a.policy.name]
                  for a in ep.actions if a.kind == "llm")
    return n, ok


def run_demo(out: str | Path = ".marft/demo", quick: bool = False, seeds: int | None = None,
             iterations: int | None = None, settings: DemoSettings | None = None,
             model_cache: str | Path | None = None) -> dict:
    from rich.console import Console
    from transformers.utils import logging as hf_logging

    from ..serving import AdapterRegistry, ServerProcess
    from ..store import TraceStore
    from . import task
    from .evaluate import load_model
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
    files = _write_tasks(out, splits, heldout)
    store = TraceStore.open(out / "traces.db")
    registry = AdapterRegistry(out / "registry")
    key = secrets.token_hex(16)
    curves: dict[str, list[list[float]]] = {m: [] for m in s.methods}
    final: dict[str, list[dict]] = {m: [] for m in s.methods}
    untrained: dict[str, dict] = {}
    _, tokenizer = load_model(base)  # left-padded, for batched in-process generation
    checks = {"episodes": 0, "versions_recorded": True}

    console.print(f"[bold]2/3[/] embedded server on {base.name}; {len(s.methods)} methods x {s.seeds} seeds x "
                  f"{s.iterations} iterations of {s.episodes_per_iteration} episodes, each run through marft fit")
    with ServerProcess(base, registry, api_key=key) as server:
        for method in s.methods:
            for seed in range(s.seeds):
                res = _fit_run(method, seed, base, server, key, s, out, files, console)
                rows = res["iterations"]
                curves[method].append([r["val_reward"] for r in rows])
                n, ok = _check_run(store, f"demo/{method}/s{seed}", rows)
                checks["episodes"] += n
                checks["versions_recorded"] &= ok
                run = _final_trainer(method, seed, base, s, out / "runs" / f"{method}-s{seed}")
                final[method].append(_evaluate(run, tokenizer, heldout, s, seed=seed))
                if UNTRAINED[_kind(method)] not in untrained:  # the v1 adapters are the identity: one evaluation
                    untrained[UNTRAINED[_kind(method)]] = _evaluate(run, tokenizer, heldout, s, seed=-1, untrained=True)
                _write_metrics(out, method, seed, curves[method][-1], [r["versions"] for r in rows],
                               final[method][-1])

    results = _summarise(curves, final, untrained, s, time.perf_counter() - started, checks, out)
    _print_table(console, results)
    _plot(curves, out / "learning_curve.png", len(heldout))
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


def _kind(method: str) -> str:
    return "single_agent" if method == "single_agent" else "two_agent"


def _evaluate(run, tokenizer, heldout, s: DemoSettings, seed: int, untrained: bool = False) -> dict:
    from .evaluate import evaluate_trainer

    r = evaluate_trainer(run.trainer, tokenizer, heldout, two_agent=not run.single, samples=s.eval_samples,
                         seed=10**6 + seed, temperature=s.temperature, untrained=untrained)
    return {"accuracy": r.accuracy, "ci95": r.ci95, "plan_prob": r.plan_prob, "samples": r.samples,
            "per_question": r.per_question}


def _write_metrics(out: Path, method: str, seed: int, curve: list[float], versions: list[dict], final: dict) -> None:
    with open(out / "curves.jsonl", "a") as f:
        f.write(json.dumps({"method": method, "seed": seed, "heldout_accuracy": curve, "versions": versions,
                            "final_eval": final}) + "\n")


def _pooled(evals: list[dict]) -> tuple[float, float]:
    """Mean over runs and the 95% sampling half-width of that mean (runs sample independently)."""
    mean = statistics.fmean(e["accuracy"] for e in evals)
    return mean, (sum(e["ci95"] ** 2 for e in evals) ** 0.5) / len(evals)


def _summarise(curves: dict, final: dict, untrained: dict, s: DemoSettings, seconds: float, checks: dict,
               out: Path) -> dict:
    rows = []
    for name, e in untrained.items():
        rows.append({"system": name, "accuracy": [e["accuracy"], e["ci95"]], "plan_prob": e["plan_prob"],
                     "per_seed": [e["accuracy"]], "vs_untrained": None})
    for m, evals in final.items():
        if not evals:
            continue
        mean, ci = _pooled(evals)
        start = untrained[UNTRAINED[_kind(m)]]
        rows.append({"system": METHODS[m], "accuracy": [mean, ci],
                     "plan_prob": statistics.fmean(e["plan_prob"] for e in evals),
                     "per_seed": [e["accuracy"] for e in evals],
                     "seed_std": statistics.stdev([e["accuracy"] for e in evals]) if len(evals) > 1 else 0.0,
                     "vs_untrained": {"against": UNTRAINED[_kind(m)], "diff": mean - start["accuracy"],
                                      "ci95": (ci ** 2 + start["ci95"] ** 2) ** 0.5}})
    by = {r["system"]: r for r in rows}
    comparisons = {}
    for a, b in (("MARFT-A", "independent PPO"), ("MARFT-A", "MARFT-T"), ("MARFT-A", "single-agent PPO")):
        if a in by and b in by:
            diff = by[a]["accuracy"][0] - by[b]["accuracy"][0]
            ci = (by[a]["accuracy"][1] ** 2 + by[b]["accuracy"][1] ** 2) ** 0.5
            # Evaluation sampling only: the spread between training seeds is not inside this interval.
            comparisons[f"{a} - {b}"] = {"diff": diff, "ci95": ci, "beyond_sampling_noise": abs(diff) > ci}
    results = {"settings": s.model_dump(), "seeds": list(range(s.seeds)), "rows": rows, "comparisons": comparisons,
               "seconds": seconds, "checks": checks, "curves": curves, "final_eval": final, "untrained_eval": untrained}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return results


def _print_table(console, results: dict) -> None:
    from rich.table import Table

    s = results["settings"]
    table = Table(title=f"held-out accuracy after {s['iterations']} iterations x {s['episodes_per_iteration']} "
                        f"episodes (seeds {results['seeds']}; {s['heldout']} questions x {s['eval_samples']} samples; "
                        f"{results['seconds']:.0f} s)")
    table.add_column("system")
    table.add_column("accuracy ± 95% (sampling)", justify="right")
    table.add_column("per seed", justify="right")
    table.add_column("P(correct plan)", justify="right")
    table.add_column("vs its untrained start", justify="right")
    for row in results["rows"]:
        mean, ci = row["accuracy"]
        vs = row["vs_untrained"]
        table.add_row(row["system"], f"{mean:.3f} ± {ci:.3f}", ", ".join(f"{x:.3f}" for x in row["per_seed"]),
                      f"{row['plan_prob']:.3f}", f"{vs['diff']:+.3f} ± {vs['ci95']:.3f}" if vs else "")
    console.print(table)
    for name, c in results["comparisons"].items():
        console.print(f"{name}: {c['diff']:+.3f} ± {c['ci95']:.3f} (95%, evaluation sampling only): "
                      f"{'beyond' if c['beyond_sampling_noise'] else 'within'} sampling noise; "
                      f"the spread between training seeds is not in this interval (see per seed)")


def _plot(curves: dict, path: Path, n_questions: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for method, runs in curves.items():
        if not runs:
            continue
        xs = range(len(runs[0]))
        means = [statistics.fmean(c[i] for c in runs) for i in xs]
        # band: 95% sampling interval of the mean over runs x questions at each iteration
        half = [1.96 * (m * (1 - m) / (n_questions * len(runs))) ** 0.5 for m in means]
        line, = ax.plot(xs, means, marker="o", label=METHODS[method])
        ax.fill_between(xs, [m - h for m, h in zip(means, half)], [m + h for m, h in zip(means, half)], alpha=0.15,
                        color=line.get_color())
    ax.set_xlabel("iteration (0 = untrained)")
    ax.set_ylabel("held-out accuracy (server, 1 sample/question)")
    ax.set_title("marft demo: planner/solver arithmetic (95% sampling bands)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
