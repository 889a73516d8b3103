"""What ``fit`` shows and leaves behind: one metrics line per iteration, a rich progress bar, and at the
end ``results.json`` and a learning-curve PNG (val reward per iteration, 95% band over the val tasks)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

RESULTS_FILE = "results.json"
CURVE_FILE = "learning_curve.png"
ITERATIONS_FILE = "iterations.jsonl"


def val_summary(rewards: list[float | None]) -> dict[str, Any]:
    """Mean val reward and its standard error; a failed or unrewarded val run counts as reward 0 (the
    val set is fixed, so the curve's points are comparable) and is counted."""
    xs = [0.0 if r is None else r for r in rewards]
    sem = statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0
    return {"val_reward": statistics.fmean(xs), "val_sem": sem, "val_n": len(xs),
            "val_failed": sum(r is None for r in rewards)}


def metrics_line(row: dict, iterations: int) -> str:
    c = row.get("counts", {})
    train = "no update" if row.get("train_reward") is None else f"train reward {row['train_reward']:.3f}"
    excl = ", ".join(f"{c[k]} {k.replace('_', ' ')}" for k in ("failed", "timeout", "reward_error", "invalid")
                     if c.get(k))
    versions = " ".join(f"{a} v{v}" for a, v in row.get("versions", {}).items())
    m = row.get("metrics") or {}
    kept = ""
    if m.get("algorithm") == "expert_iteration":  # how many rollouts the SFT step learned from
        kept = f" | kept {m.get('kept_rollouts') or 0}/{m.get('rollouts', 0)} rollouts"
    return (f"iter {row['iteration']}/{iterations}: {train} on {c.get('ok', 0)} episodes"
            f"{' (excluded: ' + excl + ')' if excl else ''}{kept} | val {row['val_reward']:.3f} ± {row['val_sem']:.3f} "
            f"({row['val_n']} tasks) | {versions} | {row.get('seconds', 0.0):.1f}s")


def write_results(out: Path, rows: list[dict], best: dict, settings: dict, seconds: float) -> dict:
    from .. import durable

    totals: dict[str, int] = {}
    for r in rows:
        for k, v in r.get("counts", {}).items():
            totals[k] = totals.get(k, 0) + v
    results = {"settings": settings, "iterations": rows, "val_curve": [r["val_reward"] for r in rows],
               "best": best, "excluded": {k: v for k, v in totals.items() if k != "ok"}, "episodes": totals,
               "seconds": seconds}
    durable.write_json(out / RESULTS_FILE, results)
    return results


def plot_curve(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["iteration"] for r in rows]
    ys = [r["val_reward"] for r in rows]
    half = [1.96 * r["val_sem"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    line, = ax.plot(xs, ys, marker="o", label="val reward")
    ax.fill_between(xs, [y - h for y, h in zip(ys, half)], [y + h for y, h in zip(ys, half)], alpha=0.15,
                    color=line.get_color(), label="95% over val tasks")
    ax.set_xlabel("iteration (0 = untrained)")
    ax.set_ylabel("mean val reward")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class Progress:
    """A rich bar over the iterations' rollouts, with the latest val reward; silent when ``enabled`` is off."""

    def __init__(self, console: Any, enabled: bool):
        self.console, self.enabled = console, enabled
        self.bar = None
        self.job = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                    TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=self.console,
                                    transient=True)
            self.bar.__enter__()
        return self

    def start(self, description: str, total: int, status: str) -> None:
        if self.bar is not None:
            if self.job is not None:
                self.bar.remove_task(self.job)
            self.job = self.bar.add_task(description, total=total, status=status)

    def advance(self, status: str | None = None) -> None:
        if self.bar is not None and self.job is not None:
            self.bar.update(self.job, advance=1, **({"status": status} if status else {}))

    def print(self, line: str) -> None:
        console = self.bar.console if self.bar is not None else self.console
        console.print(line, highlight=False, markup=False, soft_wrap=True)

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def append_row(out: Path, row: dict) -> None:
    from .. import durable

    durable.append_json_line(out / ITERATIONS_FILE, json.loads(json.dumps(row, default=str)))
