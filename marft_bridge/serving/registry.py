"""Versioned adapter registry: ``<root>/<agent>/v<N>/`` holds one immutable adapter version
(``adapter_model.safetensors``, ``adapter_config.json``, ``manifest.json``); ``<root>/<agent>/state.json``
records which version is current and the promotion history that ``rollback`` walks back.

Every version lives in its own directory and is never rewritten, so a server can load version N+1
while N keeps serving, and vLLM never sees changed weights under a path it has cached.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from ..registry_state import AGENT_NAME, STATE_FILE, is_agent_name, live_versions
from ..registry_state import read_state_file as read_state
from .adapter_files import CONFIG_FILE, WEIGHTS_FILE, AdapterError, base_fingerprint, find_adapter_dir, inspect_adapter

if TYPE_CHECKING:
    from .publishers import Publisher

MANIFEST_FILE = "manifest.json"
VERSION_DIR = re.compile(r"^v([1-9][0-9]{0,8})\Z")


class AdapterManifest(BaseModel):
    """What is known about one published adapter version."""

    agent: str
    version: int
    parent: int | None = None
    created_at: str
    metrics: dict[str, float] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict)
    config_hash: str
    base_model: str | None = None
    base_fingerprint: str | None = None
    rank: int
    target_modules: list[str]
    sha256: str  # of adapter_model.safetensors
    config_sha256: str | None = None  # of adapter_config.json (None: published before it was recorded)
    # The publishing service round (``marft service``): a restart after a kill finds the versions an
    # interrupted round already published and adopts them instead of publishing again.
    round_id: str | None = None


class AdapterVersion(BaseModel):
    """A row of ``AdapterRegistry.list()``."""

    manifest: AdapterManifest
    path: str
    current: bool


def check_agent_name(agent: str) -> str:
    if not is_agent_name(agent):
        raise AdapterError(f"invalid agent name {agent!r}: use letters, digits, '_', '-', '.' (at most 64)")
    return agent


def state_file(root: str | Path, agent: str) -> Path:
    """Where ``agent``'s state (current version, promotion history) lives under registry ``root``."""
    return Path(root) / check_agent_name(agent) / STATE_FILE


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(version_dir: str | Path) -> AdapterManifest:
    """A version directory's manifest; ``AdapterError`` when it is missing or not a manifest."""
    path = Path(version_dir) / MANIFEST_FILE
    try:
        return AdapterManifest.model_validate_json(path.read_bytes())
    except (OSError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        raise AdapterError(f"{path} is not a readable manifest ({type(e).__name__})") from None


class AdapterRegistry:
    """Versioned per-agent LoRA adapters under one root directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._live = None  # the shared state-file reader of this root, on first ``live_version``

    # -- reading ---------------------------------------------------------------------------------
    def agents(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and AGENT_NAME.match(p.name))

    def versions(self, agent: str) -> list[int]:
        d = self.root / check_agent_name(agent)
        if not d.is_dir():
            return []
        found = (VERSION_DIR.match(p.name) for p in d.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, agent: str, version: int | None = None) -> Path:
        """Directory of ``agent``'s version (default: the current one)."""
        if version is None:
            version = self.current(agent)
            if version is None:
                raise AdapterError(f"agent {agent!r} has no current adapter version in {self.root}")
        p = self.root / check_agent_name(agent) / f"v{int(version)}"
        if not (p / MANIFEST_FILE).is_file():
            raise AdapterError(f"agent {agent!r} has no version {version} in {self.root}")
        return p

    def manifest(self, agent: str, version: int | None = None) -> AdapterManifest:
        return read_manifest(self.path(agent, version))

    def current(self, agent: str) -> int | None:
        return self._state(agent)["current"]

    def live_version(self, agent: str) -> int | None:
        """``current`` as capture reads it (``seams.LiveVersions``): None for any name the registry
        cannot hold (capture asks about every model name a call sends), re-read only when the
        agent's state file changes."""
        if self._live is None:
            self._live = live_versions(self.root)
        return self._live.live_version(agent)

    def history(self, agent: str) -> list[int]:
        """The versions promoted, oldest first, as ``rollback`` walks them back."""
        return list(self._state(agent)["history"])

    def list(self, agent: str | None = None) -> list[AdapterVersion]:
        rows = []
        for a in [agent] if agent else self.agents():
            cur = self.current(a)
            for v in self.versions(a):
                rows.append(AdapterVersion(manifest=self.manifest(a, v), path=str(self.path(a, v)), current=v == cur))
        return rows

    def version_of_round(self, agent: str, round_id: str) -> int | None:
        """The version of ``agent`` that publishing round ``round_id`` made (None: it made none)."""
        found = [v for v in self.versions(agent) if self.manifest(agent, v).round_id == round_id]
        return found[-1] if found else None

    def resolve(self, path: str | Path) -> tuple[str, int]:
        """``(agent, version)`` of a version directory, refusing anything outside the registry root:
        the directory and every file in it are resolved first (symlinks followed), so no link can
        point out of the registry."""
        try:
            p = Path(path).expanduser().resolve(strict=True)
        except (OSError, RuntimeError, ValueError):  # ValueError: a NUL byte in the path
            raise AdapterError(f"adapter path {path!r} does not exist") from None
        try:
            rel = p.relative_to(self.root)
        except ValueError:
            raise AdapterError(f"adapter path {path} is outside the registry {self.root}; refusing to load it") from None
        m = VERSION_DIR.match(rel.parts[1]) if len(rel.parts) == 2 else None
        if m is None or not AGENT_NAME.match(rel.parts[0]):
            raise AdapterError(f"adapter path {path} is not a version directory <registry>/<agent>/v<N>")
        if not (p / MANIFEST_FILE).is_file():
            raise AdapterError(f"adapter path {path} has no {MANIFEST_FILE}; publish it with the registry")
        for entry in p.iterdir():
            try:
                target = entry.resolve(strict=True)
            except (OSError, RuntimeError):
                raise AdapterError(f"{entry} cannot be read (a broken link?); refusing to load {path}") from None
            if not target.is_relative_to(self.root):
                raise AdapterError(f"{entry} links to {target}, outside the registry {self.root}; refusing to load it")
        return rel.parts[0], int(m.group(1))

    def check_files(self, version_dir: str | Path, weights: bytes, config: bytes,
                    manifest: AdapterManifest | None = None) -> None:
        """Refuse weights or a config (the bytes about to be loaded) that differ from what was
        published: the version's manifest (read here unless the caller has it) keeps their sha256."""
        manifest = manifest or read_manifest(version_dir)
        for name, data, want in ((WEIGHTS_FILE, weights, manifest.sha256), (CONFIG_FILE, config, manifest.config_sha256)):
            if want is not None and hashlib.sha256(data).hexdigest() != want:
                raise AdapterError(f"{version_dir}: {name} does not match the sha256 in its {MANIFEST_FILE} "
                                   "(changed after it was published); refusing to load it")

    # -- writing ---------------------------------------------------------------------------------
    def publish(
        self,
        agent: str,
        source_dir: str | Path,
        *,
        metrics: dict[str, float] | None = None,
        parent: int | None = None,
        config: dict[str, Any] | None = None,
        promote: bool = False,
        publisher: Publisher | None = None,
        round_id: str | None = None,
    ) -> int:
        """Copy a peft adapter directory (``source_dir`` or ``source_dir/<agent>``) into a new version
        ``v<N>`` and return N. The adapter is vetted first; a bad one raises ``AdapterError`` and
        leaves the registry unchanged. ``parent`` defaults to the current version."""
        check_agent_name(agent)
        src = find_adapter_dir(source_dir, agent)
        info = inspect_adapter(src)
        if parent is None:
            parent = self.current(agent)
        elif parent not in self.versions(agent):
            raise AdapterError(f"parent version {parent} of agent {agent!r} does not exist")
        config = dict(config or {})
        adapter_config = json.loads((src / CONFIG_FILE).read_text())
        config_hash = hashlib.sha256(
            json.dumps({"adapter": adapter_config, "train": config}, sort_keys=True, default=str).encode()
        ).hexdigest()[:16]
        agent_dir = self.root / agent
        agent_dir.mkdir(exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".publish-", dir=agent_dir))
        try:
            shutil.copyfile(src / WEIGHTS_FILE, tmp / WEIGHTS_FILE)
            shutil.copyfile(src / CONFIG_FILE, tmp / CONFIG_FILE)
            while True:  # a concurrent publisher may take N first: the rename then fails and we try N+1
                version = max(self.versions(agent), default=0) + 1
                manifest = AdapterManifest(
                    agent=agent,
                    version=version,
                    parent=parent,
                    created_at=datetime.now(timezone.utc).isoformat(),
                    metrics=_finite_numbers(metrics),
                    config=config,
                    config_hash=config_hash,
                    base_model=info.base_model,
                    base_fingerprint=base_fingerprint(info.base_model) if info.base_model else None,
                    rank=info.rank,
                    target_modules=list(info.target_modules),
                    sha256=_sha256(tmp / WEIGHTS_FILE),
                    config_sha256=_sha256(tmp / CONFIG_FILE),
                    round_id=round_id,
                )
                (tmp / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
                try:
                    os.rename(tmp, agent_dir / f"v{version}")
                    break
                except OSError:
                    if not (agent_dir / f"v{version}").exists():
                        raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        if promote:
            self.promote(agent, version, publisher=publisher)
        return version

    def promote(self, agent: str, version: int, *, publisher: Publisher | None = None) -> int:
        """Make ``version`` current. With a publisher, the server loads it first; if it refuses, the
        registry keeps the old current version."""
        path = self.path(agent, version)
        with self._locked(agent):
            if publisher is not None:
                publisher.load(agent, path, version=version)
            state = self._state(agent)
            state["current"] = version
            state["history"].append(version)
            self._write_state(agent, state)
        return version

    def rollback(self, agent: str, *, publisher: Publisher | None = None) -> int:
        """Return to the version that was current before the latest promotion, and return it."""
        with self._locked(agent):
            state = self._state(agent)
            history = list(state["history"])
            if history and history[-1] == state["current"]:
                history.pop()
            if not history:
                raise AdapterError(f"agent {agent!r} has no earlier promoted version to roll back to")
            previous = history[-1]
            if publisher is not None:
                publisher.load(agent, self.path(agent, previous), version=previous)
            self._write_state(agent, {"current": previous, "history": history})
        return previous

    # -- state file ------------------------------------------------------------------------------
    @contextmanager
    def _locked(self, agent: str):
        """Serialise promote/rollback of one agent across processes (the state is read-modify-write)."""
        import fcntl

        with open(self.root / check_agent_name(agent) / ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _state(self, agent: str) -> dict:
        return read_state(state_file(self.root, agent))

    def _write_state(self, agent: str, state: dict) -> None:
        p = state_file(self.root, agent)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, p)  # atomic: readers see the old or the new state, never half of one


def _finite_numbers(metrics: dict[str, Any] | None) -> dict[str, float]:
    """The metrics a manifest keeps: finite numbers (a trainer's NaN ``value_loss`` without a critic, or a
    per-agent table, has no place in ``metrics: dict[str, float]`` and would make the manifest unreadable)."""
    out = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    return out
