"""Paired-seed statistics for the ablation: curve summaries, t intervals, Wilson intervals, Holm.

Summaries of one run's exact-J curve J_0..J_T (pre-declared in benchmarks/marft_ablation.py):

- ``auc``: the area under the curve over iterations, trapezoid rule, divided by T (a mean J in [0, 1]);
- ``final``: J_T;
- ``reached``: max_t J_t >= 0.95;
- ``collapsed``: some J_t < max_{s<=t} J_s - 0.1 (J fell more than 0.1 below its running maximum).

The Student t distribution is computed here (regularised incomplete beta, Lentz continued
fraction) so the benchmark needs no scipy.
"""

from __future__ import annotations

import math
import statistics

REACH = 0.95
COLLAPSE_DROP = 0.1


def auc(curve: list[float]) -> float:
    t = len(curve) - 1
    if t < 1:
        return float(curve[0])
    return sum((a + b) / 2 for a, b in zip(curve, curve[1:])) / t


def reached(curve: list[float], level: float = REACH) -> bool:
    return max(curve) >= level


def collapsed(curve: list[float], drop: float = COLLAPSE_DROP) -> bool:
    best = -math.inf
    for j in curve:
        best = max(best, j)
        if j < best - drop:
            return True
    return False


def summary(curve: list[float]) -> dict[str, float]:
    return {"auc": auc(curve), "final": float(curve[-1]), "reached": float(reached(curve)),
            "collapsed": float(collapsed(curve))}


# -- Student t ----------------------------------------------------------------------------------------


def _betacf(a: float, b: float, x: float) -> float:
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    tail = t_tail(abs(t), df)
    return 1.0 - tail if t >= 0 else tail


def t_tail(t: float, df: float) -> float:
    """P(T > t) for t >= 0, computed directly (``1 - t_cdf`` rounds to 0 below about 1e-16)."""
    return 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student t with ``df`` degrees of freedom (bisection on the CDF)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def mean_interval(xs: list[float], level: float = 0.95) -> dict[str, float]:
    """Mean and its two-sided t interval; ``p``: the t test of mean 0."""
    n = len(xs)
    mean = statistics.fmean(xs)
    if n < 2:
        return {"mean": mean, "lo": math.nan, "hi": math.nan, "p": math.nan, "n": n}
    se = statistics.stdev(xs) / math.sqrt(n)
    if se == 0:
        return {"mean": mean, "lo": mean, "hi": mean, "p": 1.0 if mean == 0 else 0.0, "n": n}
    q = t_quantile(0.5 + level / 2, n - 1)
    p = 2 * t_tail(abs(mean) / se, n - 1)
    return {"mean": mean, "lo": mean - q * se, "hi": mean + q * se, "p": p, "n": n}


def wilson(successes: int, n: int, level: float = 0.95) -> dict[str, float]:
    """A proportion and its Wilson score interval."""
    if n == 0:
        return {"mean": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    z = math.sqrt(2) * _erfinv(level)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return {"mean": p, "lo": max(0.0, centre - half), "hi": min(1.0, centre + half), "n": n}


def _erfinv(y: float) -> float:
    lo, hi = 0.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erf(mid) < y else (lo, mid)
    return (lo + hi) / 2


def holm(pvalues: dict[str, float], alpha: float = 0.05) -> dict[str, dict[str, float]]:
    """Holm's step-down correction: per name the adjusted p, the level its interval is drawn at
    (1 - alpha / (m - rank), rank 0 = smallest p) and whether it is rejected at ``alpha``."""
    names = sorted(pvalues, key=lambda k: (math.isnan(pvalues[k]), pvalues[k]))
    m = len(names)
    out, running, stopped = {}, 0.0, False
    for rank, name in enumerate(names):
        p = pvalues[name]
        adj = min(1.0, max(running, (m - rank) * p)) if not math.isnan(p) else math.nan
        running = adj if not math.isnan(adj) else running
        stopped = stopped or math.isnan(p) or p > alpha / (m - rank)
        out[name] = {"p_holm": adj, "level": 1 - alpha / (m - rank), "significant": not stopped}
    return out


def paired_comparisons(per_seed: dict[str, list[float]], pairs: list[tuple[str, str]],
                       alpha: float = 0.05) -> dict[str, dict]:
    """For each (a, b): the paired differences a - b over seeds, their mean, the Holm-step t
    interval, raw and Holm-adjusted p. ``per_seed[arm]`` lists one value per seed, seeds aligned."""
    diffs = {f"{a} - {b}": [x - y for x, y in zip(per_seed[a], per_seed[b])] for a, b in pairs}
    raw = {k: mean_interval(d)["p"] for k, d in diffs.items()}
    corr = holm(raw, alpha)
    out = {}
    for k, d in diffs.items():
        ci = mean_interval(d, level=corr[k]["level"])
        ci95 = mean_interval(d)
        out[k] = {"mean": ci["mean"], "lo": ci["lo"], "hi": ci["hi"], "level": corr[k]["level"],
                  "lo95": ci95["lo"], "hi95": ci95["hi"], "p": raw[k], **{x: corr[k][x] for x in ("p_holm", "significant")},
                  "n": len(d)}
    return out
