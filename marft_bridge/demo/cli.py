"""``marft demo``: the end-to-end run on embedded defaults."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser(
        "demo",
        help="end to end: capture -> MARFT -> hot-swap -> better agents, on embedded defaults",
        description="Build (or reuse) a warm-started tiny base model, start the embedded server, run the "
        "instrumented planner/solver LangGraph app for rollouts into the store, train MARFT from the store, "
        "publish and hot-swap the adapters, evaluate on held-out tasks (24 samples per question plus the exact "
        "probability of the correct plan), and compare MARFT-A, independent per-agent PPO, MARFT-T and "
        "single-agent PPO, each against its own untrained start. Prints a results table and writes a "
        "learning-curve PNG.",
    )
    d.add_argument("--quick", action="store_true", help="a short run (one seed, few iterations) for tests")
    d.add_argument("--seeds", type=int, default=None, help="number of seeds per method")
    d.add_argument("--iterations", type=int, default=None, help="train/publish iterations per run")
    d.add_argument("--out", default=".marft/demo", help="output directory (store, registry, results, PNG)")
    d.set_defaults(func=_demo)


def _demo(args) -> int:
    from ..demo.run import run_demo

    run_demo(out=args.out, quick=args.quick, seeds=args.seeds, iterations=args.iterations)
    return 0
