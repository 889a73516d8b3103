"""One relay arm-run, this code against an earlier commit, side by side: seconds per run and whether
the exact-J curves are bit-identical.

    .venv/bin/python benchmarks/arm_run_speed.py --against 6273248 [--rounds 3] [--seeds 3]

The earlier commit is exported (``git archive``) into a temporary directory; both trees then run
``benchmarks/marft_ablation.py --arms marft_a --seeds N --seed-start 100 --hops 3 --lr 2e-3
--workers 1`` (the issue's arm-run, one thread) with this checkout's virtual environment and model
cache, alternating, ``--rounds`` times. Per seed it prints each side's fastest seconds over rounds
(the first seed of a process also pays the imports where the code does not warm them first) and
whether the J curves of every seed and round are equal value for value.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARM_RUN = ["--arms", "marft_a", "--seed-start", "100", "--hops", "3", "--lr", "2e-3", "--workers", "1"]


def export(rev: str, into: Path) -> Path:
    """The tree of ``rev`` under ``into`` (git archive: no checkout, no worktree left behind)."""
    archive = into / "tree.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", rev], stdout=f, check=True)
    tree = into / "tree"
    with tarfile.open(archive) as t:
        t.extractall(tree, filter="data")
    return tree


def arm_runs(tree: Path, seeds: int, out: Path) -> dict[int, dict]:
    """One invocation of the tree's ablation script: per seed, its seconds and J curve."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "benchmarks/marft_ablation.py", *ARM_RUN, "--seeds", str(seeds), "--out", str(out),
           "--model-cache", str(ROOT / ".marft" / "models")]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = json.loads((out / "results.json").read_text())["runs"]
    flat = [r for seed_runs in runs for r in (seed_runs if isinstance(seed_runs, list) else [seed_runs])]
    return {r["seed"]: r for r in flat if r["arm"] == "marft_a"}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, metavar="REV", help="the earlier commit (any git revision)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per invocation, from 100 (default 3)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"earlier": export(args.against, Path(tmp)), "this": ROOT}
        seconds: dict[str, dict[int, list[float]]] = {k: {} for k in trees}
        curves: dict[str, list] = {k: [] for k in trees}
        for r in range(args.rounds):
            for side, tree in trees.items():
                runs = arm_runs(tree, args.seeds, Path(tmp) / f"{side}-{r}")
                for seed, run in runs.items():
                    seconds[side].setdefault(seed, []).append(run["seconds"])
                curves[side].append({s: run["j"] for s, run in runs.items()})
                print(f"round {r + 1}/{args.rounds} {side}: " + "  ".join(
                    f"seed {s} {run['seconds']:.2f} s" for s, run in sorted(runs.items())), flush=True)
    identical = all(c == curves["this"][0] for side in curves for c in curves[side])
    print(f"\narm-run s / run, fastest of {args.rounds} rounds ({args.against} vs this checkout):")
    out = {"against": args.against, "identical_j": identical, "seeds": {}}
    for seed in sorted(seconds["this"]):
        a, b = min(seconds["earlier"][seed]), min(seconds["this"][seed])
        out["seeds"][seed] = {"earlier": a, "this": b}
        print(f"  seed {seed}: {a:.2f} s -> {b:.2f} s  ({a / b:.2f}x)")
    print(f"J curves bit-identical (every seed, every round, both sides): {identical}")
    return out


if __name__ == "__main__":
    main()
