"""The canary's sequential test (service/canary.py): its interval by hand, and by seeded simulation
with a look at every poll, equal releases promoted at most alpha of the time (a naive z-test is not)."""

from __future__ import annotations

import math
import random

from marft_bridge.service.canary import Moments, decide, difference_interval, mean_interval, naive_z_decides

ALPHA, TAU = 0.05, 0.1


def test_interval_by_hand():
    canary, stable = [1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0]
    iv = difference_interval(canary, stable, ALPHA, TAU)
    # means 3/4 and 1/3; sample variances (n-1) 1/4 and 1/3; V = 1/16 + 1/9
    v = 0.25 / 4 + (1 / 3) / 3
    h = math.sqrt(v * (v + 0.01) / 0.01 * math.log((v + 0.01) / (v * 0.0025)))
    assert math.isclose(iv.estimate, 0.75 - 1 / 3)
    assert math.isclose(iv.lo, 0.75 - 1 / 3 - h) and math.isclose(iv.hi, 0.75 - 1 / 3 + h)
    assert (iv.n_canary, iv.n_stable) == (4, 3)
    assert difference_interval([1.0], stable, ALPHA, TAU) is None
    m = Moments.of(canary)
    assert (m.n, m.total, m.total_sq) == (4, 3.0, 3.0)
    mean, lo, hi = mean_interval(canary, ALPHA, TAU)
    assert mean == 0.75 and lo < 0.75 < hi


def test_decide_rules():
    iv = difference_interval([1.0] * 50 + [0.0] * 50, [1.0] * 500 + [0.0] * 500, ALPHA, TAU)
    assert decide(iv, margin=0.0, min_episodes=200, deadline=False)[0] == "continue"  # too few canary episodes
    assert decide(iv, margin=0.0, min_episodes=200, deadline=True)[0] == "rollback"
    assert decide(iv, margin=0.0, min_episodes=10, deadline=False)[0] == "continue"  # contains 0
    assert decide(iv, margin=0.0, min_episodes=10, deadline=True)[0] == "rollback"
    assert decide(iv, margin=1.0, min_episodes=10, deadline=False)[0] == "promote"  # far from −1
    worse = difference_interval([0.0] * 100, [1.0] * 500 + [0.0] * 500, ALPHA, TAU)
    d, reason = decide(worse, margin=0.0, min_episodes=10, deadline=False)
    assert d == "rollback" and "below" in reason


def _run(seed: int, p_canary: float, p_stable: float = 0.5, frac: float = 0.1, poll: int = 20,
         total: int = 3000, min_eps: int = 30) -> tuple[str, bool]:
    """One canary, peeked at every ``poll`` episodes: (the sequential decision, whether the naive
    z-test ever said "promote")."""
    rng = random.Random(seed)
    c, s, naive = Moments(), Moments(), False
    for i in range(total):
        if rng.random() < frac:
            c.add(1.0 if rng.random() < p_canary else 0.0)
        else:
            s.add(1.0 if rng.random() < p_stable else 0.0)
        if (i + 1) % poll:
            continue
        naive = naive or (c.n >= min_eps and naive_z_decides(c, s, ALPHA, 0.0))
        d, _ = decide(difference_interval(c, s, ALPHA, TAU), margin=0.0, min_episodes=min_eps, deadline=False)
        if d != "continue":
            return d, naive
    return "none", naive


def test_false_promotion_rate_under_peeking_stays_at_alpha():
    runs = [_run(seed, p_canary=0.5) for seed in range(300)]
    promoted = sum(d == "promote" for d, _ in runs) / len(runs)
    naive = sum(n for _, n in runs) / len(runs)
    assert promoted <= ALPHA  # 5/300 with these seeds
    assert naive > 2 * ALPHA  # peeking at a fixed-sample test inflates it (0.24 with these seeds)


def test_a_better_canary_is_promoted_and_a_worse_one_rolled_back():
    better = [_run(seed, p_canary=0.8)[0] for seed in range(40)]
    worse = [_run(seed, p_canary=0.2)[0] for seed in range(40)]
    assert better.count("promote") >= 38 and "rollback" not in better
    assert worse.count("rollback") >= 38 and "promote" not in worse
