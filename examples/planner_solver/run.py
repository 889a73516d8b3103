"""Run the demo's planner → solver LangGraph app against a running `marft serve` and score it.

    python examples/planner_solver/run.py --base-url http://127.0.0.1:8000 --n 20

Each question goes to the planner (``model="planner"``), its plan to the solver
(``model="solver"``); the checker scores the solver's last number. ``--trace`` also records every
run as a Flex-POMDP episode (with its reward) in the trace store.
"""

from __future__ import annotations

import argparse
import sys

from marft_bridge.demo import task
from marft_bridge.demo.app import build_app, build_single_agent_app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server root (or its /v1)")
    p.add_argument("--api-key", default=None, help="server API key, if it requires one")
    p.add_argument("--planner-model", default="planner", help="adapter name serving the planner")
    p.add_argument("--solver-model", default="solver", help="adapter name serving the solver")
    p.add_argument("--single-agent", metavar="MODEL", default=None, help="run the one-agent baseline with this adapter instead")
    p.add_argument("--n", type=int, default=10, help="questions to run")
    p.add_argument("--split", choices=["train", "heldout"], default="heldout")
    p.add_argument("--seed", type=int, default=0, help="which questions (the split itself uses seed 0)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--trace", action="store_true", help="record episodes into the default trace store (.marft/traces.db)")
    args = p.parse_args(argv)

    if args.single_agent:
        app = build_single_agent_app(args.base_url, api_key=args.api_key, model=args.single_agent, temperature=args.temperature)
    else:
        app = build_app(args.base_url, api_key=args.api_key, planner_model=args.planner_model,
                        solver_model=args.solver_model, temperature=args.temperature)
    if args.trace:
        import marft_bridge as mb

        app = mb.instrument(app, store=mb.TraceStore.open(), reward_fn=lambda i, o: task.reward(i["question"], o.get("answer")))

    problems = getattr(task.make_splits(0), args.split)
    correct = 0
    for prob in task.sample_problems(problems, args.n, seed=args.seed):
        state = app.invoke({"question": prob.question})
        r = task.reward(prob.question, state["answer"])
        correct += r
        answer = state["answer"].replace("\n", " | ")
        print(f"{prob.question:>7}  plan: {state['plan']:<14} answer: {answer:<28} {'ok' if r else 'wrong (' + str(prob.answer) + ')'}")
    print(f"accuracy {correct / args.n:.2f} over {args.n} questions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
