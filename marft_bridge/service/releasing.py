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
                                       on_promoted=accept, on_rolled_back=lambda rel: restore())
        self._candidates: dict[str, dict[str, int]] = {}

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
        return rel

    def rollback(self, reason: str) -> dict[str, int] | None:
        """The whole team back to the previous stable release; None when there is none to go back to."""
        st = self.store.state()
        if not [r for r in st.history if r != st.stable]:
            return None
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
