"""``marft fit``: train your own app's agents on a task set (``marft_bridge.fit``)."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Train the agents of your own app on a task set: the app is the environment. Each iteration plays K tasks
x G rollouts (distinct sampling seeds) through the app, concurrently, captures every run as an episode
into the store (with its task id and rollout index), runs one update on the rewarded episodes (MARFT PPO, or with
--algorithm expert_iteration supervised fine-tuning of each agent on its own best rollouts),
publishes each agent's new adapter as its next version and hot-swaps it into the server, then replays the
val tasks with the same seeds and prints one metrics line. At the end the best-val versions are promoted
in OUT/registry, and OUT/results.json and OUT/learning_curve.png are written. App runs that raise or pass
--rollout-timeout are stored as failed episodes, excluded and counted; so are runs whose reward function
raises. Under torchrun, rank 0 plays the rollouts and every rank trains."""

EPILOG = """\
example (run from examples/fit_quickstart):
  marft fit --app app:build_app --tasks tasks.jsonl --val val.jsonl --reward reward:score \\
            --base-model MODEL_DIR --agents planner solver --out runs/fit --iterations 8
  # expert iteration: each agent fine-tuned on the best of each task's 4 rollouts that solved it
  marft fit ... --algorithm expert_iteration --top-k-per-group 1 --min-reward 1
"""


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fit", help="train your own app's agents on a task set (the app is the environment)",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--app", required=True, metavar="MODULE:FACTORY",
                   help="FACTORY(endpoint) returns your app (a compiled LangGraph graph, or any object with "
                   "invoke/ainvoke); point each agent's model at endpoint.base_url with api_key=endpoint.api_key "
                   "and model=endpoint.model(AGENT); passing seed=endpoint.seed to a call makes the rollout "
                   "reproducible. "
                   "MODULE is imported from the working directory (or give path/to/file.py:FACTORY)")
    p.add_argument("--tasks", required=True, metavar="FILE",
                   help="JSONL: one app input (a JSON object) per line, with an optional \"id\"")
    p.add_argument("--val", metavar="FILE", help="held-out tasks, same format (default: a fixed 10%% of --tasks)")
    p.add_argument("--reward", required=True, metavar="MODULE:FN",
                   help="FN(task, output) returns a float (team reward) or {agent: float}; may be async")
    p.add_argument("--base-model", required=True, metavar="DIR", help="the base model (transformers directory)")
    p.add_argument("--agents", required=True, nargs="+", metavar="A",
                   help="the adapter names to train, one per agent (as `marft adapters map` prints them)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output: registry/ (every version), adapters/ (the last), traces.db, state/ (resume), "
                   "results.json, learning_curve.png, iterations.jsonl, metrics.jsonl (the trainer's)")
    p.add_argument("--config", metavar="FILE", help="YAML of MarftConfig options (advantage, lr, ...)")
    p.add_argument("--iterations", type=int, default=10, metavar="N", help="train/publish iterations (default 10)")
    p.add_argument("--tasks-per-iteration", type=int, default=8, metavar="K", help="tasks per iteration (default 8)")
    p.add_argument("--group-size", type=int, default=4, metavar="G",
                   help="rollouts per task, each with its own sampling seed (default 4)")
    p.add_argument("--concurrency", type=int, default=16, metavar="C", help="app runs at a time (default 16)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of the task order, the sampling seeds and the trainer (default 0)")
    p.add_argument("--server", metavar="URL", help="a running vLLM server (default: fit starts the embedded "
                   "server on 127.0.0.1 with a random key and stops it at the end)")
    p.add_argument("--api-key-env", metavar="VAR", help="environment variable holding --server's API key")
    p.add_argument("--store", metavar="URL", help="trace store URL or SQLite path (default OUT/traces.db)")
    p.add_argument("--rollout-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="an app run longer than this is stopped and stored as a failed episode (default 300)")
    p.add_argument("--server-start-timeout", type=float, default=120.0, metavar="S",
                   help="seconds the embedded server may take to load the base model and answer /health "
                   "(default 120; raise it on a slow or busy machine)")
    p.add_argument("--algorithm", choices=["ppo", "expert_iteration"], default="ppo",
                   help="the update: ppo (default: the MARFT update of --config on every rewarded rollout) or "
                   "expert_iteration (rejection-sampling fine-tuning: per task group each agent keeps its best "
                   "rollouts, ranked by its own reward where the reward function gives one per agent, else the "
                   "team reward, and its adapter is fine-tuned from where it stands with the SFT loss on its own "
                   "kept actions; an agent with nothing kept is unchanged; published like ppo)")
    p.add_argument("--min-reward", type=float, metavar="R",
                   help="expert_iteration: keep rollouts with reward >= R")
    p.add_argument("--top-k-per-group", type=int, metavar="K",
                   help="expert_iteration: keep at most the K highest-reward rollouts of each task group "
                   "(ties: the lower rollout index); with --min-reward, only those >= R")
    p.add_argument("--sft-epochs", type=int, default=1, metavar="E",
                   help="expert_iteration: passes over the kept actions per iteration (default 1)")
    p.add_argument("--sft-lr", type=float, default=1e-4, metavar="LR",
                   help="expert_iteration: learning rate of the SFT step (default 1e-4; a fresh AdamW per "
                   "agent and iteration)")
    p.add_argument("--sft-batch-size", type=int, default=8, metavar="N",
                   help="expert_iteration: actions per optimiser step (default 8)")
    p.add_argument("--resume", action="store_true",
                   help="continue a killed run from its last completed iteration (no version is published twice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the metrics lines still print)")
    p.set_defaults(func=_fit)


def _fit(args) -> int:
    import logging

    from .loop import fit

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    fit(args.app, args.tasks, args.reward, args.base_model, args.agents, args.out, val=args.val, config=args.config,
        iterations=args.iterations, tasks_per_iteration=args.tasks_per_iteration, group_size=args.group_size,
        concurrency=args.concurrency, seed=args.seed, server=args.server, api_key_env=args.api_key_env,
        store=args.store, rollout_timeout=args.rollout_timeout,
        server_start_timeout=args.server_start_timeout, resume=args.resume, progress=not args.no_progress,
        algorithm=args.algorithm, min_reward=args.min_reward, top_k_per_group=args.top_k_per_group,
        sft_epochs=args.sft_epochs, sft_lr=args.sft_lr, sft_batch_size=args.sft_batch_size)
    return 0
