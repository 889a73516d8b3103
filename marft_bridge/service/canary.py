"""The canary's sequential test: may the service look at the live rewards at every poll and still
promote a release no better than the stable one at most ``alpha`` of the time?

A fixed-sample test checked at every poll inflates its false-positive rate (Johari et al., "Peeking
at A/B tests", KDD 2017). This is their mixture SPRT (mSPRT) for the difference of two means, read
as an always-valid confidence interval (a confidence sequence, Howard et al., Ann. Statist. 2021):

    Δ̂ = mean(canary) − mean(stable)            the estimate
    V  = s²_c / n_c + s²_s / n_s                its variance (sample variances, plugged in)
    Λ  = sqrt(V / (V + τ²)) · exp(τ² (Δ̂ − Δ₀)² / (2 V (V + τ²)))     mSPRT, prior Δ ~ N(Δ₀, τ²)

Λ is a martingale under Δ = Δ₀ (for Gaussian means; the CLT otherwise), so by Ville's inequality
P(Λ ever reaches 1/α) ≤ α. The Δ₀ it never rejects form the interval, valid at every poll at once:

    Δ̂ ± sqrt( V (V + τ²) / τ² · log((V + τ²) / (V α²)) )

Decision: promote when the whole interval lies above −margin (the canary is not worse by more
than ``margin``), roll back when it lies below −margin, otherwise keep collecting; at the
deadline, an undecided canary is rolled back (the stable release stays: no evidence, no change).
``tests/test_canary_sequential.py`` checks by seeded simulation, peeking at every poll, that equal
releases are promoted at most ``alpha`` of the time with margin 0 (where a naive z-test is not).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Literal

from ..always_valid import halfwidth, mean_interval, mean_var
from ..release_names import release_of

Decision = Literal["promote", "rollback", "continue"]


@dataclass(frozen=True)
class Interval:
    estimate: float  # canary mean − stable mean
    lo: float
    hi: float
    n_canary: int
    n_stable: int
    mean_canary: float
    mean_stable: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Moments:
    """Count, sum and sum of squares of rewards: updated in O(1) per episode, so a poll is O(1)."""

    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    @classmethod
    def of(cls, xs) -> Moments:
        if isinstance(xs, Moments):
            return xs
        m = cls()
        for x in xs:
            m.add(x)
        return m

    def add(self, x: float) -> None:
        self.n, self.total, self.total_sq = self.n + 1, self.total + x, self.total_sq + x * x

    def mean_var(self) -> tuple[float, float]:
        """The mean and the (n − 1) sample variance, floored at always_valid.MIN_VARIANCE."""
        return mean_var(self.n, self.total, self.total_sq)


def difference_interval(canary, stable, alpha: float, tau: float) -> Interval | None:
    """The always-valid interval for mean(canary) − mean(stable) (reward lists or ``Moments``); None
    before two rewards each."""
    canary, stable = Moments.of(canary), Moments.of(stable)
    if canary.n < 2 or stable.n < 2:
        return None
    mc, vc = canary.mean_var()
    ms, vs = stable.mean_var()
    v = vc / canary.n + vs / stable.n
    est, h = mc - ms, halfwidth(v, alpha, tau)
    return Interval(est, est - h, est + h, canary.n, stable.n, mc, ms)


def decide(iv: Interval | None, *, margin: float, min_episodes: int, deadline: bool) -> tuple[Decision, str]:
    """What the canary's interval says now (``deadline``: the canary's time is up)."""
    if iv is None or iv.n_canary < min_episodes:
        n = 0 if iv is None else iv.n_canary
        if deadline:
            return "rollback", f"deadline reached with {n} rewarded canary episodes (< {min_episodes}); stable stays"
        return "continue", f"{n} of {min_episodes} rewarded canary episodes"
    text = (f"canary − stable = {iv.estimate:+.4f}, always-valid interval [{iv.lo:+.4f}, {iv.hi:+.4f}] "
            f"on {iv.n_canary} canary / {iv.n_stable} stable episodes")
    if iv.lo > -margin:
        return "promote", f"{text} lies above −margin {-margin:+.4f}: not worse"
    if iv.hi < -margin:
        return "rollback", f"{text} lies below −margin {-margin:+.4f}: worse"
    if deadline:
        return "rollback", f"{text} still contains −margin {-margin:+.4f} at the deadline; stable stays"
    return "continue", f"{text} contains −margin {-margin:+.4f}"


def naive_z_decides(canary, stable, alpha: float, margin: float) -> bool:
    """A fixed-sample one-sided z-test "canary not worse" (for the simulation's contrast only)."""
    canary, stable = Moments.of(canary), Moments.of(stable)
    if canary.n < 2 or stable.n < 2:
        return False
    mc, vc = canary.mean_var()
    ms, vs = stable.mean_var()
    z = (mc - ms + margin) / math.sqrt(vc / canary.n + vs / stable.n)
    from statistics import NormalDist

    return z > NormalDist().inv_cdf(1 - alpha)


# -- the service's canary ------------------------------------------------------------------------

KEEP_LIVE = 2000  # rewarded episodes kept per release for drift (the newest)
KEEP_RELEASES = 5  # releases whose live rewards are kept


class CanaryRunner:
    """One canary at a time: start it, file live episodes under canary or stable, decide.

    Everything it keeps is in ``state.canary`` (the service's durable state, saved by ``save``), and
    the release store holds the routing, so a service killed mid-canary resumes the same canary.
    ``on_promoted(release)`` / ``on_rolled_back(release)`` let the service accept or drop the trained
    checkpoint; both may run twice after a kill (they must be idempotent)."""

    def __init__(self, cfg: Any, releases: Any, publishers: list, state: Any, *, save: Callable[[], None],
                 log: Callable[..., dict], on_promoted: Callable[[Any], None],
                 on_rolled_back: Callable[[Any], None]):
        self.cfg, self.releases, self.publishers, self.state = cfg, releases, publishers, state
        self.save, self.log, self.on_promoted, self.on_rolled_back = save, log, on_promoted, on_rolled_back

    def begin(self, release: Any) -> dict:
        """Serve ``release`` to the canary share (idempotent: a resumed start keeps what was filed)."""
        running = self.state.canary
        self.releases.start_canary(release.id, self.cfg.fraction, self.publishers)
        if running is None or running["release"] != release.id:
            self.state.canary = {"release": release.id, "stable": release.parent, "started": _now(),
                                 "rewards": {"canary": {}, "stable": {}}}
            self.save()
        return self.state.canary

    def file(self, ep: Any) -> None:
        """Count a rewarded live episode for the canary or the stable release (by what served it)."""
        c, reward = self.state.canary, ep.team_reward()
        if c is None or reward is None or _aware(ep.started_at) < datetime.fromisoformat(c["started"]):
            return  # an episode begun before the canary: routed by the previous table
        rid = getattr(ep, "release", None) or (ep.metadata or {}).get("release")
        side = "canary" if rid == c["release"] else "stable" if rid == c["stable"] else None
        if side is not None:
            c["rewards"][side][ep.id] = float(reward)

    def interval(self) -> Interval | None:
        r = self.state.canary["rewards"]
        return difference_interval(list(r["canary"].values()), list(r["stable"].values()), self.cfg.alpha,
                                   self.cfg.effect)

    def check(self, now: datetime | None = None) -> dict:
        """Decide on the running canary: promote, roll back, or keep collecting."""
        c = self.state.canary
        rel = self.releases.get(c["release"])
        done = self._reconcile(rel)
        if done is not None:
            return done
        now = now or datetime.now(timezone.utc)
        deadline = now - datetime.fromisoformat(c["started"]) >= timedelta(hours=self.cfg.max_hours)
        iv = self.interval()
        decision, reason = decide(iv, margin=self.cfg.margin, min_episodes=self.cfg.min_episodes, deadline=deadline)
        details = {"release": rel.id, "stable": c["stable"], "interval": iv.as_dict() if iv else None}
        if decision == "continue":
            return {"decision": "canary", "reason": reason, **details}
        if decision == "promote":
            self.releases.promote(rel.id, self.publishers, by="service:canary", reason=reason)
        else:
            self.releases.end_canary(self.publishers, by="service:canary", reason=reason)
        return self._finish(rel, decision, reason, details)

    def stop(self, reason: str) -> dict | None:
        """Stop the canary at once (a failed probe): the stable release keeps every episode."""
        c = self.state.canary
        if c is None:
            return None
        rel = self.releases.get(c["release"])
        self.releases.end_canary(self.publishers, by="service:probe", reason=reason)
        return self._finish(rel, "rollback", reason, {"release": rel.id, "stable": c["stable"]})

    def _reconcile(self, rel: Any) -> dict | None:
        """A kill after the release store acted but before the service recorded it: record it now."""
        rs = self.releases.state()
        if rs.canary is not None and rs.canary["id"] == rel.id:
            return None
        decision = "promote" if rs.stable == rel.id else "rollback"
        last = [p for p in rs.promotions if p["release"] == rel.id]
        reason = (last[-1]["reason"] if last else "") + " (recorded after a restart)"
        return self._finish(rel, decision, reason, {"release": rel.id, "stable": self.state.canary["stable"]})

    def _finish(self, rel: Any, decision: str, reason: str, details: dict) -> dict:
        (self.on_promoted if decision == "promote" else self.on_rolled_back)(rel)
        self.state.canary = None
        self.save()
        versions = self.releases.get(self.releases.state().stable).versions
        return self.log(decision, f"canary {rel.id}: {reason}", versions=versions, **details)


def drift(live: dict[str, dict[str, float]], releases: Any, alpha: float, tau: float, margin: float) -> list[dict]:
    """Per release: the live reward (always-valid interval) beside the gate score it was promoted
    on; ``flag`` when the live reward is below the gate score by more than ``margin``."""
    rows = []
    for rid, rewards in sorted(live.items(), key=lambda kv: int(kv[0][1:])):
        try:
            rel = releases.get(rid)
        except Exception:  # noqa: BLE001 - a release removed by hand: nothing to compare with
            continue
        iv = mean_interval(list(rewards.values()), alpha, tau)
        row = {"release": rid, "versions": rel.versions, "gate_score": rel.gate_score, "episodes": len(rewards),
               "live_reward": iv[0] if iv else None, "interval": [iv[1], iv[2]] if iv else None}
        row["flag"] = bool(iv and rel.gate_score is not None and iv[0] < rel.gate_score - margin)
        rows.append(row)
    return rows


def file_live(live: dict[str, dict[str, float]], ep: Any, candidates: dict[str, dict[str, int]]) -> None:
    """Keep ``ep``'s team reward under the release that served it (drift), the newest KEEP_LIVE each."""
    reward, rid = ep.team_reward(), release_of(ep, candidates)
    if reward is None or rid is None:
        return
    bucket = live.setdefault(rid, {})
    bucket[ep.id] = float(reward)
    while len(bucket) > KEEP_LIVE:
        bucket.pop(next(iter(bucket)))
    for old in sorted(live, key=lambda r: int(r[1:]))[:-KEEP_RELEASES]:  # the state file stays small
        del live[old]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


__all__ = ["CanaryRunner", "Interval", "Moments", "decide", "difference_interval", "drift", "file_live",
           "halfwidth", "mean_interval", "naive_z_decides", "release_of"]
