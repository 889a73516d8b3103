"""What MARFT adds: four arms on the codebook relay at one sample budget, paired seeds, exact J.

The task (marft_bridge/benchmarks/relay.py): encoder -> relay(s) -> decoder pass a secret word as
symbols; each hop is warm-started on a 50/50 mix of two interlocking codes, so the untrained team
scores hops/2**hops and any consistent code scores 1.0. Episodes come from the instrumented
LangGraph graph of the agents (capture -> SQLite store -> trainer). After every update the exact
expected reward J is computed by enumeration (teacher-forced passes), so curves carry no sampling
noise. Arms: untrained, MARFT-A (dependency order, M over ancestors, clipped), independent per-agent
PPO (M = 1), one shared policy (one adapter, one group, minibatches scaled so optimiser steps per
sample match); optional MARFT-A with random order (marft_bridge/benchmarks/ablation.py).

Pre-declared analysis (fixed before any comparison was run):
- primary metric: AUC, the area under the exact-J curve over iterations 0..T (trapezoid, divided
  by T, so it is a mean J in [0, 1]);
- secondary: final J (J_T); reach rate, the fraction of seeds with max_t J_t >= 0.95; collapse
  rate, the fraction of seeds where J fell more than 0.1 below its running maximum;
- comparisons: MARFT-A - independent, MARFT-A - shared, independent - shared, as paired
  differences over seeds (common random numbers: same warm start, same secrets, same sampler
  streams per seed); two-sided paired t, Holm-corrected over the three comparisons per metric;
  intervals are drawn at the Holm step's level (95% for the last step), 95% intervals also given;
- hyperparameters: everything in ablation.COMMON is shared and fixed; the learning rate is chosen
  per arm by ``--tune`` (grid LR_GRID, tuning seeds 1000-1001, criterion mean AUC), written to
  ``--hparams`` and frozen; the evaluation seeds are ``--seed-start`` .. + N-1 and never used for
  tuning.

    .venv/bin/python benchmarks/marft_ablation.py --tune --hops 3            # once: freeze lrs
    .venv/bin/python benchmarks/marft_ablation.py --seeds 20 --hops 3        # table + PNG
    .venv/bin/python benchmarks/marft_ablation.py --quick                     # seconds, for tests
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

LR_GRID = [2e-3, 3e-3, 5e-3]
TUNING_SEEDS = [1000, 1001]
PAIRS = [("marft_a", "independent"), ("marft_a", "shared"), ("independent", "shared")]
HPARAMS = Path(__file__).with_name("marft_ablation_hparams.json")


def parse_args(argv=None):
    from marft_bridge.benchmarks.ablation import ARMS, DEFAULT_ARMS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=10, help="number of evaluation seeds (default 10)")
    p.add_argument("--seed-start", type=int, default=0, help="first evaluation seed (default 0)")
    p.add_argument("--hops", type=int, default=3, choices=[2, 3, 4])
    p.add_argument("--same-alphabet", action="store_true", help="every intermediate symbol is a digit")
    p.add_argument("--iterations", type=int, default=12, help="updates per run (default 12)")
    p.add_argument("--episodes", type=int, default=32, help="episodes per iteration (default 32)")
    p.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS))
    p.add_argument("--workers", type=int, default=2, help="seeds run in parallel processes (default 2)")
    p.add_argument("--out", default=".marft/ablation", help="results.json, ablation.png, traces")
    p.add_argument("--model-cache", default=".marft/models", help="where warm-started models are cached")
    p.add_argument("--hparams", default=str(HPARAMS), help="frozen per-arm learning rates (from --tune)")
    p.add_argument("--lr", type=float, default=None, help="one learning rate for every arm (overrides --hparams)")
    p.add_argument("--tune", action="store_true", help=f"choose each arm's lr from {LR_GRID} on seeds "
                   f"{TUNING_SEEDS} by mean AUC and write --hparams")
    p.add_argument("--from-runs", default=None, metavar="JSONL",
                   help="only analyse the seeds already in this runs.jsonl (of an interrupted run)")
    p.add_argument("--quick", action="store_true", help="2 hops, 2 seeds, 2 iterations of 8 episodes, short warm start")
    return p.parse_args(argv)


def _worker(job):
    import torch

    torch.set_num_threads(1)
    from marft_bridge.benchmarks.ablation import RunSettings, run_seed
    from marft_bridge.benchmarks.relay import RelaySpec

    spec, base, arms, lrs, seed, settings, workdir = job
    return run_seed(RelaySpec(**spec), base, arms, lrs, seed, RunSettings(**settings), workdir)


def run_seeds(spec, base, arms, lrs, seeds, settings, workdir, workers, log_path: Path | None = None):
    """Every seed's runs (a list per seed); each seed is appended to ``log_path`` (JSON lines) as it
    finishes, so an interrupted run can still be analysed (``--from-runs``)."""
    jobs = [(spec.model_dump(), str(base), arms, lrs, s, settings.model_dump(), str(workdir)) for s in seeds]
    done = []

    def keep(runs):
        done.append(runs)
        if log_path is not None:
            with open(log_path, "a") as f:
                f.write(json.dumps(runs) + "\n")

    if workers <= 1 or len(jobs) == 1:
        for j in jobs:
            keep(_worker(j))
        return done
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        for runs in pool.imap_unordered(_worker, jobs, chunksize=1):
            keep(runs)
    return done


def hparams_key(spec) -> str:
    return f"hops={spec.hops},same_alphabet={spec.same_alphabet}"


def tune(spec, base, arms, settings, workdir, workers, path: Path) -> dict:
    trained = [a for a in arms if a != "untrained"]
    scores = {a: {} for a in trained}
    for lr in LR_GRID:
        per_seed = run_seeds(spec, base, trained, {a: lr for a in trained}, TUNING_SEEDS, settings, workdir, workers)
        from marft_bridge.benchmarks.stats import auc

        for runs in per_seed:
            for r in runs:
                scores[r["arm"]].setdefault(str(lr), []).append(auc(r["j"]))
    chosen = {a: float(max(s, key=lambda lr: statistics.fmean(s[lr]))) for a, s in scores.items()}
    table = json.loads(path.read_text()) if path.exists() else {}
    table[hparams_key(spec)] = {"lr": chosen, "grid": LR_GRID, "tuning_seeds": TUNING_SEEDS, "criterion": "mean AUC",
                                "mean_auc": {a: {lr: statistics.fmean(v) for lr, v in s.items()} for a, s in scores.items()},
                                "settings": settings.model_dump()}
    path.write_text(json.dumps(table, indent=2) + "\n")
    return table[hparams_key(spec)]


def analyse(results: list[list[dict]], arms: list[str]) -> dict:
    from marft_bridge.benchmarks import stats

    by_arm = {a: [] for a in arms}
    for runs in sorted(results, key=lambda rs: rs[0]["seed"]):
        for r in runs:
            by_arm[r["arm"]].append(r)
    metrics = {a: [stats.summary(r["j"]) for r in rs] for a, rs in by_arm.items()}
    table = {}
    for a in arms:
        ms = metrics[a]
        n = len(ms)
        table[a] = {"auc": stats.mean_interval([m["auc"] for m in ms]),
                    "final": stats.mean_interval([m["final"] for m in ms]),
                    "reach": stats.wilson(int(sum(m["reached"] for m in ms)), n),
                    "collapse": stats.wilson(int(sum(m["collapsed"] for m in ms)), n),
                    "optimizer_steps": statistics.fmean(r["optimizer_steps"] for r in by_arm[a]),
                    "seconds": statistics.fmean(r["seconds"] for r in by_arm[a])}
    pairs = [(a, b) for a, b in PAIRS if a in arms and b in arms]
    comparisons = {m: stats.paired_comparisons({a: [x[m] for x in metrics[a]] for a in arms}, pairs)
                   for m in ("auc", "final")} if pairs else {}
    curves = {a: [r["j"] for r in rs] for a, rs in by_arm.items()}
    return {"table": table, "comparisons": comparisons, "curves": curves}


def _ci(d: dict, pct: bool = False) -> str:
    if math.isnan(d.get("lo", math.nan)):
        return f"{d['mean']:.3f}"
    if pct:
        return f"{d['mean']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}]"
    return f"{d['mean']:.3f} [{d['lo']:.3f}, {d['hi']:.3f}]"


def print_table(analysis: dict, arms: list[str], n: int, seconds: float, command: str) -> str:
    from marft_bridge.benchmarks.ablation import ARMS

    lines = [f"codebook relay, {n} paired seeds; mean [95% interval]; {command}; {seconds:.0f} s wall", "",
             "| arm | AUC (primary) | final J | reach rate (J >= 0.95) | collapse rate | optimiser steps | s / run |",
             "|---|---|---|---|---|---|---|"]
    for a in arms:
        t = analysis["table"][a]
        lines.append(f"| {ARMS[a]} | {_ci(t['auc'])} | {_ci(t['final'])} | {_ci(t['reach'], True)} | "
                     f"{_ci(t['collapse'], True)} | {t['optimizer_steps']:.0f} | {t['seconds']:.1f} |")
    for metric, comps in analysis["comparisons"].items():
        lines += ["", f"| paired difference, {metric} | mean | Holm-step interval | 95% interval | p (Holm) | significant |",
                  "|---|---|---|---|---|---|"]
        for name, c in comps.items():
            lines.append(f"| {name} | {c['mean']:+.3f} | [{c['lo']:+.3f}, {c['hi']:+.3f}] ({c['level']:.1%}) | "
                         f"[{c['lo95']:+.3f}, {c['hi95']:+.3f}] | {c['p_holm']:.3g} | {'yes' if c['significant'] else 'no'} |")
    text = "\n".join(lines)
    print(text)
    return text


def plot(analysis: dict, arms: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from marft_bridge.benchmarks import stats
    from marft_bridge.benchmarks.ablation import ARMS

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a in arms:
        curves = analysis["curves"][a]
        xs = list(range(len(curves[0])))
        cis = [stats.mean_interval([c[i] for c in curves]) for i in xs]
        means = [c["mean"] for c in cis]
        line, = ax.plot(xs, means, marker="o", ms=3, label=ARMS[a])
        if len(curves) > 1 and a != "untrained":
            ax.fill_between(xs, [c["lo"] for c in cis], [c["hi"] for c in cis], alpha=0.2, color=line.get_color())
    ax.axhline(stats.REACH, ls=":", color="grey", lw=1)
    ax.set_xlabel("iteration (update)")
    ax.set_ylabel("exact expected reward J")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def frozen_lrs(args, spec, trained: list[str]) -> dict[str, float]:
    """``--lr`` for every arm, or the learning rates ``--tune`` froze for this task variant."""
    if args.lr is not None or args.quick:
        return {a: args.lr or 3e-3 for a in trained}
    table = json.loads(Path(args.hparams).read_text()) if Path(args.hparams).exists() else {}
    frozen = table.get(hparams_key(spec), {}).get("lr", {})
    missing = [a for a in trained if a not in frozen]
    if missing:
        sys.exit(f"no frozen lr for {missing} at {hparams_key(spec)} in {args.hparams}: run --tune first or pass --lr")
    return {a: frozen[a] for a in trained}


def main(argv=None) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = parse_args(argv)
    import logging

    from transformers.utils import logging as hf_logging

    from marft_bridge.benchmarks.ablation import RunSettings
    from marft_bridge.benchmarks.relay import RelaySpec, WarmStartConfig, warm_start

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("marft_bridge.trainers").setLevel(logging.WARNING)
    if args.quick:
        args.hops, args.seeds, args.iterations, args.episodes = 2, 2, 2, 8
    started = time.perf_counter()
    spec = RelaySpec(hops=args.hops, same_alphabet=args.same_alphabet)
    trained = [a for a in args.arms if a != "untrained"]
    lrs = None if args.tune else frozen_lrs(args, spec, trained)
    ws = WarmStartConfig(steps=100) if args.quick else WarmStartConfig()
    base = warm_start(spec, args.model_cache, ws)
    settings = RunSettings(iterations=args.iterations, episodes=args.episodes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = out / "traces"
    workdir.mkdir(exist_ok=True)
    if not args.from_runs:
        for old in workdir.glob("traces-s*.db*"):
            old.unlink()
    if args.tune:
        chosen = tune(spec, base, args.arms, settings, workdir, args.workers, Path(args.hparams))
        print(json.dumps(chosen, indent=2))
        return chosen
    if args.from_runs:
        results = [json.loads(line) for line in Path(args.from_runs).read_text().splitlines() if line.strip()]
        args.seeds = len(results)
        seeds = sorted(runs[0]["seed"] for runs in results)
    else:
        seeds = list(range(args.seed_start, args.seed_start + args.seeds))
        (out / "runs.jsonl").unlink(missing_ok=True)
        results = run_seeds(spec, base, args.arms, lrs, seeds, settings, workdir, args.workers, out / "runs.jsonl")
    analysis = analyse(results, args.arms)
    seconds = time.perf_counter() - started
    command = "benchmarks/marft_ablation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = print_table(analysis, args.arms, args.seeds, seconds, command)
    title = f"codebook relay, {args.hops} hops: mean exact J, 95% band ({args.seeds} seeds)"
    plot(analysis, args.arms, out / "ablation.png", title)
    report = {"spec": spec.model_dump(), "warm_start": ws.model_dump(), "settings": settings.model_dump(),
              "lrs": lrs, "seeds": seeds, "seconds": seconds, "command": command,
              "table_text": text, **analysis, "runs": results}
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"results in {out / 'results.json'}, curves in {out / 'ablation.png'}")
    return report


if __name__ == "__main__":
    main()
