"""``marft service``: continuous fine-tuning."""

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
    p.add_argument("--config", required=True, help="service config (YAML; see marft_bridge.service.config.ServiceConfig)")
    p.add_argument("--max-rounds", type=int, default=None, help="stop after this many polls (default: run forever)")
    p.set_defaults(func=_service)


def _service(args) -> int:
    import logging

    from rich.console import Console

    from .config import ServiceConfig
    from .loop import ContinuousService

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    svc = ContinuousService(ServiceConfig.from_yaml(args.config))
    if args.action == "status":
        Console().print_json(json.dumps(svc.status(), default=str))
        return 0
    svc.run(max_rounds=args.max_rounds)
    return 0
