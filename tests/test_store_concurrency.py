"""Concurrency and crash safety: readers while a writer appends, several writer processes on one
store, and a writer killed with SIGKILL in the middle of its writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import sqlalchemy as sa
from test_store import make_episode

from marft_bridge.schema import parse_episode
from marft_bridge.store import TraceStore


def test_readers_see_whole_episodes_while_a_thread_writes(store, store_url):
    n_episodes, n_actions = 60, 5
    other = TraceStore.open(store_url)  # a reader with connections of its own
    done = threading.Event()
    errors: list[BaseException] = []

    def write():
        try:
            for i in range(n_episodes):
                store.add_episode(make_episode(i, n=n_actions))
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)
        finally:
            done.set()

    writer = threading.Thread(target=write)
    writer.start()
    counts, reads = [], 0
    while not done.is_set() or reads < 2:
        for reader in (store, other):
            counts.append(reader.count())
            eps = list(reader.episodes())
            assert all(len(e.actions) == n_actions for e in eps)
            assert [e.id for e in eps] == [f"ep{i}" for i in range(len(eps))]
        reads += 1
    writer.join()
    assert errors == []
    assert counts == sorted(counts)  # never goes back
    assert other.count() == n_episodes
    other.close()


WRITER = """
import sys
from marft_bridge.store import TraceStore
from marft_bridge.schema import Episode, Action
url, w, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = TraceStore.open(url)
for i in range(n):
    s.add_episode(Episode(id=f"w{w}-{i}", source=f"writer{w}",
                          actions=[Action(id=f"w{w}-{i}-{k}", agent=f"agent{k}", step=k) for k in range(3)]))
    # every writer also appends its own action to one shared episode (cross-process merge)
    s.add_episode({"id": "shared", "actions": [{"id": f"s{w}-{i}", "agent": f"writer{w}", "step": 1,
                                                "depends_on": ["root"]}]})
s.close()
"""


def test_several_writer_processes_append_to_one_store(store, store_url):
    store.add_episode({"id": "shared", "actions": [{"id": "root", "agent": "root", "step": 0}]})
    cursor = store.cursor()
    n_writers, n = 3, 12
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, store_url, str(w), str(n)]) for w in range(n_writers)]
    for p in procs:
        assert p.wait(timeout=240) == 0
    assert store.count() == n_writers * n + 1
    for w in range(n_writers):
        assert store.count(source=f"writer{w}") == n
    shared = store.get_episode("shared")
    assert len(shared.actions) == 1 + n_writers * n
    assert parse_episode(shared.model_dump(mode="json")) == shared
    for w in range(n_writers):  # each writer's own appends stay in its order
        mine = [a.id for a in shared.actions if a.agent == f"writer{w}"]
        assert mine == [f"s{w}-{i}" for i in range(n)]
    _, changed = store.changed_since(cursor)
    assert sorted(changed) == sorted([f"w{w}-{i}" for w in range(n_writers) for i in range(n)] + ["shared"])
    assert store.stats()["dead_letters"] == 0


KILLED = """
import sys
from marft_bridge.store import TraceStore
from marft_bridge.schema import Episode, Action, Output
s = TraceStore.open(sys.argv[1])
i = 0
while True:
    s.add_episode(Episode(id=f"k{i}", actions=[Action(id=f"k{i}-{j}", agent="a", step=j, output=Output(text="x" * 3000))
                                               for j in range(20)]))
    print(f"k{i}", flush=True)
    i += 1
"""


def test_writer_killed_mid_write_leaves_every_committed_episode_intact(store_url):
    TraceStore.open(store_url).close()  # create the schema first
    proc = subprocess.Popen([sys.executable, "-c", KILLED, store_url], stdout=subprocess.PIPE, text=True)
    committed = []
    try:
        for line in proc.stdout:
            committed.append(line.strip())
            if len(committed) == 15:
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # while it is writing the next episodes
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert len(committed) == 15
    with TraceStore.open(store_url) as s:
        stored = {e.id: e for e in s.episodes()}
        assert set(committed) <= set(stored)
        assert all(len(e.actions) == 20 for e in stored.values())  # never half an episode
        assert s.stats()["actions"] == 20 * len(stored)
        if not s.is_postgres:
            with s._engine.connect() as conn:
                assert conn.execute(sa.text("pragma integrity_check")).scalar() == "ok"
        s.add_episode(make_episode(99))  # and it still takes writes
        assert s.count() == len(stored) + 1
