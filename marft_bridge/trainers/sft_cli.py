"""``marft sft``: supervised fine-tuning of one LoRA adapter per agent from captured traces
(distillation from a hosted model, cold start before ``marft train`` / ``fit`` / ``service``)."""

from __future__ import annotations

import argparse

EPILOG = """\
The adapter of an action is its agent's (a path like supervisor/agent becomes supervisor.agent), or the
model name the call sent when marft serve / the registry served it (a recorded adapter version).
Next: marft adapters publish --registry REG <agent> OUT/adapters/<agent> --promote;
marft train|fit ... --init-adapters OUT/adapters; marft plot OUT/metrics.jsonl --keys <agent>/val_loss,...
"""


def add_commands(sub) -> None:
    p = sub.add_parser(
        "sft",
        help="fine-tune one LoRA adapter per agent on its recorded actions (distil a hosted model)",
        description="Supervised fine-tuning from traces: one LoRA adapter per agent on one base model, each "
        "trained only on its agent's llm actions, rendered exactly as `marft train` renders them (chat "
        "template with the tools offered; loss on the action's tokens only). Writes OUT/adapters/<agent>/ "
        "(peft, safetensors), OUT/metrics.jsonl (per agent and epoch: train/val loss and token accuracy) "
        "and OUT/checkpoint/ (kill-safe --resume).",
        epilog=EPILOG,
        formatter_class=lambda prog: argparse.ArgumentDefaultsHelpFormatter(prog, width=100),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--store", metavar="URL", help="trace store URL or SQLite path")
    src.add_argument("--episodes", metavar="FILE", help="JSONL file of episodes (marft traces export)")
    p.add_argument("--base-model", required=True, metavar="DIR", help="transformers model directory (local)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--agents", help="comma-separated agents (paths like supervisor/agent) or adapters to train "
                   "(default: every agent with llm actions)")
    p.add_argument("--min-reward", type=float, metavar="R", help="keep episodes whose team reward is >= R "
                   "(default: every episode, rewarded or not)")
    p.add_argument("--per-agent-reward", action="store_true", help="with --min-reward: judge each agent's "
                   "actions by its own reward where the episode has one, else the team's")
    p.add_argument("--source", metavar="S", help="only episodes recorded with this source")
    p.add_argument("--since", metavar="TIME", help="only episodes started at or after TIME: ISO date/time "
                   "(UTC if no zone) or an age like 30m, 6h, 7d")
    p.add_argument("--epochs", type=int, default=3, metavar="E", help="passes over each agent's actions")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate of the LoRA weights")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="actions per optimiser step")
    p.add_argument("--val-fraction", type=float, default=0.1, metavar="F", help="episodes held out for val loss")
    p.add_argument("--seed", type=int, default=0, help="LoRA init, shuffles and the held-out split")
    p.add_argument("--config", metavar="FILE", help="YAML of MarftConfig options: lora_r, lora_alpha, "
                   "lora_dropout, target_modules, max_context, micro_batch_tokens, base_dtype, device")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="override the config's device")
    p.add_argument("--resume", action="store_true", help="continue after the last finished agent epoch in "
                   "OUT/checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_sft)


def load(store: str | None, episodes_file: str | None, source: str | None, since, rewarded: bool) -> tuple[list, int]:
    """(episodes, bad records skipped) from a store or a JSONL file, filtered by source and start time."""
    from datetime import timezone

    from .sources import read_jsonl

    if store:
        from ..store import TraceStore

        with TraceStore.open(store) as ts:
            return list(ts.episodes(source=source, since=since, has_reward=True if rewarded else None)), 0
    episodes, bad = read_jsonl(episodes_file)

    def started(ep):
        t = ep.started_at
        return t if t.tzinfo else t.replace(tzinfo=timezone.utc)

    keep = [ep for ep in episodes if (source is None or ep.source == source) and (since is None or started(ep) >= since)]
    return keep, bad


def _sft(args) -> int:
    import logging
    from pathlib import Path

    from rich.console import Console

    from ..errors import MarftError
    from ..store.cli import parse_time
    from .config import MarftConfig
    from .supervised import SftConfig, sft

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console(stderr=True, soft_wrap=True)  # commands printed whole, to copy
    config = MarftConfig.from_yaml(args.config) if args.config else MarftConfig()
    if args.device:
        config = config.model_copy(update={"device": args.device})
    if not Path(args.base_model).is_dir():
        raise MarftError(f"--base-model {args.base_model} is not a directory")
    if args.per_agent_reward and args.min_reward is None:
        raise MarftError("--per-agent-reward needs --min-reward")
    try:
        options = SftConfig(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, val_fraction=args.val_fraction,
                            min_reward=args.min_reward, per_agent_reward=args.per_agent_reward, seed=args.seed)
    except ValueError as e:
        raise MarftError(f"bad option: {e}") from None
    episodes, bad = load(args.store, args.episodes, args.source, parse_time(args.since, "--since"),
                         args.min_reward is not None and not args.per_agent_reward)
    if bad:
        console.print(f"{bad} bad records skipped (over the limits or invalid; see the warnings)")
    if not episodes:
        raise MarftError("no episodes found" + (" (with --source/--since)" if args.source or args.since else ""))
    agents = [a.strip() for a in args.agents.split(",") if a.strip()] if args.agents else None
    console.print(f"[bold]marft sft[/]: {len(episodes)} episodes from {args.store or args.episodes}")
    result = sft(episodes, args.base_model, args.out, agents=agents, config=config, options=options,
                 resume=args.resume, progress=not args.no_progress,
                 on_epoch=lambda r: console.print(_row_line(r)))
    console.print(f"examples (train, val) per adapter: {result.examples}")
    console.print(f"skipped: {result.skipped or 'nothing'}; re-tokenised: {result.flagged or 'nothing'}")
    keys = ",".join(f"{a}/{k}" for a in result.examples for k in ("train_loss", "val_loss"))
    console.print(f"adapters in {result.adapters_dir}; curves: marft plot {Path(args.out) / 'metrics.jsonl'} "
                  f"--keys {keys}")
    return 0


def _row_line(r: dict) -> str:
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    return (f"{r['agent']} epoch {r['epoch']}: train loss {fmt(r['train_loss'])} acc {fmt(r['train_token_accuracy'])}"
            f", val loss {fmt(r['val_loss'])} acc {fmt(r['val_token_accuracy'])}")
