"""Distillation on the demo task: a hosted-style *teacher* plays the demo's planner -> solver app, `marft sft`
distils its rewarded episodes into one LoRA per agent of a small student, and the student's held-out
accuracy is measured before and after, over several seeds.

The teacher is a scripted server behind the OpenAI-compatible chat-completions API (127.0.0.1, a
thread of this process): named ``gpt-4.1-mini``, it returns text only (no token ids, no adapter
version: what a hosted API returns). Its planner writes the right plan with probability
``--teacher-right`` (0.9) and the wrong order otherwise; its solver computes by the plan, so a wrong
plan gives a wrong answer. The app is the demo's own (``demo.app.build_app``: two ``ChatOpenAI``
nodes), instrumented unmodified with ``mb.instrument``; the reward is the demo's checker.

The student is the demo's warm-started tiny model (``--warm-steps`` of noisy demonstrations, plan
error rate ``--warm-plan-error``). Evaluation: the held-out questions (disjoint from the training
split), planner then solver with the student's adapters, greedy and at T=0.7 (``--eval-samples``
sampled runs of each question).

With ``--fit-iterations N``, each seed then runs ``marft fit`` twice on the student at the same
episode budget (N iterations of ``--fit-tasks`` tasks x ``--fit-group-size`` rollouts, the demo's
trainer settings, the same seed): once from the SFT adapters (``init_adapters``), once from the plain
warm start; both final adapters are evaluated on the held-out questions, and the paired difference
(from SFT − from the warm start) is reported with its 95% t interval over the seeds.

    python benchmarks/sft_distill.py --out /tmp/sft-distill --seeds 0 1 2
    python benchmarks/sft_distill.py --out /tmp/sft-fit --seeds 0 1 2 --fit-iterations 6

Prints one JSON object (also written to OUT/results.json).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TEACHER = "gpt-4.1-mini"


def teacher_reply(messages: list[dict], seed: int | None, right: float) -> str:
    """The scripted teacher: a plan (right with probability ``right``) or the solution the plan asks for."""
    from marft_bridge.demo import task

    system, user = messages[0]["content"], messages[-1]["content"]
    if system == task.PLANNER_SYSTEM:
        rng = random.Random(f"{seed}/{user}")
        correct = "left" if task.parse_question(user)[1] == "*" else "right"
        wrong = "right" if correct == "left" else "left"
        return task.plan_text(user, correct if rng.random() < right else wrong)
    question, _, plan = user.partition("\nplan: ")
    order = task.plan_order(question, plan) or "left"
    return task.solution_text(question, order)


def serve_teacher(right: float) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = teacher_reply(body["messages"], body.get("seed"), right)
            out = json.dumps({"id": f"chatcmpl-{time.monotonic_ns()}", "object": "chat.completion",
                              "created": int(time.time()), "model": TEACHER + "-2025-04-14",
                              "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                           "logprobs": None, "finish_reason": "stop"}],
                              "usage": {"prompt_tokens": 10, "completion_tokens": len(text), "total_tokens": 10}})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out.encode())

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def capture(url: str, store_path: Path, problems, seed: int) -> dict:
    """Play ``problems`` through the unmodified demo app on the teacher, instrumented into a store."""
    import marft_bridge as mb
    from marft_bridge.demo import task
    from marft_bridge.demo.app import build_app

    store = mb.TraceStore.open(str(store_path))
    app = mb.instrument(build_app(url, api_key="k", planner_model=TEACHER, solver_model=TEACHER), store=store,
                        reward_fn=lambda inputs, out: task.reward(inputs["question"], out.get("answer")))
    started = time.perf_counter()
    for k, p in enumerate(problems):
        app.invoke({"question": p.question, "seed": seed * 100_000 + 2 * k})
    store.flush()
    episodes = list(store.episodes())
    store.close()
    rewards = [sum(r.value for r in ep.rewards) for ep in episodes]
    return {"episodes": episodes, "teacher_reward": statistics.mean(rewards), "capture_s": time.perf_counter() - started}


def evaluate(base: Path, adapters: Path | None, heldout, samples: int, seed: int) -> dict:
    from marft_bridge.demo.evaluate import evaluate_two_agent, load_model

    model, tok = load_model(base)
    names = (None, None)
    if adapters is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapters / "planner"), adapter_name="planner")
        model.load_adapter(str(adapters / "solver"), adapter_name="solver")
        model.eval()
        names = ("planner", "solver")
    greedy = evaluate_two_agent(model, tok, heldout, temperature=0, seed=seed, planner_adapter=names[0],
                                solver_adapter=names[1])
    sampled = [evaluate_two_agent(model, tok, heldout, temperature=0.7, seed=seed + 1000 * s,
                                  planner_adapter=names[0], solver_adapter=names[1]) for s in range(samples)]
    return {"greedy": greedy.accuracy, "greedy_plan": greedy.plan_accuracy,
            "t0.7": statistics.mean(r.accuracy for r in sampled),
            "t0.7_plan": statistics.mean(r.plan_accuracy for r in sampled)}


def fit_arm(base: Path, init: Path | None, out: Path, seed: int, splits, args) -> dict:
    """``marft fit`` of the demo app on the student, from ``init`` (SFT adapters) or the warm start."""
    import marft_bridge as mb
    from marft_bridge.demo import app as demo_app
    from marft_bridge.demo import task
    from marft_bridge.demo.run import DemoSettings

    out.mkdir(parents=True, exist_ok=True)
    tasks, val = out / "train.jsonl", out / "val.jsonl"
    for path, problems in ((tasks, splits.train), (val, splits.heldout[:args.fit_val])):
        path.write_text("".join(json.dumps({"id": p.question, "question": p.question}) + "\n" for p in problems))

    def build(endpoint):
        return demo_app.build_app(endpoint.base_url, endpoint.api_key, planner_model=endpoint.model("planner"),
                                  solver_model=endpoint.model("solver"), temperature=DemoSettings().temperature)

    config = {**DemoSettings().trainer, "seed": seed, "checkpoint_every": None, "device": args.device,
              "lora_r": args.lora_r, "lora_alpha": 2 * args.lora_r,
              **({"init_adapters": str(init)} if init is not None else {})}
    started = time.perf_counter()
    mb.fit(build, tasks, lambda inputs, output: task.reward(inputs["question"], output.get("answer")), base,
           ["planner", "solver"], out / "run", val=val, config=config, iterations=args.fit_iterations,
           tasks_per_iteration=args.fit_tasks, group_size=args.fit_group_size, seed=seed, progress=False)
    return {"fit_s": round(time.perf_counter() - started, 1),
            "after": evaluate(base, out / "run" / "adapters", splits.heldout, args.eval_samples, seed)}


def paired(runs: list[dict], key: str) -> dict:
    from marft_bridge.benchmarks.stats import mean_interval

    return mean_interval([r["fit_from_sft"]["after"][key] - r["fit_from_warm"]["after"][key] for r in runs])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--train-tasks", type=int, default=200, help="teacher episodes captured per seed")
    ap.add_argument("--teacher-right", type=float, default=0.9)
    ap.add_argument("--warm-steps", type=int, default=300)
    ap.add_argument("--warm-plan-error", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--eval-samples", type=int, default=2)
    ap.add_argument("--model-cache", default=".marft/models")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--fit-iterations", type=int, default=0,
                    help="then marft fit from the SFT adapters and from the warm start, N iterations each (0: skip)")
    ap.add_argument("--fit-tasks", type=int, default=4, help="fit: tasks per iteration")
    ap.add_argument("--fit-group-size", type=int, default=4, help="fit: rollouts per task")
    ap.add_argument("--fit-val", type=int, default=20, help="fit: held-out questions its val replays each iteration")
    args = ap.parse_args(argv)

    from marft_bridge.demo import task
    from marft_bridge.demo.warmstart import WarmStartConfig, warm_start
    from marft_bridge.trainers.config import MarftConfig
    from marft_bridge.trainers.supervised import SftConfig, sft

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    base = warm_start(WarmStartConfig(steps=args.warm_steps, plan_error_rate=args.warm_plan_error),
                      cache_dir=args.model_cache)
    warm_s = time.perf_counter() - t0
    splits = task.make_splits(0, 100)
    server, url = serve_teacher(args.teacher_right)
    config = MarftConfig(lora_r=args.lora_r, lora_alpha=2 * args.lora_r, device=args.device)
    before = evaluate(base, None, splits.heldout, args.eval_samples, 0)
    runs = []
    for seed in args.seeds:
        cap = capture(url, out / f"traces-{seed}.db", task.sample_problems(splits.train, args.train_tasks, seed), seed)
        t = time.perf_counter()
        res = sft(cap["episodes"], base, out / f"sft-{seed}", config=config,
                  options=SftConfig(epochs=args.epochs, lr=args.lr, min_reward=1.0, seed=seed, batch_size=16))
        sft_s = time.perf_counter() - t
        after = evaluate(base, res.adapters_dir, splits.heldout, args.eval_samples, seed)
        last = {r["agent"]: r for r in res.metrics if r["epoch"] == args.epochs}
        runs.append({"seed": seed, "teacher_reward": cap["teacher_reward"], "examples": res.examples,
                     "skipped": res.skipped, "flagged": res.flagged, "after": after, "sft_s": round(sft_s, 1),
                     "capture_s": round(cap["capture_s"], 1),
                     "val_token_accuracy": {a: r["val_token_accuracy"] for a, r in last.items()}})
        if args.fit_iterations:
            runs[-1]["fit_from_sft"] = fit_arm(base, res.adapters_dir, out / f"fit-sft-{seed}", seed, splits, args)
            runs[-1]["fit_from_warm"] = fit_arm(base, None, out / f"fit-warm-{seed}", seed, splits, args)
        print(json.dumps(runs[-1]), file=sys.stderr)
    server.shutdown()
    summary = {k: {"mean": statistics.mean(r["after"][k] for r in runs),
                   "sd": statistics.stdev(r["after"][k] for r in runs) if len(runs) > 1 else 0.0}
               for k in ("greedy", "greedy_plan", "t0.7", "t0.7_plan")}
    result = {"args": vars(args), "warm_start_s": round(warm_s, 1), "student_before": before,
              "student_after": summary, "teacher_reward": statistics.mean(r["teacher_reward"] for r in runs),
              "runs": runs}
    if args.fit_iterations:
        result["fit"] = {"episodes_per_arm": args.fit_iterations * args.fit_tasks * args.fit_group_size,
                         **{arm: {k: {"mean": statistics.mean(r[arm]["after"][k] for r in runs),
                                      "sd": statistics.stdev(r[arm]["after"][k] for r in runs) if len(runs) > 1 else 0.0}
                                  for k in ("greedy", "greedy_plan", "t0.7")}
                            for arm in ("fit_from_sft", "fit_from_warm")},
                         "sft_minus_warm": {k: paired(runs, k) for k in ("greedy", "greedy_plan", "t0.7")}}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
