"""Long relay curves side by side: the per-seed exact-J curves of ``marft_ablation.py`` runs (their
``results.json``), one figure, and per arm where it plateaus — the first iteration whose mean J is
within ``--within`` (0.01) of the curve's maximum — with the mean J and its 95% interval at a few
iterations.

    python benchmarks/relay_curves.py /tmp/curve-ei/results.json /tmp/curve-rh/results.json --out curves.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marft_bridge.benchmarks import stats  # noqa: E402
from marft_bridge.benchmarks.ablation import ARMS  # noqa: E402


def plateau(mean_curve: list[float], within: float) -> int:
    top = max(mean_curve)
    return next(i for i, j in enumerate(mean_curve) if j >= top - within)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results.json of marft_ablation.py runs")
    ap.add_argument("--out", default="relay-curves.png")
    ap.add_argument("--within", type=float, default=0.01)
    args = ap.parse_args(argv)
    arms: dict[str, tuple[list[list[float]], float | None]] = {}
    for path in args.results:
        r = json.loads(Path(path).read_text())
        for arm, curves in r["curves"].items():
            if arm != "untrained":
                arms[arm] = (curves, r["lrs"].get(arm) if isinstance(r.get("lrs"), dict) else None)
    lines = ["| arm | lr | seeds | plateau (iteration) | J at 12 | J at 24 | J at 48 | max mean J |", "|---|---|---|---|---|---|---|---|"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for arm, (curves, lr) in arms.items():
        n = len(curves[0])
        cis = [stats.mean_interval([c[i] for c in curves]) for i in range(n)]
        mean = [ci["mean"] for ci in cis]
        ax.plot(range(n), mean, label=f"{ARMS.get(arm, arm)} (lr {lr})")
        ax.fill_between(range(n), [ci["lo"] for ci in cis], [ci["hi"] for ci in cis], alpha=0.2)
        at = {t: (f"{cis[t]['mean']:.3f} [{cis[t]['lo']:.3f}, {cis[t]['hi']:.3f}]" if t < n else "-") for t in (12, 24, 48)}
        lines.append(f"| {ARMS.get(arm, arm)} | {lr} | {len(curves)} | {plateau(mean, args.within)} | {at[12]} | "
                     f"{at[24]} | {at[48]} | {max(mean):.3f} |")
    ax.set_xlabel("iteration (update)")
    ax.set_ylabel("exact expected reward J")
    ax.set_ylim(0, 1.02)
    ax.axhline(0.95, color="grey", linestyle=":", linewidth=1)
    ax.set_title(f"codebook relay, 3 hops: mean exact J, 95% band ({len(next(iter(arms.values()))[0])} seeds)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print("\n".join(lines))
    print(f"figure: {args.out}; plateau: the first iteration whose mean J is within {args.within} of its maximum")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
