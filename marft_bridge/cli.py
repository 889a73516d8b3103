"""The ``marft`` command. Each subcommand lives next to the code it drives and registers itself
through ``add_commands(subparsers)``; heavy imports stay inside the handlers so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import MarftError

# Modules that define ``add_commands(subparsers)``; each handler is set with ``set_defaults(func=...)``.
COMMAND_MODULES = [
    "marft_bridge.store.cli",
    "marft_bridge.serving.cli",
    "marft_bridge.serving.releases_cli",
    "marft_bridge.serving.vllm.cli",
    "marft_bridge.trainers.cli",
    "marft_bridge.trainers.sft_cli",
    "marft_bridge.fitting.cli",
    "marft_bridge.service.cli",
    "marft_bridge.demo.cli",
    "marft_bridge.ui.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="marft",
        description="Capture multi-agent LLM apps as Flex-POMDP episodes, fine-tune one LoRA adapter per "
        "agent with MARFT, and hot-swap the adapters into the running application.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
    except MarftError as e:
        print(f"marft: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("marft: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
