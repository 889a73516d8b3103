"""The service's side of team releases: every round's promotion is a release (``serving.releases``);
with a ``canary:`` block a gated release first serves a share of live episodes (``service.canary``);
rollbacks move the whole team; ``status`` shows each release's live reward beside its gate score."""

from __future__ import annotations

from typing import Any, Callable

from .canary import CanaryRunner, drift, file_live


class TeamReleases:
    """Releases for one ``ContinuousService`` (its registry, servers, state and decision log)."""

    def __init__(self, config: Any, registry: Any, publishers: list, state: Any, *, save: Callable[[], None],
                 log: Callable[..., dict], accept: Callable[[Any], None], restore: Callable[[], None]):
        from ..serving.releases import ReleaseStore

        self.config, self.registry, self.publishers, self.state = config, registry, publishers, state
        self.store = ReleaseStore(registry)
        self.canary = None
        if config.canary is not None:
            self.canary = CanaryRunner(config.canary, self.store, publishers, state, save=save, log=log,
                                       on_promoted=lambda rel: (self.probe_due(), accept(rel)),
                                       on_rolled_back=lambda rel: (self.probe_due(), restore()))
        self._candidates: dict[str, dict[str, int]] = {}
        self.log = log
        self._probed_at: float | None = None  # monotonic time of the last probe (None: due now)

    def running(self) -> bool:
        return self.canary is not None and self.state.canary is not None

    def live_versions(self) -> dict[str, int | None]:
        return {a: self.registry.current(a) for a in self.config.agents}

    def adopt(self, round_id: str | None, round: int | None, summary: dict | None) -> Any:
        """Record the team now live (just promoted agent by agent) as the stable release; a round
        resumed after a kill gets the release it already made."""
        done = self.store.of_round(round_id) if round_id else None
        stable = self.store.stable()
        if done is not None and stable is not None and stable.id == done.id:
            return done
        summary = summary or {}
        self.probe_due()
        return self.store.adopt({a: v for a, v in self.live_versions().items() if v is not None}, by="service",
                                reason="promoted after the gate", round=round, round_id=round_id,
                                gate_score=summary.get("candidate_score"), live_score=summary.get("live_score"))

    def stable(self) -> Any:
        """The stable release, adopting the live versions as one when there is none yet."""
        return self.store.stable() or self.adopt(None, None, None)

    def start_canary(self, versions: dict[str, int], journal: dict) -> Any:
        """Make the round's published ``versions`` (the rest of the team as in the stable release) a
        release and serve it to the canary share. Idempotent, for a resumed round."""
        stable = self.stable()
        summary = journal["summary"]
        rel = self.store.create({**stable.versions, **versions}, parent=stable.id, round=journal["round"],
                                round_id=journal["id"], gate_score=summary.get("candidate_score"),
                                live_score=summary.get("live_score"), created_by="service")
        self.canary.begin(rel)
        self.probe_due()
        return rel

    def rollback(self, reason: str) -> dict[str, int] | None:
        """The whole team back to the previous stable release; None when there is none to go back to."""
        st = self.store.state()
        if not [r for r in st.history if r != st.stable]:
            return None
        self.probe_due()
        return dict(self.store.rollback(self.publishers, by="service:watch", reason=reason).versions)

    def begin_poll(self) -> None:
        """The releases episodes may be filed under (read once per poll)."""
        st = self.store.state()
        ids = list(dict.fromkeys(st.history[-3:] + ([st.canary["id"]] if st.canary else [])))
        self._candidates = {rid: self.store.get(rid).versions for rid in ids}

    def file(self, ep: Any) -> None:
        if self.canary is not None:
            self.canary.file(ep)
        file_live(self.state.live, ep, self._candidates)

    # -- identity probe ------------------------------------------------------------------------
    def record_probes(self, versions: dict[str, int]) -> None:
        """Record what each newly published version answers the probe (reference forward)."""
        if self.config.probe is None:
            return
        from ..serving.probe import read_expected, record_expected

        for agent, v in versions.items():
            if read_expected(self.registry.root, agent, v) is None:
                record_expected(self.registry, agent, v, self.config.base_model, max_tokens=self.config.probe.max_tokens)

    def probe_due(self) -> None:
        """A swap happened: probe at the next poll."""
        self._probed_at = None

    def maybe_probe(self) -> dict | None:
        """Probe the stable release (plain names) and the canary (served names) on the first server,
        after a swap or every ``every_minutes``. A mismatch stops the canary and, when the stable
        release failed, moves traffic back to the last release that passed; returns that decision."""
        import time

        cfg = self.config.probe
        url = getattr(self.publishers[0], "url", None) if self.publishers else None
        if cfg is None or url is None:
            return None
        if self._probed_at is not None and time.monotonic() - self._probed_at < cfg.every_minutes * 60:
            return None
        from ..serving.probe import verify_release

        self._probed_at = time.monotonic()
        st, key = self.store.state(), getattr(self.publishers[0], "api_key", None)
        checks = [(st.stable, False)] + ([(st.canary["id"], True)] if st.canary else [])
        results = {rid: verify_release(self.store, rid, url, api_key=key, served_names=served, tolerance=cfg.tolerance)
                   for rid, served in checks if rid}
        failed = {rid: {a: r["reason"] for a, r in res["agents"].items() if not r["ok"]}
                  for rid, res in results.items() if not res["ok"]}
        if not failed:
            return None
        reason = "identity probe failed: " + "; ".join(f"{rid}: {bad}" for rid, bad in failed.items())
        self.log("unhealthy", reason, server=url, failed=failed)
        row = self.canary.stop(reason) if self.canary is not None else None
        if st.stable in failed:
            verified = [r for r in self.store.state().history
                        if r != st.stable and (self.store.state().probes.get(r) or {}).get("ok")]
            if verified:
                rel = self.store.promote(verified[-1], self.publishers, by="service:probe", reason=reason)
                row = self.log("rollback", f"to {rel.id}, the last verified release: {reason}", versions=rel.versions,
                               release=rel.id)
        self.probe_due()
        return row or {"decision": "unhealthy", "reason": reason, "failed": failed}

    def status(self) -> dict:
        c = self.config.canary
        alpha, tau = (c.alpha, c.effect) if c else (0.05, 0.1)
        st = self.store.state()
        out: dict[str, Any] = {"stable": st.stable, "canary": None,
                               "releases": drift(self.state.live, self.store, alpha, tau, self.config.drift_margin)}
        if self.running():
            iv = self.canary.interval()
            out["canary"] = {k: v for k, v in self.state.canary.items() if k != "rewards"}
            out["canary"]["interval"] = iv.as_dict() if iv else None
        return out


__all__ = ["TeamReleases"]
