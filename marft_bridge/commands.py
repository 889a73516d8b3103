"""``marft service`` (continuous fine-tuning) and ``marft demo`` (the end-to-end run)."""

from __future__ import annotations

import argparse
import json


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "service",
        help="continuous fine-tuning: watch the store, train, gate, publish, roll back",
        description="Watch the trace store for new rewarded episodes; when enough have arrived, train MARFT, "
        "evaluate the candidate against the live adapters, promote it only if it is not worse by more than "
        "the gate margin, publish it to the configured servers, and roll back if live rewards regress. "
        "State lives in the config's state_dir, so a restarted service resumes where it stopped.",
    )
    p.add_argument("action", nargs="?", choices=["run", "status"], default="run",
                   help="run the loop (default) or print the service's state and recent decisions")
    p.add_argument("--config", required=True, help="service config (YAML; see marft_bridge.service.ServiceConfig)")
    p.add_argument("--max-rounds", type=int, default=None, help="stop after this many polls (default: run forever)")
    p.set_defaults(func=_service)

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


def _service(args) -> int:
    import logging

    from rich.console import Console

    from .service import ContinuousService, ServiceConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    svc = ContinuousService(ServiceConfig.from_yaml(args.config))
    if args.action == "status":
        Console().print_json(json.dumps(svc.status(), default=str))
        return 0
    svc.run(max_rounds=args.max_rounds)
    return 0


def _demo(args) -> int:
    from .demo.run import run_demo

    run_demo(out=args.out, quick=args.quick, seeds=args.seeds, iterations=args.iterations)
    return 0
