"""``TraceStore.submit``'s writer process (``store/writer_process.py``): what is submitted is written
there, refused there, survives its death and the app's, and is counted when the queue is full."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa

from marft_bridge.capture_errors import capture_stats, reset_capture_stats
from marft_bridge.schema import Action, Episode, Output
from marft_bridge.store import TraceStore

ROOT = Path(__file__).resolve().parents[1]


def episode(i: int, n: int = 3) -> Episode:
    acts: list[Action] = []
    for k in range(n):
        acts.append(Action(id=f"{i}-a{k}", agent=("planner", "coder")[k % 2], step=k,
                           output=Output(text=f"out {i}.{k}"), depends_on=[acts[-1].id] if acts else []))
    return Episode(id=f"ep{i}", source="test", agents=["planner", "coder"], actions=acts,
                   started_at=datetime(2026, 1, 1, 12, 0, i % 60, tzinfo=timezone.utc))


@pytest.fixture(autouse=True)
def _fresh_stats():
    reset_capture_stats()
    yield
    reset_capture_stats()


def wait_until(cond, what: str) -> None:
    for _ in range(6000):
        if cond():
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class SqliteLock:
    """The SQLite write lock held by the test, so the writer process waits inside its transaction."""

    def __init__(self, url: str):
        self.conn = sa.create_engine(url).connect()
        self.conn.exec_driver_sql("BEGIN IMMEDIATE")

    def release(self) -> None:
        self.conn.exec_driver_sql("ROLLBACK")
        self.conn.close()


def test_every_submitted_episode_is_readable_after_flush_and_after_close(store_url):
    store = TraceStore.open(store_url)
    for i in range(30):
        store.submit(episode(i))
    store.submit(episode(30).model_dump())  # a dict, as capture submits it
    store.submit(episode(31).model_dump_json())  # JSON text
    assert store.flush(timeout=120)
    stats = store.writer_stats()
    assert stats["mode"] == "process" and not stats["in_thread"] and stats["pid"] not in (None, os.getpid())
    assert [e.id for e in store.episodes()] == [f"ep{i}" for i in range(32)]
    assert store.get_episode("ep30") == episode(30) and store.get_episode("ep31") == episode(31)
    for i in range(32, 40):
        store.submit(episode(i))
    pid = stats["pid"]
    store.close()  # flushes, then the writer process exits
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    reopened = TraceStore.open(store_url)
    assert reopened.count() == 40 and reopened.get_episode("ep39") == episode(39)
    assert reopened.stats()["dead_letters"] == 0
    reopened.close()


def test_a_refused_episode_is_dead_lettered_by_the_process_with_a_preview(store_url):
    store = TraceStore.open(store_url)
    bad = episode(1).model_dump(mode="json")
    bad["actions"][2]["depends_on"] = ["ghost"]
    store.submit(episode(0))
    store.submit(bad)
    store.submit("{not json")
    store.submit(episode(2))
    assert store.flush(timeout=120)
    assert [e.id for e in store.episodes()] == ["ep0", "ep2"]
    letters = sorted(store.dead_letters(), key=lambda d: d.seq)
    assert [d.record for d in letters] == ["episode ep1", None]
    assert "ghost" in letters[0].reason and '"id":"ep1"' in letters[0].raw.replace(" ", "")
    assert letters[1].reason.startswith("malformed JSON") and letters[1].raw == "{not json"
    store.close()


def test_the_process_judges_with_the_stores_record_limits_as_the_thread_writer_does(tmp_path):
    letters = {}
    for mode in ("process", "thread"):
        store = TraceStore.open(tmp_path / f"{mode}.db", limits={"max_record_bytes": 5000}, writer=mode)
        big = episode(0, n=40)
        assert len(big.model_dump_json()) > 5000  # under the default limit, over this store's
        store.submit(big)
        store.submit(episode(1, n=1))
        assert store.flush(timeout=120)
        assert [e.id for e in store.episodes()] == ["ep1"]
        (letter,) = store.dead_letters()
        letters[mode] = (letter.record, letter.reason, letter.raw)
        store.close()
    assert letters["process"] == letters["thread"]
    assert "over the 5,000-byte limit of one record (max_record_bytes)" in letters["process"][1]


def test_records_that_are_not_json_go_the_thread_path_and_are_refused_as_before(tmp_path):
    store = TraceStore.open(tmp_path / "t.db")
    store.submit(episode(0))
    store.submit({"id": "odd", "actions": [{"id": "x", "agent": "a", "metadata": {"obj": object()}}]})
    store.submit({"id": "intkey", "actions": [{"id": "y", "agent": "a"}], "metadata": {1: "an int key"}})
    store.submit(episode(1))
    assert store.flush(timeout=120)
    assert [e.id for e in store.episodes()] == ["ep0", "ep1"]
    assert sorted(d.record for d in store.dead_letters()) == ["episode intkey", "episode odd"]
    store.close()


def test_a_killed_writer_process_loses_nothing_its_group_is_written_by_the_next(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    store = TraceStore.open(url)
    store.submit(episode(0))
    assert store.flush(timeout=120)  # the process is running
    first = store.writer_stats()["pid"]
    lock = SqliteLock(url)
    try:
        for i in range(1, 6):
            store.submit(episode(i))
        # The process holds the group, waiting for the lock inside its transaction: kill it there.
        wait_until(lambda: store.writer_stats()["queued"] == 0, "the group to be sent")
        os.kill(first, signal.SIGKILL)
        for i in range(6, 9):
            store.submit(episode(i))  # the app goes on meanwhile and never sees an error
    finally:
        lock.release()
    assert store.flush(timeout=120)
    stats = store.writer_stats()
    assert stats["restarts"] == 1 and stats["pid"] != first and not stats["in_thread"]
    assert capture_stats()["store"]["writer_restarts"] == 1
    assert [e.id for e in store.episodes()] == [f"ep{i}" for i in range(9)]
    assert all(store.get_episode(f"ep{i}") == episode(i) for i in range(9))
    assert store.stats()["dead_letters"] == 0
    store.close()


def test_a_group_sent_before_the_app_was_killed_is_still_written(tmp_path):
    # The thread writer loses every queued episode when the app dies; the writer process reads its
    # input to the end, so a group it was sent is committed after the app is gone.
    url = f"sqlite:///{tmp_path / 't.db'}"
    script = textwrap.dedent(f"""
        import os, signal, sys, threading
        from marft_bridge.schema import Action, Episode
        from marft_bridge.store import TraceStore
        s = TraceStore.open({url!r})
        s.submit(Episode(id="x0", actions=[Action(id="a0", agent="a")]))
        s.flush()
        print("running", flush=True)
        sys.stdin.readline()  # the test holds the write lock now
        for i in range(1, 6):
            s.submit(Episode(id=f"x{{i}}", actions=[Action(id=f"a{{i}}", agent="a")]))
        while s.writer_stats()["queued"]:
            threading.Event().wait(0.01)
        print(s.writer_stats()["pid"], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    app = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert app.stdout.readline() == "running\n"
    lock = SqliteLock(url)  # the group cannot be committed before the app is dead
    try:
        app.stdin.write("go\n")
        app.stdin.flush()
        writer_pid = int(app.stdout.readline())
        assert app.wait(120) == -signal.SIGKILL
    finally:
        lock.release()
    store = TraceStore.open(url)
    wait_until(lambda: store.count() == 6, "the orphaned writer process to commit")
    assert [e.id for e in store.episodes()] == [f"x{i}" for i in range(6)]
    wait_until(lambda: not _alive(writer_pid), "the writer process to exit at the end of its input")
    store.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_full_queue_drops_and_counts_them(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    store = TraceStore.open(url, queue_size=2, on_full="drop")
    lock = SqliteLock(url)
    try:
        store.submit(episode(0))
        wait_until(lambda: store.writer_stats()["queued"] == 0, "episode 0 to be sent")
        for i in range(1, 8):
            store.submit(episode(i))
        assert store.dropped == 5 and capture_stats()["store"]["dropped"] == 5
    finally:
        lock.release()
    assert store.flush(timeout=120)
    assert [e.id for e in store.episodes()] == ["ep0", "ep1", "ep2"]
    assert store.stats()["dropped"] == 5 and capture_stats()["store"]["waits"] == 0
    store.close()


def test_a_full_queue_makes_the_submitter_wait_and_counts_the_wait(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    store = TraceStore.open(url, queue_size=1, on_full="block")
    lock = SqliteLock(url)
    done = threading.Event()
    try:
        store.submit(episode(0))
        wait_until(lambda: store.writer_stats()["queued"] == 0, "episode 0 to be sent")
        store.submit(episode(1))  # fills the queue
        submitter = threading.Thread(target=lambda: (store.submit(episode(2)), done.set()))
        submitter.start()
        assert not done.wait(0.3)  # still waiting for room: back-pressure, nothing dropped
    finally:
        lock.release()
    submitter.join(120)
    assert done.is_set()
    assert store.flush(timeout=120)
    counts = capture_stats()["store"]
    assert counts["waits"] == 1 and counts["dropped"] == 0 and counts["wait_s"] > 0
    assert [e.id for e in store.episodes()] == ["ep0", "ep1", "ep2"]
    store.close()


def test_when_no_writer_process_can_start_a_thread_writes_and_it_is_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    store = TraceStore.open(tmp_path / "t.db")
    for i in range(4):
        store.submit(episode(i))
    assert store.flush(timeout=120)
    assert store.writer_stats()["in_thread"] and capture_stats()["store"]["thread_fallbacks"] == 1
    assert [e.id for e in store.episodes()] == [f"ep{i}" for i in range(4)]
    store.close()


def test_submit_never_raises_into_the_app(tmp_path):
    store = TraceStore.open(tmp_path / "t.db")
    cyclic: dict = {"id": "cyc", "actions": []}
    cyclic["metadata"] = {"self": cyclic}
    for odd in (42, ["a", "list"], b"\xff\xfe", "\ud800", cyclic, None):
        store.submit(odd)
    assert store.flush(timeout=120)
    # Each is refused and dead-lettered, but the lone surrogate, which SQLite cannot store as text
    # (its dead letter fails, logged; as with the thread writer).
    assert store.count() == 0 and store.stats()["dead_letters"] == 5
    store.close()
    store.submit(episode(0))  # closed: dropped and counted, not raised
    assert store.dropped == 1


def test_thread_mode_is_kept_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("MARFT_STORE_WRITER", "thread")
    store = TraceStore.open(tmp_path / "t.db")
    store.submit(episode(0))
    assert store.flush(timeout=120)
    assert store.writer_stats()["mode"] == "thread" and store.writer_stats()["pid"] is None
    assert store.get_episode("ep0") == episode(0)
    store.close()


def test_a_captured_record_is_not_walked_for_keys_a_key_that_is_not_text_is_stored_as_text(tmp_path):
    import marft_bridge as mb

    store = TraceStore.open(tmp_path / "t.db")
    with mb.episode(store=store, metadata={1: "an int key"}) as rec:
        rec.record_action("a", output={"text": "hi"})
    store.submit({"id": "direct", "actions": [{"id": "x", "agent": "a"}], "metadata": {1: "an int key"}})
    assert store.flush(timeout=120)
    assert store.get_episode(rec.id).metadata == {"1": "an int key"}
    assert not store.has_episode("direct")  # submit() refuses it, as add_episode does
    assert [d.record for d in store.dead_letters()] == ["episode direct"]
    store.close()


def test_the_writer_processs_logs_reach_the_apps_logger(tmp_path, caplog):
    store = TraceStore.open(tmp_path / "t.db")
    with caplog.at_level("WARNING", logger="marft_bridge.store"):
        store.submit({"id": "bad", "actions": [{"agent": "a", "depends_on": ["ghost"]}]})
        assert store.flush(timeout=120)
        pid = store.writer_stats()["pid"]
        store.close()  # the relay has read every line once the process has exited
        wait_until(lambda: any("trace refused" in r.getMessage() for r in caplog.records), "the relayed warning")
    (record,) = [r for r in caplog.records if "trace refused" in r.getMessage()]
    assert record.levelname == "WARNING" and record.name == "marft_bridge.store"
    assert record.getMessage().startswith(f"trace writer process {pid}: trace refused: episode bad")
