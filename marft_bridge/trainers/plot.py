"""``marft plot``: training curves (reward, KL, entropy, value loss, ...) from metrics.jsonl to a PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import MarftError

DEFAULT_KEYS = ["reward_mean", "kl_ref", "entropy", "value_loss", "policy_loss", "approx_kl"]


def read_metrics(path) -> list[dict]:
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise MarftError(f"cannot read metrics {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise MarftError(f"{path} line {n}: not JSON") from None
    if not rows:
        raise MarftError(f"{path} holds no metrics")
    return rows


def plot_metrics(metrics_path, out_png, keys: list[str] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = read_metrics(metrics_path)
    keys = [k for k in (keys or DEFAULT_KEYS) if any(isinstance(r.get(k), (int, float)) for r in rows)]
    if not keys:
        raise MarftError(f"{metrics_path}: none of the requested metrics are present")
    cols = min(3, len(keys))
    fig, axes = plt.subplots(math.ceil(len(keys) / cols), cols, figsize=(4 * cols, 3 * math.ceil(len(keys) / cols)),
                             squeeze=False)
    for ax, key in zip(axes.flat, keys):
        pts = [(r.get("update", i + 1), r[key]) for i, r in enumerate(rows) if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".")
        ax.set_title(key)
        ax.set_xlabel("update")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
