"""``marft train`` (MARFT on stored traces) and ``marft plot`` (curves from metrics.jsonl)."""

from __future__ import annotations

import argparse


def add_commands(sub) -> None:
    p = sub.add_parser(
        "train",
        help="fine-tune one LoRA adapter per agent with MARFT on stored traces",
        description="Train per-agent LoRA adapters with MARFT (multi-agent PPO, sequential trust-region update) "
        "on rewarded Flex-POMDP episodes from a trace store or a JSONL export. Writes "
        "OUT/adapters/<agent>/ (peft, safetensors), OUT/checkpoint/ (exact resume), OUT/metrics.jsonl.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--store", help="trace store URL or SQLite path (rewarded episodes are used)")
    p.add_argument("--episodes", metavar="FILE", help="JSONL file of episodes (marft traces export)")
    p.add_argument("--base-model", required=True, metavar="PATH", help="transformers model directory (local)")
    p.add_argument("--config", metavar="FILE", help="YAML file of MarftConfig options (defaults: the paper's code)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--agents", help="comma-separated adapters to train, or agents (paths like supervisor/agent) "
                   "mapped to the adapters their calls used (default: every adapter that served an llm action: "
                   "the call's model name, else the agent path with '/' as '.')")
    p.add_argument("--init-adapters", metavar="DIR", help="start each agent's LoRA from DIR/<agent>/ "
                   "(adapter_config.json + adapter_model.safetensors, as `marft sft` writes them and `marft adapters "
                   "publish` takes them; overrides the config's init_adapters; --resume from a checkpoint wins)")
    p.add_argument("--iterations", type=int, help="number of updates (default: one pass over the episodes)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="override the config's device")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint when it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)

    q = sub.add_parser("plot", help="plot training curves from metrics.jsonl to a PNG",
                       description="Plot reward, KL, entropy, value loss and other metrics written by `marft train`.")
    q.add_argument("metrics", help="metrics.jsonl written by marft train")
    q.add_argument("--out", metavar="PNG", help="output image (default: next to the metrics file)")
    q.add_argument("--keys", help="comma-separated metric names (default: reward, KL, entropy, losses)")
    q.set_defaults(func=_plot)


def _train(args) -> int:
    import logging
    import math
    from pathlib import Path

    from rich.console import Console

    from ..errors import MarftError
    from .config import MarftConfig
    from ..schema import adapters_by_agent, resolve_adapters
    from .admission import foreign_line
    from .sources import load_episodes

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console(stderr=True)
    config = MarftConfig.from_yaml(args.config) if args.config else MarftConfig()
    if args.device:
        config = config.model_copy(update={"device": args.device})
    if args.init_adapters:
        config = config.model_copy(update={"init_adapters": args.init_adapters})
    if not Path(args.base_model).is_dir():
        raise MarftError(f"--base-model {args.base_model} is not a directory")
    episodes = load_episodes(args.store, args.episodes)
    if not episodes:
        raise MarftError("no rewarded episodes found")
    # A hosted model's calls name their agent's adapter (adapter_names), and are foreign to it (admission.py).
    known = adapters_by_agent(episodes)
    asked = [a.strip() for a in args.agents.split(",") if a.strip()] if args.agents else list(known)
    agents = resolve_adapters(asked, known)
    if not agents:
        raise MarftError("the episodes have no llm actions to train")
    mapped = {a: known[a] for a in asked if a in known and known[a] != [a]}
    if mapped:
        console.print("agent -> adapter: " + ", ".join(f"{a} -> {' '.join(n)}" for a, n in mapped.items()))
    iterations = args.iterations or math.ceil(len(episodes) / config.batch_episodes)
    if iterations < 1:
        raise MarftError("--iterations must be at least 1")
    console.print(f"[bold]marft train[/]: {len(episodes)} episodes, agents {agents}, {iterations} updates")
    console.print(config.to_yaml().rstrip())

    from .marft import MarftTrainer

    out = Path(args.out)
    trainer = MarftTrainer(config, args.base_model, agents, out_dir=out)
    console.print(f"device {trainer.device}; adapters {trainer.policy.adapter_of}"
                  + (f"; started from {config.init_adapters}" if config.init_adapters else ""))
    if line := foreign_line(trainer.foreign_actions(episodes)):
        console.print(f"[bold yellow]{line}[/]")
    if args.resume and (out / "checkpoint" / "state.json").exists():
        trainer.load_checkpoint(out / "checkpoint")
        console.print(f"resumed at update {trainer.update_count}")
    history = trainer.fit(episodes, iterations, progress=not args.no_progress)
    trainer.save_checkpoint(out / "checkpoint")
    trainer.save_adapters(out / "adapters")
    last = history[-1]
    console.print(f"done: {trainer.update_count} updates, reward {last['reward_mean']:.4f}, "
                  f"KL {last['kl_ref']:.4g}, entropy {last['entropy']:.4g}; skipped {last['skipped'] or 'nothing'}; "
                  f"adapters in {out / 'adapters'}")
    return 0


def _plot(args) -> int:
    from pathlib import Path

    from .plot import plot_metrics

    out = args.out or str(Path(args.metrics).with_suffix(".png"))
    keys = [k.strip() for k in args.keys.split(",")] if args.keys else None
    print(plot_metrics(args.metrics, out, keys))
    return 0
