"""Always-valid (mixture SPRT) intervals for a mean: valid at every look at once, so a service may
recompute them at every poll. Shared by the canary's test (``service.canary``) and the drift views
(``marft service status``, ``marft ui``); the derivation is in ``service/canary.py``'s docstring.

    mean ± sqrt( V (V + τ²) / τ² · log((V + τ²) / (V α²)) ),   V = s² / n

Standard library only."""

from __future__ import annotations

import math

MIN_VARIANCE = 1e-6  # a floor: a first few equal rewards must not make the interval a point


def halfwidth(v: float, alpha: float, tau: float) -> float:
    """The mSPRT interval's half-width for an estimate of variance ``v``, mixture scale ``tau``."""
    t2 = tau * tau
    return math.sqrt(v * (v + t2) / t2 * math.log((v + t2) / (v * alpha * alpha)))


def mean_var(n: int, total: float, total_sq: float) -> tuple[float, float]:
    """The mean and the (n − 1) sample variance from sums, floored at MIN_VARIANCE."""
    m = total / n
    var = (total_sq - n * m * m) / (n - 1) if n > 1 else 0.0
    return m, max(var, MIN_VARIANCE)


def mean_interval(xs: list[float], alpha: float, tau: float) -> tuple[float, float, float] | None:
    """(mean, lo, hi): the always-valid interval for one mean (a release's live reward); None
    before two values."""
    n = len(xs)
    if n < 2:
        return None
    m, v = mean_var(n, sum(xs), sum(x * x for x in xs))
    h = halfwidth(v / n, alpha, tau)
    return m, m - h, m + h


__all__ = ["MIN_VARIANCE", "halfwidth", "mean_interval", "mean_var"]
