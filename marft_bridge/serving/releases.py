"""Team releases: immutable sets {agent: adapter version}, promoted, canaried and rolled back as one.

Agents trained together (MARFT's sequential update conditions each agent on the others' new
policies) ship together: a release names the whole team. It lives beside the registry::

    <registry>/.releases/r<N>.json    one release, written once (never rewritten)
    <registry>/.releases/state.json   which release is stable, the promotion history, the canary,
                                      an operation in progress (crash recovery), probe results
    <registry>/.releases/routing.json what capture routes episodes by (``capture.routing``)

A release keeps its id (``r<N>``), the service round that made it, its parent (the stable release
it was made against), the gate score it earned and the live score its parent earned in the same
gate. Promotions are events, kept in the state with who made them and why.

``promote`` and ``rollback`` move every agent of the team in one step: the state first records the
operation (``pending``), then each agent whose version differs is loaded into the servers and made
current in the registry, then the state records the result. A kill in between leaves ``pending``,
which ``recover`` applies again (idempotent: an agent already at its version is skipped).

A canary serves a release to a share of episodes under served names ``<agent>@r<N>`` beside the
stable release's (``start_canary``); while it runs, every new episode is pinned to one of the two
(``capture.routing``). The served names of a release stay loaded until two routing changes later, so
episodes pinned to it finish on it; without a canary the plain names serve the stable release.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..release_names import RELEASE_ID, RELEASES_DIR, ROUTING_FILE, served_name
from ..durable import write_json
from .adapter_files import AdapterError
from .publishers import Publisher
from .registry import AdapterRegistry

STATE = "state.json"


class Release(BaseModel):
    """One team release (immutable once written)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    number: int = Field(ge=1)
    versions: dict[str, int]
    parent: str | None = None
    round: int | None = None
    round_id: str | None = None
    gate_score: float | None = None
    live_score: float | None = None  # the parent's score in the same gate
    created_at: str
    created_by: str = "user"


class ReleaseState(BaseModel):
    stable: str | None = None
    history: list[str] = Field(default_factory=list)  # releases made stable, oldest first
    canary: dict[str, Any] | None = None  # {"id", "fraction", "started"}
    pending: dict[str, Any] | None = None  # {"op": "promote" | "rollback", "release", "by", "reason"}
    promotions: list[dict[str, Any]] = Field(default_factory=list)  # {"release", "op", "by", "reason", "at"}
    served: list[str] = Field(default_factory=list)  # releases whose <agent>@r<N> names are loaded
    probes: dict[str, dict[str, Any]] = Field(default_factory=dict)  # release -> last verify result


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


class ReleaseStore:
    """The releases of one adapter registry."""

    def __init__(self, registry: AdapterRegistry | str | Path):
        self.registry = registry if isinstance(registry, AdapterRegistry) else AdapterRegistry(registry)
        self.dir = self.registry.root / RELEASES_DIR
        self.dir.mkdir(exist_ok=True)

    # -- reading ---------------------------------------------------------------------------------
    def ids(self) -> list[str]:
        found = (p.stem for p in self.dir.glob("r*.json") if RELEASE_ID.match(p.stem))
        return sorted(found, key=lambda r: int(r[1:]))

    def get(self, release_id: str) -> Release:
        if not isinstance(release_id, str) or not RELEASE_ID.match(release_id):
            raise AdapterError(f"{release_id!r} is not a release id (r<N>)")
        p = self.dir / f"{release_id}.json"
        if not p.is_file():
            raise AdapterError(f"release {release_id} does not exist in {self.registry.root}")
        return Release.model_validate_json(p.read_bytes())

    def list(self) -> list[Release]:
        return [self.get(r) for r in self.ids()]

    def state(self) -> ReleaseState:
        p = self.dir / STATE
        return ReleaseState.model_validate_json(p.read_bytes()) if p.is_file() else ReleaseState()

    def stable(self) -> Release | None:
        s = self.state().stable
        return self.get(s) if s else None

    def of_round(self, round_id: str) -> Release | None:
        """The release a service round made (a restart after a kill adopts it)."""
        found = [r for r in self.list() if r.round_id == round_id]
        return found[-1] if found else None

    def diff(self, a: str, b: str) -> list[dict[str, Any]]:
        """Per agent: its version in ``a`` and ``b``, whether it changed, and each manifest's sha256."""
        ra, rb = self.get(a), self.get(b)
        rows = []
        for agent in sorted(set(ra.versions) | set(rb.versions)):
            va, vb = ra.versions.get(agent), rb.versions.get(agent)
            rows.append({"agent": agent, a: va, b: vb, "changed": va != vb,
                         f"{a}_sha256": self._sha(agent, va), f"{b}_sha256": self._sha(agent, vb)})
        return rows

    def _sha(self, agent: str, version: int | None) -> str | None:
        return self.registry.manifest(agent, version).sha256 if version is not None else None

    # -- writing ---------------------------------------------------------------------------------
    def create(self, versions: dict[str, int], *, parent: str | None = None, round: int | None = None,
               round_id: str | None = None, gate_score: float | None = None, live_score: float | None = None,
               created_by: str = "user") -> Release:
        """A new release of ``versions`` (each must exist in the registry). ``parent`` defaults to the
        stable release; with a ``round_id`` already used, that round's release is returned instead."""
        if not versions:
            raise AdapterError("a release needs at least one agent version")
        for agent, v in versions.items():
            self.registry.path(agent, v)  # raises for an unknown agent or version
        if round_id and (done := self.of_round(round_id)) is not None:
            return done
        if parent is None:
            parent = self.state().stable
        with self._locked():
            while True:  # O_EXCL-style: a concurrent creator that takes N first makes us try N+1
                n = max((int(r[1:]) for r in self.ids()), default=0) + 1
                rel = Release(id=f"r{n}", number=n, versions={a: int(v) for a, v in versions.items()},
                              parent=parent, round=round, round_id=round_id, gate_score=gate_score,
                              live_score=live_score, created_at=_now(), created_by=created_by)
                tmp = self.dir / f".r{n}.{os.getpid()}.tmp"
                write_json(tmp, rel.model_dump(mode="json"))
                try:
                    os.link(tmp, self.dir / f"r{n}.json")
                    return rel
                except FileExistsError:
                    continue
                finally:
                    tmp.unlink(missing_ok=True)

    def promote(self, release_id: str, publishers: list[Publisher] = (), *, by: str = "user",
                reason: str = "") -> Release:
        """Make ``release_id`` the stable release: every agent of it current and loaded, in one step."""
        rel = self.get(release_id)
        with self._locked():
            state = self.state()
            state.pending = {"op": "promote", "release": rel.id, "by": by, "reason": reason}
            self._write(state)
            return self._finish(state, publishers)

    def rollback(self, publishers: list[Publisher] = (), *, by: str = "user", reason: str = "") -> Release:
        """Return the whole team to the release that was stable before the current one."""
        with self._locked():
            state = self.state()
            history = [r for r in state.history if r != state.stable] if state.stable else list(state.history)
            if not history:
                raise AdapterError("no earlier stable release to roll back to")
            state.pending = {"op": "rollback", "release": history[-1], "by": by, "reason": reason}
            self._write(state)
            return self._finish(state, publishers)

    def recover(self, publishers: list[Publisher] = ()) -> str | None:
        """After a kill inside ``promote``/``rollback``: finish it. Returns what was done (None: nothing)."""
        with self._locked():
            state = self.state()
            if state.pending is None:
                return None
            op = dict(state.pending)
            self._finish(state, publishers)
            return f"finished the interrupted {op['op']} to {op['release']}"

    def _finish(self, state: ReleaseState, publishers: list[Publisher]) -> Release:
        op = state.pending
        rel = self.get(op["release"])
        self._serve_team(rel, publishers)
        if op["op"] == "rollback":
            while state.history and state.history[-1] != rel.id:
                state.history.pop()
        if not state.history or state.history[-1] != rel.id:
            state.history.append(rel.id)
        state.stable = rel.id
        if state.canary is not None:  # a promotion or rollback ends any canary
            state.canary = None
        state.promotions.append({"release": rel.id, "op": op["op"], "by": op["by"], "reason": op["reason"],
                                 "at": _now()})
        state.pending = None
        self._route(state, publishers)
        self._write(state)
        return rel

    def _serve_team(self, rel: Release, publishers: list[Publisher]) -> None:
        """Every agent of ``rel`` current in the registry and loaded by every server; the registry marks
        an agent current only once the first server accepted it (``AdapterRegistry.promote``)."""
        first, rest = (publishers[0], publishers[1:]) if publishers else (None, [])
        for agent, v in rel.versions.items():
            if self.registry.current(agent) == v:
                if first is None:
                    continue
                first.load(agent, self.registry.path(agent, v), version=v)  # idempotent: a resumed swap
            else:
                self.registry.promote(agent, v, publisher=first)
            for pub in rest:
                pub.load(agent, self.registry.path(agent, v), version=v)

    # -- canary ----------------------------------------------------------------------------------
    def start_canary(self, release_id: str, fraction: float, publishers: list[Publisher] = ()) -> dict:
        """Serve ``release_id`` to a ``fraction`` of episodes beside the stable release (both under
        their served names); capture routes by the table this writes."""
        if not 0 < fraction < 1:
            raise AdapterError(f"canary fraction must be in (0, 1), got {fraction}")
        rel = self.get(release_id)
        with self._locked():
            state = self.state()
            if state.stable is None:
                raise AdapterError("no stable release yet: promote one before a canary")
            if state.canary is not None and state.canary["id"] != rel.id:
                raise AdapterError(f"canary {state.canary['id']} is running; finish it first")
            if state.canary is None:
                state.canary = {"id": rel.id, "fraction": fraction, "started": _now()}
            self._route(state, publishers)
            self._write(state)
            return dict(state.canary)

    def end_canary(self, publishers: list[Publisher] = (), *, by: str = "user", reason: str = "") -> str | None:
        """Stop the canary without promoting it (the stable release keeps every episode); returns its id."""
        with self._locked():
            state = self.state()
            if state.canary is None:
                return None
            rid = state.canary["id"]
            state.canary = None
            state.promotions.append({"release": rid, "op": "canary_rollback", "by": by, "reason": reason,
                                     "at": _now()})
            self._route(state, publishers)
            self._write(state)
            return rid

    def adopt(self, versions: dict[str, int], *, by: str = "user", reason: str = "adopted the live versions",
              **fields: Any) -> Release:
        """Record ``versions`` (already live: nothing is loaded) as a release and make it stable."""
        rel = self.create(versions, created_by=by, **fields)
        with self._locked():
            state = self.state()
            state.stable = rel.id
            if not state.history or state.history[-1] != rel.id:
                state.history.append(rel.id)
            state.promotions.append({"release": rel.id, "op": "adopt", "by": by, "reason": reason, "at": _now()})
            self._write(state)
        return rel

    def _route(self, state: ReleaseState, publishers: list[Publisher]) -> None:
        """While a canary runs, load the served names of the stable and the canary release and route
        episodes between them; without one, the table is empty (the plain names serve the stable
        release). Served names two tables old are unloaded: episodes pinned by the previous table
        finish on the release they started on."""
        live = [state.stable, state.canary["id"]] if state.canary else []
        table: dict[str, Any] = {}
        for key, rid in zip(("stable", "canary"), live):
            rel = self.get(rid)
            for agent, v in rel.versions.items():
                for pub in publishers:
                    pub.load(served_name(agent, rel.id), self.registry.path(agent, v), version=v)
            table[key] = {"id": rel.id, "versions": rel.versions}
        if state.canary:
            table["canary"]["fraction"] = state.canary["fraction"]
        previous = self._table()
        keep = set(live) | {t["id"] for t in previous.values() if isinstance(t, dict) and "id" in t}
        for rid in [r for r in state.served if r not in keep]:
            for agent in self.get(rid).versions:
                for pub in publishers:
                    try:
                        pub.unload(served_name(agent, rid))
                    except Exception:  # noqa: BLE001 - a server restarted since has none to unload
                        pass
        state.served = [r for r in dict.fromkeys(state.served + live) if r in keep]
        write_json(self.dir / ROUTING_FILE, table)

    def _table(self) -> dict:
        p = self.dir / ROUTING_FILE
        return json.loads(p.read_text()) if p.is_file() else {}

    def record_probe(self, release_id: str, result: dict[str, Any]) -> None:
        with self._locked():
            state = self.state()
            state.probes[release_id] = result
            self._write(state)

    # -- state file ------------------------------------------------------------------------------
    @contextmanager
    def _locked(self):
        """One writer at a time across processes (the state is read-modify-write)."""
        with open(self.dir / ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _write(self, state: ReleaseState) -> None:
        write_json(self.dir / STATE, state.model_dump(mode="json"))


__all__ = ["Release", "ReleaseState", "ReleaseStore"]
