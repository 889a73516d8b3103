"""What MARFT adds: six arms on the codebook relay at one episode budget, paired seeds, exact J.

The task (marft_bridge/benchmarks/relay.py): encoder -> relay(s) -> decoder pass a secret word as
symbols; each hop is warm-started on a mix of two interlocking codes (``--warm-start even``: 50/50,
the untrained team scores hops/2**hops; ``miscoordinated``: upstream 70% code A, decoder 70% code B)
and any consistent code scores 1.0. Episodes come from the instrumented LangGraph graph of the
agents (capture -> SQLite store -> trainer). After every update the exact expected reward J is
computed by enumeration (teacher-forced passes), so curves carry no sampling noise. Arms
(marft_bridge/benchmarks/ablation.py): untrained, MARFT-A (dependency order, M over ancestors in D,
clipped), independent per-agent PPO (M = 1), one shared policy, HAPPO (random order, M over the
round, unclipped), MARFT-A with fresh rollouts between agents' updates; and, critic-free, beside
them (``--arms``; not in the default six): ``grpo`` (group advantages, independent agents),
``grpo_happo`` (group advantages, HAPPO's random order and M over the round), ``reward_happo``
(the return as advantage, no normalisation, HAPPO's order and M) and ``expert_iteration`` (SFT on
each iteration's successful rollouts, no policy gradient). A group is one secret's rollouts:
the group arms draw ``--group-size`` rollouts of each of episodes / group-size words (32 = 8 x 4);
``--secrets grouped`` gives every arm those secrets (common random numbers for comparing them).
Every arm gets the same episodes per iteration; the table reports each arm's optimiser steps and
episodes consumed.

Regimes. small-step (default): 2 PPO epochs x 1 minibatch, unmasked sampling. large-step
(``--masked --warm-start miscoordinated --epochs 4 --minibatches 2 --target-kl 0.1``): every agent
samples among its alphabet's tokens and EOS (``allowed_token_ids``, masked identically in every
log-prob), so a large step cannot leak mass onto invalid symbols.

Pre-declared headline protocol (fixed before any comparison of it was run; ``--lr-grid``):
- arms: every arm of ``--arms`` (default all six); metric: AUC, the area under the exact-J curve
  over iterations 0..T (trapezoid, divided by T: a mean J in [0, 1]); secondary: final J, reach
  rate (max_t J_t >= 0.95), collapse rate (J fell > 0.1 below its running maximum);
- learning rate: every arm runs at every rate of ``--lr-grid`` on the tuning seeds 1000 ..
  1000 + ``--tuning-seeds`` - 1 (>= 8; paired); each arm's lr-response table (AUC and final J per lr,
  95% intervals) and the paired differences at each common lr are printed; the headline lr of an
  arm is the grid rate with the highest mean tuning AUC (its selection noise, the standard error of
  the paired AUC difference between the chosen rate and the runner-up, is printed);
- evaluation: the seeds ``--seed-start`` .. + ``--seeds`` - 1 (>= 40 for a headline; disjoint from
  the tuning seeds), each arm at its chosen lr; comparisons PAIRS as paired differences, two-sided
  paired t, Holm-corrected over the comparisons present per metric; 95% intervals also given;
- grids, decided before the comparison: small-step 1e-3 2e-3 3e-3 5e-3; large-step 1e-4 3e-4 1e-3
  3e-3 (an Adam step x 8 optimiser steps per iteration already moves a code probability by > 1/6
  at 1e-3, and the lost first run's 3e-3 floor declined in every arm).

    .venv/bin/python benchmarks/marft_ablation.py --lr 2e-3 --seeds 40 --seed-start 100 --hops 3
    .venv/bin/python benchmarks/marft_ablation.py --lr-grid 1e-3 2e-3 3e-3 5e-3 --seeds 40 --seed-start 100
    .venv/bin/python benchmarks/marft_ablation.py --lr-grid 1e-4 3e-4 1e-3 3e-3 --masked \\
        --warm-start miscoordinated --epochs 4 --minibatches 2 --target-kl 0.1 --seeds 40 --seed-start 100
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

TUNING_SEED_START = 1000
PAIRS = [("marft_a", "independent"), ("marft_a", "shared"), ("independent", "shared"),
         ("happo", "independent"), ("happo", "marft_a"), ("marft_a_rerollout", "marft_a"),
         # the group arms (issue 33): estimator at fixed order/M, the critic, and M under GRPO
         ("grpo", "independent"), ("grpo_happo", "happo"), ("reward_happo", "happo"), ("grpo_happo", "grpo"),
         # expert iteration (issue 36): SFT on successes against the group estimator and per-agent PPO
         ("expert_iteration", "grpo"), ("expert_iteration", "independent")]



def p_text(p: float) -> str:
    """A p-value as printed: one below what a double holds reads "< 1e-300", not 0."""
    return "< 1e-300" if p < 1e-300 else f"{p:.3g}"

def _clip(text: str) -> float | None:
    return None if text.lower() in ("null", "none") else float(text)


def parse_args(argv=None):
    from marft_bridge.benchmarks.ablation import ARMS, DEFAULT_ARMS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=10, help="number of evaluation seeds (default 10; >= 40 for a headline)")
    p.add_argument("--seed-start", type=int, default=0, help="first evaluation seed (default 0)")
    p.add_argument("--hops", type=int, default=3, choices=[2, 3, 4], help="agents in the chain (default 3)")
    p.add_argument("--same-alphabet", action="store_true", help="every intermediate symbol is a digit")
    p.add_argument("--iterations", type=int, default=12, help="updates per run (default 12)")
    p.add_argument("--episodes", type=int, default=32, help="episodes per iteration, every arm (default 32)")
    p.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS), help="arms to run (default all)")
    p.add_argument("--workers", type=int, default=2, help="seeds run in parallel processes (default 2)")
    p.add_argument("--out", default=".marft/ablation", help="results.json, ablation.png, runs.jsonl, traces")
    p.add_argument("--model-cache", default=".marft/models", help="where warm-started models are cached")
    p.add_argument("--lr", type=float, default=None, help="one learning rate for every arm (no tuning)")
    p.add_argument("--lr-grid", type=float, nargs="+", default=None, metavar="LR",
                   help="run every arm at every rate on the tuning seeds, print the lr-response tables, then "
                   "evaluate each arm at its best tuning rate (the pre-declared protocol above)")
    p.add_argument("--tuning-seeds", type=int, default=8, help="tuning seeds 1000.. for --lr-grid (default 8)")
    p.add_argument("--warm-start", choices=["even", "miscoordinated"], default="even",
                   help="even: every hop 50/50 code A/B; miscoordinated: upstream 70%% A, decoder 70%% B")
    p.add_argument("--masked", action="store_true",
                   help="agents sample among their alphabet's tokens and EOS (allowed_token_ids); every log-prob masked alike")
    p.add_argument("--epochs", type=int, default=None, help="PPO epochs per update (default 2)")
    p.add_argument("--minibatches", type=int, default=None, help="minibatches per epoch and agent (default 1)")
    p.add_argument("--target-kl", type=float, default=None,
                   help="stop an agent's epochs once its approx-KL exceeds this (default off; logged)")
    p.add_argument("--factor-clip", type=_clip, default=0.2, metavar="EPS|null",
                   help="MARFT-A's clip of M to [(1-eps)^n, (1+eps)^n] (default 0.2; null: unclipped)")
    p.add_argument("--secrets", choices=["auto", "grouped", "random"], default="auto",
                   help="auto (default): the group arms (grpo, grpo_happo, reward_happo, expert_iteration) play grouped secrets, the "
                   "others independent draws as before; grouped: every arm plays grouped secrets (paired with the "
                   "group arms); random: every arm independent draws (group sizes then vary)")
    p.add_argument("--group-size", type=int, default=4, metavar="G",
                   help="grouped secrets: rollouts per secret word, episodes / G distinct words (default 4)")
    p.add_argument("--from-runs", default=None, metavar="JSONL",
                   help="only analyse the seeds already in this runs.jsonl (of an interrupted run)")
    p.add_argument("--compare-with", nargs="+", default=[], metavar="LABEL=JSONL",
                   help="with --from-runs: the runs.jsonl of another invocation on the same seeds (e.g. another "
                   "--factor-clip) joins as arms ARM@LABEL, each paired with this run's ARM (Holm over all pairs)")
    p.add_argument("--from-tuning", default=None, metavar="JSONL",
                   help="with --from-runs: the lr grid from this tuning_runs.jsonl (the rates complete on every arm)")
    p.add_argument("--tuning-only", action="store_true",
                   help="with --lr-grid: stop after the tuning seeds (lr-response tables, chosen rates, "
                   "tuning_runs.jsonl, results.json); evaluate later with --from-tuning")
    p.add_argument("--quick", action="store_true",
                   help="2 hops, 2 seeds (2 tuning seeds), 2 iterations of 8 episodes, short warm start: for tests")
    args = p.parse_args(argv)
    if args.lr is not None and args.lr_grid:
        p.error("--lr and --lr-grid exclude each other")
    if args.tuning_only and not args.lr_grid:
        p.error("--tuning-only needs --lr-grid")
    if args.compare_with and not args.from_runs:
        p.error("--compare-with needs --from-runs (it analyses finished runs)")
    if any("=" not in c for c in args.compare_with):
        p.error("--compare-with takes LABEL=JSONL")
    return args


_WARM = False


def _worker(job):
    import torch

    torch.set_num_threads(1)
    from marft_bridge.benchmarks.ablation import RunSettings, run_seed, warm_imports
    from marft_bridge.benchmarks.relay import RelaySpec

    global _WARM
    spec, base, arms, lrs, seed, settings, workdir = job
    if not _WARM:  # once per process: the runs' "s / run" leaves the start-up out
        print(f"worker {os.getpid()}: imports {warm_imports(base):.1f} s (once per process, not in s / run)",
              file=sys.stderr, flush=True)
        _WARM = True
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


def settings_of(args):
    from marft_bridge.benchmarks.ablation import RunSettings

    regime = {k: v for k, v in (("epochs", args.epochs), ("minibatches", args.minibatches)) if v is not None}
    return RunSettings(iterations=args.iterations, episodes=args.episodes, target_kl=args.target_kl,
                       masked=args.masked, factor_clip=args.factor_clip, secrets=args.secrets,
                       group_size=args.group_size, **regime)


def lr_grid(spec, base, arms, grid, seeds, settings, workdir, workers, log_path: Path | None = None) -> dict:
    """Every trained arm at every rate on ``seeds`` (paired), then ``grid_analysis`` of the runs."""
    trained = [a for a in arms if a != "untrained"]
    results = []
    for lr in grid:
        results += run_seeds(spec, base, trained, {a: lr for a in trained}, seeds, settings, workdir, workers, log_path)
    return grid_analysis(results, trained)


def grid_analysis(results: list[list[dict]], trained: list[str]) -> dict:
    """From each (seed, lr)'s runs: per arm and lr the AUC / final J over the seeds (the lr-response
    tables), the paired differences at each common lr, each arm's chosen rate (best mean AUC) and its
    selection noise. Only rates every arm ran on the same seeds count (an interrupted grid: the rates done)."""
    from marft_bridge.benchmarks import stats

    per: dict[str, dict[str, dict[int, dict]]] = {a: {} for a in trained}  # arm -> lr -> seed -> summary
    for seed_runs in results:
        for r in seed_runs:
            if r["arm"] in per:
                per[r["arm"]].setdefault(str(r["lr"]), {})[r["seed"]] = stats.summary(r["j"])
    lrs = sorted({lr for a in trained for lr in per[a]}, key=float)
    seed_sets = {lr: {frozenset(per[a].get(lr, {})) for a in trained} for lr in lrs}
    seeds = sorted(max((next(iter(v)) for v in seed_sets.values() if len(v) == 1), key=len, default=frozenset()))
    grid = [lr for lr in lrs if seed_sets[lr] == {frozenset(seeds)}]
    col = {a: {lr: [per[a][lr][s] for s in seeds] for lr in grid} for a in trained}  # paired, seed order
    response = {a: {lr: {"auc": stats.mean_interval([m["auc"] for m in ms]),
                         "final": stats.mean_interval([m["final"] for m in ms])} for lr, ms in by_lr.items()}
                for a, by_lr in col.items()}
    chosen, noise = {}, {}
    for a, by_lr in col.items():
        ranked = sorted(by_lr, key=lambda lr: -statistics.fmean(m["auc"] for m in by_lr[lr]))
        if not ranked:
            continue
        chosen[a] = float(ranked[0])
        if len(ranked) > 1:  # SE of the paired AUC difference best - runner-up: how sure the choice is
            d = [x["auc"] - y["auc"] for x, y in zip(by_lr[ranked[0]], by_lr[ranked[1]])]
            noise[a] = {"runner_up": float(ranked[1]), "diff": statistics.fmean(d),
                        "se": statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan}
    pairs = [(a, b) for a, b in PAIRS if a in trained and b in trained]
    at_lr = {lr: stats.paired_comparisons({a: [m["auc"] for m in col[a][lr]] for a in trained}, pairs)
             for lr in grid} if pairs else {}
    return {"seeds": seeds, "grid": [float(lr) for lr in grid], "response": response, "chosen": chosen,
            "selection_noise": noise, "paired_at_lr": at_lr}


def print_grid(g: dict) -> str:
    from marft_bridge.benchmarks.ablation import ARMS

    lines = [f"lr-response on tuning seeds {g['seeds'][0]}..{g['seeds'][-1]} ({len(g['seeds'])} paired); "
             "mean [95% interval]", "", "| arm | lr | AUC | final J |", "|---|---|---|---|"]
    for a, by_lr in g["response"].items():
        for lr, r in by_lr.items():
            mark = " (chosen)" if float(lr) == g["chosen"][a] else ""
            lines.append(f"| {ARMS[a]} | {float(lr):g}{mark} | {_ci(r['auc'])} | {_ci(r['final'])} |")
    lines += ["", "| arm | chosen lr | runner-up | AUC lead | its SE (selection noise) |", "|---|---|---|---|---|"]
    for a, n in g["selection_noise"].items():
        lines.append(f"| {ARMS[a]} | {g['chosen'][a]:g} | {n['runner_up']:g} | {n['diff']:+.3f} | {n['se']:.3f} |")
    for lr, comps in g["paired_at_lr"].items():
        lines += ["", f"| paired AUC difference at lr {float(lr):g} | mean | 95% interval | p (Holm) |", "|---|---|---|---|"]
        for name, c in comps.items():
            lines.append(f"| {name} | {c['mean']:+.3f} | [{c['lo95']:+.3f}, {c['hi95']:+.3f}] | {p_text(c['p_holm'])} |")
    text = "\n".join(lines)
    print(text)
    return text


def read_runs(path: str | Path) -> list[list[dict]]:
    """A runs.jsonl / tuning_runs.jsonl: one list of runs per (seed, lr) line."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def arm_name(arm: str) -> str:
    """An arm's table name; ``ARM@LABEL`` (``--compare-with``) is ARM's name with the label."""
    from marft_bridge.benchmarks.ablation import ARMS

    base, _, label = arm.partition("@")
    return f"{ARMS[base]} ({label})" if label else ARMS[base]


def compare_with(results: list[list[dict]], specs: list[str], arms: list[str]) -> tuple[list[list[dict]], list[str]]:
    """Add each LABEL=JSONL's runs of the trained ``arms`` to the seeds they share with ``results`` as
    arms ARM@LABEL (other seeds are left out, so every comparison stays paired); the new arm names."""
    runs_of = {rs[0]["seed"]: rs for rs in results}
    added: list[str] = []
    for spec in specs:
        label, _, path = spec.partition("=")
        other = {rs[0]["seed"]: rs for rs in read_runs(path)}
        keep = sorted(set(runs_of) & set(other))
        if not keep:
            sys.exit(f"--compare-with {spec}: no seed in common with --from-runs")
        mine = [a for a in arms if a != "untrained"]
        runs_of = {s: runs_of[s] + [{**r, "arm": f"{r['arm']}@{label}"} for r in other[s] if r["arm"] in mine]
                   for s in keep}
        added += [f"{a}@{label}" for a in mine if any(r["arm"] == a for s in keep for r in other[s])]
    return [runs_of[s] for s in sorted(runs_of)], added


def analyse(results: list[list[dict]], arms: list[str]) -> dict:
    from marft_bridge.benchmarks import stats

    by_arm = {a: [] for a in arms}
    for runs in sorted(results, key=lambda rs: rs[0]["seed"]):
        for r in runs:
            if r["arm"] in by_arm:  # --from-runs with --arms: the arms asked for
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
                    "episodes": statistics.fmean(r["episodes"] for r in by_arm[a]),
                    "seconds": statistics.fmean(r["seconds"] for r in by_arm[a])}
    pairs = [(a, b) for a, b in PAIRS if a in arms and b in arms]
    pairs += [(a, a.partition("@")[0]) for a in arms if "@" in a and a.partition("@")[0] in arms]
    comparisons = {m: stats.paired_comparisons({a: [x[m] for x in metrics[a]] for a in arms}, pairs)
                   for m in ("auc", "final")} if pairs else {}
    curves = {a: [r["j"] for r in rs] for a, rs in by_arm.items()}
    diagnostics = {a: diagnostics_of(rs) for a, rs in by_arm.items() if a != "untrained" and rs}
    return {"table": table, "comparisons": comparisons, "curves": curves, "diagnostics": diagnostics}


def diagnostics_of(runs: list[dict]) -> dict:
    """Over an arm's runs: the valid-symbol mass per hop after the last update (mean), the fraction of
    agent updates ``target_kl`` stopped early, and the mean fraction of M factors the clip bound."""
    hops = len(runs[0]["valid_mass"][-1])
    updates = [u for r in runs for d in r["diagnostics"] for u in d]
    agent_updates = sum(len(u.get("per_agent", {})) for u in updates)  # expert iteration: no PPO updates
    m_clip = [p["m_clipfrac"] for u in updates for p in u.get("per_agent", {}).values() if "m_clipfrac" in p]
    return {"valid_mass": [statistics.fmean(r["valid_mass"][-1][h] for r in runs) for h in range(hops)],
            "early_stopped": sum(len(u.get("early_stops", [])) for u in updates) / max(agent_updates, 1),
            "m_clipfrac": statistics.fmean(m_clip) if m_clip else 0.0}


def _ci(d: dict, pct: bool = False) -> str:
    if math.isnan(d.get("lo", math.nan)):
        return f"{d['mean']:.3f}"
    if pct:
        return f"{d['mean']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}]"
    return f"{d['mean']:.3f} [{d['lo']:.3f}, {d['hi']:.3f}]"


def print_table(analysis: dict, arms: list[str], n: int, seconds: float, command: str, lrs=None) -> str:
    lines = [f"codebook relay, {n} paired seeds; mean [95% interval]; {command}; {seconds:.0f} s wall", "",
             "| arm | lr | AUC (primary) | final J | reach rate (J >= 0.95) | collapse rate | optimiser steps "
             "| episodes | s / run |", "|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        t = analysis["table"][a]
        lr = "-" if lrs is None or a not in lrs else f"{lrs[a]:g}"
        lines.append(f"| {arm_name(a)} | {lr} | {_ci(t['auc'])} | {_ci(t['final'])} | {_ci(t['reach'], True)} | "
                     f"{_ci(t['collapse'], True)} | {t['optimizer_steps']:.0f} | {t['episodes']:.0f} | {t['seconds']:.1f} |")
    lines += ["", "| arm | valid-symbol mass per hop, final | agent updates stopped by target_kl | M factors clipped |",
              "|---|---|---|---|"]
    for a, d in analysis["diagnostics"].items():
        mass = " / ".join(f"{m:.3f}" for m in d["valid_mass"])
        lines.append(f"| {arm_name(a)} | {mass} | {d['early_stopped']:.2f} | {d['m_clipfrac']:.2f} |")
    for metric, comps in analysis["comparisons"].items():
        lines += ["", f"| paired difference, {metric} | mean | Holm-step interval | 95% interval | p (Holm) | significant |",
                  "|---|---|---|---|---|---|"]
        for name, c in comps.items():
            lines.append(f"| {name} | {c['mean']:+.3f} | [{c['lo']:+.3f}, {c['hi']:+.3f}] ({c['level']:.1%}) | "
                         f"[{c['lo95']:+.3f}, {c['hi95']:+.3f}] | {p_text(c['p_holm'])} | {'yes' if c['significant'] else 'no'} |")
    text = "\n".join(lines)
    print(text)
    return text


def plot(analysis: dict, arms: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from marft_bridge.benchmarks import stats

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a in arms:
        curves = analysis["curves"][a]
        xs = list(range(len(curves[0])))
        cis = [stats.mean_interval([c[i] for c in curves]) for i in xs]
        means = [c["mean"] for c in cis]
        line, = ax.plot(xs, means, marker="o", ms=3, label=arm_name(a))
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


def main(argv=None) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = parse_args(argv)
    import logging

    from transformers.utils import logging as hf_logging

    from marft_bridge.benchmarks.relay import RelaySpec, WarmStartConfig, warm_start

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("marft_bridge.trainers").setLevel(logging.ERROR)
    if args.quick:
        args.hops, args.seeds, args.iterations, args.episodes, args.tuning_seeds = 2, 2, 2, 8, 2
    if args.lr is None and not args.lr_grid:
        if not args.quick:
            sys.exit("pass --lr (one rate for every arm) or --lr-grid (tune on the tuning seeds, then evaluate)")
        args.lr = 3e-3
    started = time.perf_counter()
    spec = RelaySpec(hops=args.hops, same_alphabet=args.same_alphabet)
    trained = [a for a in args.arms if a != "untrained"]
    ws = WarmStartConfig(steps=100, mix=args.warm_start) if args.quick else WarmStartConfig(mix=args.warm_start)
    base = warm_start(spec, args.model_cache, ws)
    settings = settings_of(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = out / "traces"
    workdir.mkdir(exist_ok=True)
    if not args.from_runs:
        for old in workdir.glob("traces-s*.db*"):
            old.unlink()
    seeds = list(range(args.seed_start, args.seed_start + args.seeds))
    tuning = list(range(TUNING_SEED_START, TUNING_SEED_START + args.tuning_seeds))
    grid, grid_text = None, ""
    if args.lr_grid:
        if set(seeds) & set(tuning):
            sys.exit(f"evaluation seeds {seeds[0]}..{seeds[-1]} overlap the tuning seeds {tuning[0]}..{tuning[-1]}")
        if args.from_tuning:
            grid = grid_analysis(read_runs(args.from_tuning), trained)
        else:
            (out / "tuning_runs.jsonl").unlink(missing_ok=True)
            grid = lr_grid(spec, base, args.arms, args.lr_grid, tuning, settings, workdir, args.workers,
                           out / "tuning_runs.jsonl")
        grid_text = print_grid(grid)
        lrs = grid["chosen"]
        if args.tuning_only:  # no evaluation: a headline needs its >= 40 evaluation seeds, run later
            return _save(out, {"spec": spec.model_dump(), "warm_start": ws.model_dump(), "lrs": lrs,
                               "settings": settings.model_dump(), "lr_grid": grid, "table_text": grid_text})
    else:
        lrs = {a: args.lr for a in trained}
    if args.from_runs:
        results = read_runs(args.from_runs)
        if args.compare_with:
            results, added = compare_with(results, args.compare_with, args.arms)
            args.arms = args.arms + added
            lrs = {**lrs, **{r["arm"]: r["lr"] for r in results[0] if r["arm"] in added}}
        args.seeds = len(results)
        seeds = sorted(runs[0]["seed"] for runs in results)
    else:
        (out / "runs.jsonl").unlink(missing_ok=True)
        results = run_seeds(spec, base, args.arms, lrs, seeds, settings, workdir, args.workers, out / "runs.jsonl")
    analysis = analyse(results, args.arms)
    seconds = time.perf_counter() - started
    command = "benchmarks/marft_ablation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = print_table(analysis, args.arms, args.seeds, seconds, command, lrs)
    title = f"codebook relay, {args.hops} hops: mean exact J, 95% band ({args.seeds} seeds)"
    plot(analysis, args.arms, out / "ablation.png", title)
    report = {"spec": spec.model_dump(), "warm_start": ws.model_dump(), "settings": settings.model_dump(),
              "lrs": lrs, "seeds": seeds, "seconds": seconds, "command": command, "lr_grid": grid,
              "table_text": grid_text + "\n\n" + text, **analysis, "runs": results}
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"results in {out / 'results.json'}, curves in {out / 'ablation.png'}")
    return report


def _save(out: Path, report: dict) -> dict:
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"results in {out / 'results.json'}")
    return report


if __name__ == "__main__":
    main()
