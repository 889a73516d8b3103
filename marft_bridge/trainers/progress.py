"""The progress bar of ``MarftTrainer.train`` / ``fit``: one step per update, with its main metrics."""

from __future__ import annotations

import math


class ProgressBar:
    """A rich progress bar showing reward, KL, entropy and value loss (a no-op when disabled)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("[bold]MARFT"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("{task.fields[stats]}"))
            self.bar.start()
            self.task = self.bar.add_task("train", total=self.total, stats="")
        return self

    def __call__(self, m: dict) -> None:
        if self.enabled:
            fmt = lambda x: f"{x:.3f}" if isinstance(x, float) and math.isfinite(x) else str(x)  # noqa: E731
            stats = (f"reward {fmt(m['reward_mean'])}  kl {fmt(m['kl_ref'])}  entropy {fmt(m['entropy'])}  "
                     f"value_loss {fmt(m['value_loss'])}")
            self.bar.update(self.task, advance=1, stats=stats)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()
