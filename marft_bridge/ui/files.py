"""The viewer's file sources: training runs (``metrics.jsonl``), the adapter registry and the
service's state directory. Only files found under the directories given on the command line are
read; a run is named by its path relative to its root, and looked up by that name in what the scan
found, so no request can name a file of its own.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
DECISIONS_FILE = "decisions.jsonl"  # what marft service writes (marft_bridge.service.DECISIONS_FILE)
MAX_SCAN_DEPTH = 4
MAX_METRIC_ROWS = 20_000
MAX_DECISIONS = 200
TAIL_BYTES = 32 << 20  # how much of a JSONL file's end the viewer reads at most
# Plotted first, in this order, when present (as `marft plot` does); any other numeric key follows.
PLOT_FIRST = ["reward_mean", "kl_ref", "approx_kl", "entropy", "value_loss", "policy_loss", "clipfrac",
              "behaviour_weight", "factor_mean"]


def read_jsonl_tail(path: Path, limit: int, max_bytes: int = TAIL_BYTES) -> tuple[list[dict], int]:
    """The last ``limit`` JSON objects of a JSONL file and how many lines were unreadable, reading
    back from the end (at most ``max_bytes`` of it: a metrics file of any size costs the same). A torn
    last line (a writer still appending), or one nested too deep to parse, is skipped, not an error."""
    try:
        with path.open("rb") as f:
            pos = f.seek(0, os.SEEK_END)
            start, chunks, newlines = max(0, pos - max_bytes), [], 0
            while pos > start and newlines <= limit:
                step = min(1 << 16, pos - start)
                pos -= step
                f.seek(pos)
                chunks.append(f.read(step))
                newlines += chunks[-1].count(b"\n")
    except OSError:
        return [], 0
    lines = b"".join(reversed(chunks)).split(b"\n")
    if pos > 0:
        lines = lines[1:]  # begun before what was read: not a whole line
    rows, bad = [], 0
    for line in lines[-limit - 1:]:  # the last piece is empty when the file ends in a newline
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode(errors="replace"))
        except (ValueError, RecursionError):  # RecursionError: nested too deep for the parser
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows[-limit:], bad


class Runs:
    """Training runs: every directory holding a metrics.jsonl under the ``--runs`` roots."""

    def __init__(self, roots: list[str | Path]):
        self.roots = [Path(r).expanduser().resolve() for r in roots]

    def _scan(self) -> dict[str, Path]:
        found: dict[str, Path] = {}
        for i, root in enumerate(self.roots):
            if not root.is_dir():
                continue
            prefix = root.name if len(self.roots) == 1 else f"{i}:{root.name}"
            for f in sorted(root.rglob(METRICS_FILE)):
                rel = f.parent.relative_to(root)
                if len(rel.parts) > MAX_SCAN_DEPTH or not f.is_file():
                    continue
                real = f.resolve()  # a symlink must not lead out of the root
                if not real.is_relative_to(root):
                    continue
                name = prefix if not rel.parts else f"{prefix}/{rel.as_posix()}"
                found[name] = real
        return found

    def list(self) -> list[dict]:
        out = []
        for name, path in self._scan().items():
            rows, _ = read_jsonl_tail(path, MAX_METRIC_ROWS)
            out.append({"name": name, "updates": len(rows), "modified": path.stat().st_mtime})
        return out

    def series(self, name: str) -> dict | None:
        """Per metric, ``[[update, value], ...]``; None when no run has that name."""
        path = self._scan().get(name)
        if path is None:
            return None
        rows, bad = read_jsonl_tail(path, MAX_METRIC_ROWS)
        series: dict[str, list] = {}
        for i, row in enumerate(rows):
            x = row.get("update", i + 1)
            for key, value in _numbers(row):
                series.setdefault(key, []).append([x, value])
        order = [k for k in PLOT_FIRST if k in series] + sorted(k for k in series if k not in PLOT_FIRST)
        return {"name": name, "updates": len(rows), "unreadable_lines": bad,
                "series": {k: series[k] for k in order if k != "update"}}


def _numbers(row: dict, prefix: str = "") -> list[tuple[str, float]]:
    """Numeric metrics of one row, nested dicts flattened (``skipped.no_reward``); lists are left out."""
    out = []
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            out.append((name, float(value)))
        elif isinstance(value, dict):
            out.extend(_numbers(value, name + "."))
    return out


def adapters_view(registry_dir: Path | None, state_dir: Path | None, served: dict[str, dict]) -> dict:
    """Per registry agent: versions (metrics, parent, time, how many captured episodes each served and
    their mean reward), the current one and its promotion history; the service's recent decisions."""
    agents: list[dict] = []
    problems: list[str] = []
    if registry_dir is not None and registry_dir.is_dir():
        from ..serving.registry import AdapterRegistry

        registry = AdapterRegistry(registry_dir)  # an existing directory: nothing is created
        for agent in registry.agents():
            if not (registry_dir / agent).resolve().is_relative_to(registry_dir):  # a symlink out of the root
                problems.append(f"{agent}: its directory leads outside the registry; not shown")
                continue
            try:
                rows = registry.list(agent)
                current = registry.current(agent)
                history = _history(registry_dir, agent)
            except Exception as e:  # noqa: BLE001 - one broken agent directory must not hide the others
                problems.append(f"{agent}: {e}")
                continue
            versions = []
            for row in rows:
                if not Path(row.path).resolve().is_relative_to(registry_dir):  # a symlink out of the root
                    problems.append(f"{agent}: {row.path} leads outside the registry; not shown")
                    continue
                m = row.manifest
                label = f"{agent}:v{m.version}"
                versions.append({"version": m.version, "parent": m.parent, "created_at": m.created_at,
                                 "metrics": m.metrics, "rank": m.rank, "base_model": m.base_model,
                                 "current": row.current, "served": served.get(label)})
            agents.append({"agent": agent, "current": current, "history": history, "versions": versions})
    decisions: list[dict] = []
    bad = 0
    if state_dir is not None:
        decisions, bad = read_jsonl_tail(state_dir / DECISIONS_FILE, MAX_DECISIONS)
        decisions.reverse()  # newest first
    unregistered = {k: v for k, v in served.items()
                    if not any(k == f"{a['agent']}:v{v2['version']}" for a in agents for v2 in a["versions"])}
    return {"registry": str(registry_dir) if registry_dir else None, "agents": agents, "problems": problems,
            "service_state": str(state_dir) if state_dir else None, "decisions": decisions,
            "unreadable_decisions": bad, "served_elsewhere": unregistered}


def _history(root: Path, agent: str) -> list[Any]:
    from ..serving.registry import read_state, state_file

    return list(read_state(state_file(root, agent)).get("history", []))
