"""Files that survive a kill -9 at any instant: fsynced JSON written by rename, an fsynced append-only
log whose torn last line is skipped, and a directory replaced whole (the old copy is kept until the
new one is complete)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger("marft_bridge.durable")

COMPLETE = ".complete"  # marks a directory copy as finished


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path``: readers and a restart see the old content or the new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=2, default=str))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def append_json_line(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_json_lines(path: Path) -> list[dict]:
    """Every whole JSON line of an append-only log; a torn line (a kill mid-append) is skipped, with a warning."""
    if not path.is_file():
        return []
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s line %d is not whole JSON (torn by a crash?); skipped", path, n)
    return rows


def fsync_tree(d: Path) -> None:
    for p in sorted(d.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for p in sorted((q for q in d.rglob("*") if q.is_dir()), reverse=True):
        _fsync_dir(p)
    _fsync_dir(d)


def replace_dir(src: Path, dst: Path) -> None:
    """Make ``dst`` a copy of ``src``. The copy is written beside (``dst.new``), fsynced and marked
    complete before the swap; the old ``dst`` is kept (``dst.old``) until the new one is in place, so a
    kill at any point leaves a complete old or new copy that ``recover_dir`` puts back."""
    new, old = dst.with_name(dst.name + ".new"), dst.with_name(dst.name + ".old")
    shutil.rmtree(new, ignore_errors=True)
    shutil.copytree(src, new)
    (new / COMPLETE).touch()
    fsync_tree(new)
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
    os.rename(new, dst)
    _fsync_dir(dst.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_dir(dst: Path) -> str | None:
    """After a crash inside ``replace_dir``: keep a complete copy at ``dst`` and drop the leftovers.
    Returns what was done (None: nothing to do)."""
    new, old = dst.with_name(dst.name + ".new"), dst.with_name(dst.name + ".old")
    done = None
    if not dst.exists():
        if (new / COMPLETE).is_file():
            os.rename(new, dst)
            done = f"completed the interrupted replacement of {dst.name} with the new copy"
        elif old.exists():
            os.rename(old, dst)
            done = f"restored the previous {dst.name} (the new copy was incomplete)"
    for leftover in (new, old):
        if leftover.exists():
            shutil.rmtree(leftover, ignore_errors=True)
            done = done or f"removed an unfinished copy beside {dst.name}"
    return done
