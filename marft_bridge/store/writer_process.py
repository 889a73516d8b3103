"""``TraceStore.submit``'s writer: the episode's JSON handed to a writer process, off the app's GIL.

On the app's thread ``submit`` only serialises the episode to JSON bytes once (in Rust: an
``Episode`` by its model's serializer, a capture's dict by ``pydantic_core.to_json``; no
validation, no pickle) and queues them (``writer.BackgroundWriter``: bounded, back-pressure or
drop, counted in ``capture_stats()["store"]``). The queue's thread sends each group to a writer
process (``writer_child``) and waits until that process has committed it; the process parses and
validates each episode with the record model under the store's ``RecordLimits``, writes the rows
(group commit) and dead-letters refused ones with a preview, exactly as the store does in a thread.
So the validation, row JSON and SQL never hold the app's GIL; what the app's process still runs
per group is a pipe write and a wait.

What a crash can lose — never more than the thread writer, which loses everything queued:

* the app dies: what still waits in its queue (at most ``queue_size`` episodes). A group already
  sent is written by the process, which reads to the end of its input before it exits.
* the writer process dies (killed, out of memory): nothing. The group it had is sent again to a
  new process; episodes of it already committed merge as no-ops (a "merge" line in the change log;
  a refused one is dead-lettered again). After ``MAX_FAILURES`` failures in a row (a process that
  cannot start, or keeps dying) the store writes in the queue's thread instead, logged and counted.

Episodes the process cannot take go through the thread path in their place in the order: records
that are not JSON (an object, a cycle, nesting too deep for the serializer) are judged, refused
and dead-lettered as before, and so are dicts with a key that is not text (JSON would make it
text; the record model refuses it). ``TraceStore.open(writer="thread")`` (or
``MARFT_STORE_WRITER=thread``) keeps the thread writer, and so does a Python that cannot start
itself again (``sys.executable`` empty: an embedded interpreter).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import threading
from collections import OrderedDict, defaultdict
from itertools import compress
from pathlib import Path
from typing import Any, BinaryIO

from pydantic_core import to_json

from ..capture_errors import count_store
from .writer import BackgroundWriter, snapshot

log = logging.getLogger("marft_bridge.store")

MAX_FAILURES = 3  # writer processes in a row that failed to start or died before the store gives up on them
WRITER_MODES = ("process", "thread")


def start_writer(store: Any, mode: str, maxsize: int, on_full: str) -> tuple[BackgroundWriter, ProcessSink | None]:
    """The background writer of ``store`` (a ``TraceStore``): a queue drained by a thread, which writes the groups itself
    (``mode="thread"``) or sends them to a writer process (``"process"``, the sink returned too)."""
    if mode == "thread" or not sys.executable:
        return BackgroundWriter(store.write_queued, maxsize, on_full), None
    sink = ProcessSink(store)
    return BackgroundWriter(sink.write, maxsize, on_full, copy=json_snapshot, on_stop=sink.close), sink


def json_snapshot(episode: Any, text_keys: bool = False) -> Any:
    """The episode as JSON bytes, copied now; a record that is not JSON is snapshotted for the thread
    path. ``text_keys``: the caller vouches for a dict's keys (a capture's own record, whose keys
    JSON turns into text where they are not: ``TraceStore.submit_record``), so they are not walked."""
    if isinstance(episode, bytes):
        return episode
    try:
        if type(episode) is dict:
            data = to_json(episode)  # raises on a cycle, so the walk below ends
            return data if text_keys or _text_keys(episode) else snapshot(episode)
        if isinstance(episode, str):
            return episode.encode()
        from ..schema import Episode

        if isinstance(episode, Episode):
            return Episode.__pydantic_serializer__.to_json(episode)
    except Exception:  # noqa: BLE001 - not JSON: the thread path judges and dead-letters it as before
        pass
    return snapshot(episode)


def _text_keys(obj: Any) -> bool:
    """Every dict key in ``obj`` is text: JSON would turn any other key into text, which the record
    model refuses (as the thread path, which keeps the objects, does). The loops over keys and
    values run in C (``map``, ``compress``): a captured episode is walked in a few microseconds."""
    stack = [obj]
    pop, extend = stack.pop, stack.extend
    while stack:
        o = pop()
        if type(o) in _DICTS:
            if not _TEXT.issuperset(map(type, o)):
                return False
            o = o.values()
        extend(compress(o, map(_CONTAINERS.__contains__, map(type, o))))
    return True


_DICTS = frozenset({dict, OrderedDict, defaultdict})
_CONTAINERS = _DICTS | {list, tuple}
_TEXT = frozenset({str})  # a key of another type (a str subclass too) sends the record the exact thread path


class ProcessSink:
    """Sends groups of JSON episodes to a writer process and waits for each to be committed there.

    ``write`` runs on the queue's thread only; ``close`` after that thread ended."""

    def __init__(self, store: Any):
        self._store = store
        self._proc: subprocess.Popen | None = None
        self._failures = 0  # in a row
        self._lock = threading.Lock()  # cpu figures read from other threads
        self._cpu_done = 0.0  # CPU seconds of writer processes that ended
        self._cpu_now = 0.0  # of the running one, as of its last group
        self.restarts = 0
        self.in_thread = False  # gave up on processes: the queue's thread writes

    @property
    def cpu_s(self) -> float:
        """CPU seconds the writer processes used (as of their last committed group)."""
        with self._lock:
            return self._cpu_done + self._cpu_now

    @property
    def pid(self) -> int | None:
        """The running writer process's id (None before the first group, or after it ended)."""
        proc = self._proc
        return None if proc is None else proc.pid

    def write(self, items: list[Any]) -> None:
        """One group, in order: runs of JSON to the process, anything else to the thread path."""
        run: list[Any] = []
        for item in items:
            if run and isinstance(item, bytes) != isinstance(run[0], bytes):
                self._write_run(run)
                run = []
            run.append(item)
        if run:
            self._write_run(run)

    def _write_run(self, run: list[Any]) -> None:
        if isinstance(run[0], bytes):
            payload = group_frames(run)
            while not self.in_thread:
                proc = self._proc or self._start()
                if proc is None:
                    continue
                try:
                    proc.stdin.write(payload)
                    proc.stdin.flush()
                    line = proc.stdout.readline()
                except (OSError, ValueError):
                    line = b""
                if line.startswith(b"ok "):
                    self._failures = 0
                    with self._lock:
                        self._cpu_now = float(line.split()[1])
                    return
                self._lost(proc, "died while writing a group; sending it again" if not line else line.decode())
                if not self.in_thread:
                    self.restarts += 1
                    count_store("writer_restarts")
        self._store.write_queued(run)

    def _start(self) -> subprocess.Popen | None:
        """A new writer process on the store, ready; None when it failed (counted towards giving up)."""
        root = str(Path(__file__).resolve().parents[2])  # the directory marft_bridge is imported from
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "marft_bridge.store.writer_child"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
        except OSError as e:
            self._lost(None, f"cannot start: {e}")
            return None
        threading.Thread(target=_relay_logs, args=(proc,), name="marft-trace-writer-logs", daemon=True).start()
        config = {"url": self._store.secret_url, "limits": self._store.limits.model_dump(mode="json")}
        try:
            proc.stdin.write(frame(json.dumps(config).encode()))
            proc.stdin.flush()
            line = proc.stdout.readline()
        except (OSError, ValueError):
            line = b""
        if line != b"ready\n":
            self._lost(proc, line.decode(errors="replace").strip() or "exited at start")
            return None
        self._proc = proc
        return proc

    def _lost(self, proc: subprocess.Popen | None, why: str) -> None:
        """A writer process that failed: ended, its CPU counted; after MAX_FAILURES in a row, the thread path."""
        if proc is not None:
            _end(proc)
        with self._lock:
            self._cpu_done += self._cpu_now
            self._cpu_now = 0.0
        self._proc = None
        self._failures += 1
        log.warning("trace writer process for %s: %s", self._store.url, why.strip())
        if self._failures >= MAX_FAILURES:
            self.in_thread = True
            count_store("thread_fallbacks")
            log.error("trace writer process for %s failed %d times in a row; writing in a thread of the app instead",
                      self._store.url, self._failures)

    def close(self) -> None:
        """End the writer process once the queue is written (it exits at the end of its input)."""
        if self._proc is not None:
            _end(self._proc, graceful=True)
            self._proc = None


def _relay_logs(proc: subprocess.Popen) -> None:
    """The writer process's log lines ("LEVEL message", ``writer_child``) into this process's
    ``marft_bridge.store`` logger, so the app's logging configuration sees them as before; a line
    without a level (a traceback, anything printed) is logged at the level of the line before."""
    level = logging.WARNING
    for raw in proc.stderr:
        line = raw.decode(errors="replace").rstrip()
        name, _, msg = line.partition(" ")
        if isinstance(logging.getLevelName(name), int) and msg:
            level, line = logging.getLevelName(name), msg
        log.log(level, "trace writer process %d: %s", proc.pid, line)
    proc.stderr.close()


def _end(proc: subprocess.Popen, graceful: bool = False) -> None:
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=60 if graceful else 5)
    except subprocess.TimeoutExpired:
        log.error("trace writer process %d did not exit; killed", proc.pid)
        proc.kill()
        proc.wait()
    proc.stdout.close()


# -- the pipe's frames (``writer_child`` documents the protocol) ---------------------------------

U32 = struct.Struct("<I")


def frame(payload: bytes) -> bytes:
    return U32.pack(len(payload)) + payload


def group_frames(items: list[bytes]) -> bytes:
    return U32.pack(len(items)) + b"".join(U32.pack(len(p)) + p for p in items)


def _read_u32(inp: BinaryIO) -> int | None:
    head = inp.read(4)
    return U32.unpack(head)[0] if len(head) == 4 else None


def read_frame(inp: BinaryIO) -> bytes | None:
    n = _read_u32(inp)
    if n is None:
        return None
    data = inp.read(n)
    return data if len(data) == n else None


def read_group(inp: BinaryIO) -> tuple[list[bytes], bool]:
    """The next group's episodes, and whether input goes on. Input that ends inside a group (the
    app died writing it) still gives the episodes that arrived whole."""
    n = _read_u32(inp)
    if n is None:
        return [], False
    items = []
    for _ in range(n):
        data = read_frame(inp)
        if data is None:
            return items, False
        items.append(data)
    return items, True
