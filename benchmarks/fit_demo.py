"""``marft fit`` on the demo task: held-out accuracy per iteration under the critic (``advantage: gae``) and
under group-relative advantages (``advantage: grpo``), several seeds, with 95% bands over seeds, and the
seconds per iteration.

Both arms see the same data per iteration (K questions x G rollouts, the G rollouts of a question with
distinct sampling seeds) and the same trainer settings otherwise (the demo's, MARFT-A); only the advantage
estimator differs. Each (arm, seed) is one ``marft_bridge.fit`` run through the demo (``run_demo``) on the
embedded server.

    python benchmarks/fit_demo.py --seeds 3 --iterations 6 --out .marft/bench-fit
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ARMS = {"gae": {}, "grpo": {"advantage": "grpo"}}
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # t(0.975, n-1)


def band(xs: list[float]) -> tuple[float, float]:
    """Mean over seeds and the 95% t half-width of that mean (0 with one seed)."""
    m = statistics.fmean(xs)
    return m, (T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0)


def run_arm(arm: str, args, out: Path) -> dict:
    from marft_bridge.demo.run import DemoSettings, run_demo

    base = DemoSettings()
    s = DemoSettings(seeds=args.seeds, iterations=args.iterations, methods=["marft_a"], group_size=args.group_size,
                     episodes_per_iteration=args.tasks * args.group_size, heldout=args.heldout,
                     eval_samples=args.eval_samples, trainer={**base.trainer, **ARMS[arm]})
    res = run_demo(out=out / arm, settings=s)
    secs = []
    for seed in range(args.seeds):
        rows = json.loads((out / arm / "runs" / f"marft_a-s{seed}" / "results.json").read_text())["iterations"]
        secs += [r["seconds"] for r in rows if r["iteration"] > 0]
    curves = res["curves"]["marft_a"]
    return {"curve": [band([c[i] for c in curves]) for i in range(len(curves[0]))], "per_seed": curves,
            "seconds_per_iteration": statistics.fmean(secs), "final_eval": res["final_eval"]["marft_a"]}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm, r in results.items():
        xs = range(len(r["curve"]))
        m = [c[0] for c in r["curve"]]
        h = [c[1] for c in r["curve"]]
        line, = ax.plot(xs, m, marker="o", label=f"{arm} ({len(r['per_seed'])} seeds)")
        ax.fill_between(xs, [a - b for a, b in zip(m, h)], [a + b for a, b in zip(m, h)], alpha=0.15,
                        color=line.get_color())
    ax.set_xlabel("iteration (0 = untrained)")
    ax.set_ylabel("held-out accuracy (server)")
    ax.set_title("marft fit on the demo task: gae vs grpo (95% bands over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--tasks", type=int, default=12, help="questions per iteration (K)")
    p.add_argument("--group-size", type=int, default=4, help="rollouts per question (G)")
    p.add_argument("--heldout", type=int, default=96)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--out", default=".marft/bench-fit")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {arm: run_arm(arm, args, out) for arm in args.arms}
    print(f"\nmarft fit, demo task: {args.tasks} questions x {args.group_size} rollouts per iteration, "
          f"{args.heldout} held-out questions, {args.seeds} seeds (mean ± 95% t over seeds)")
    print("iteration  " + "  ".join(f"{arm:>15}" for arm in results))
    for i in range(args.iterations + 1):
        print(f"{i:>9}  " + "  ".join(f"{r['curve'][i][0]:.3f} ± {r['curve'][i][1]:.3f}" for r in results.values()))
    for arm, r in results.items():
        print(f"{arm}: {r['seconds_per_iteration']:.1f} s per iteration (rollouts + update)")
    (out / "fit_demo.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    plot(results, out / "fit_demo.png")
    print(f"written {out / 'fit_demo.json'} and {out / 'fit_demo.png'}")


if __name__ == "__main__":
    main()
