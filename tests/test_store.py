"""TraceStore on SQLite and PostgreSQL: lossless writes, merges, late rewards, queries, counts,
the change log, refusals and dead letters, schema versions, and the background writer."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from test_schema import episodes

from marft_bridge.errors import MarftError, RecordError
from marft_bridge.schema import Action, Episode, Output, Reward
from marft_bridge.store import EpisodeNotFound, TraceStore
from marft_bridge.store.tracestore import normalize_url

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)


def make_episode(i: int = 0, *, source: str = "manual", agents=("planner", "coder"), n: int = 3,
                 started: datetime | None = None, eid: str | None = None) -> Episode:
    acts: list[Action] = []
    for k in range(n):
        acts.append(
            Action(
                id=f"{eid or i}-a{k}",
                agent=agents[k % len(agents)],
                step=k,
                output=Output(text=f"out {i}.{k}", token_ids=[k, k + 1], logprobs=[-0.5, -0.25 * k]),
                depends_on=[acts[-1].id] if acts else [],
            )
        )
    return Episode(id=eid or f"ep{i}", source=source, actions=acts, started_at=started or T0 + timedelta(minutes=i),
                   task={"i": i})


# -- lossless writes ------------------------------------------------------------------------------


def test_get_episode_equals_the_episode_added(store):
    paris = timezone(timedelta(hours=1))
    ep = Episode(
        id="e1",
        source="langgraph",
        task={"question": "2+2?", "nested": [1, 2.5, None, {"x": True}]},
        actions=[
            Action(id="b", agent="solver", step=0, started_at=datetime(2025, 1, 1, 9, 0, 0, 123456, tzinfo=paris),
                   output=Output(text="4", token_ids=[52], logprobs=[-0.1 / 3])),
            Action(id="a", agent="critic", step=1, depends_on=["b"], metadata={"score": 0.1 + 0.2, "tags": ["x"]}),
        ],
        rewards=[Reward(id="r", value=1 / 3, source="checker", created_at=datetime(2025, 1, 1, 9, 0, 1, tzinfo=paris))],
        started_at=datetime(2025, 1, 1, 8, 59, tzinfo=paris),
        ended_at=datetime(2025, 1, 1, 9, 5, tzinfo=timezone.utc),
        metadata={"thread_id": "t-1", "cost": 1e-9},
    )
    assert store.add_episode(ep) == "e1"
    got = store.get_episode("e1")
    assert got == ep
    assert [a.id for a in got.actions] == ["b", "a"]  # recording order, not id order
    assert got.started_at.utcoffset() == timedelta(hours=1)
    assert got.rewards[0].value == 1 / 3


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(ep=episodes(max_actions=5))
def test_any_valid_episode_round_trips_through_the_store(store, ep):
    ep = ep.model_copy(update={"id": uuid.uuid4().hex})  # examples share the store; ids may repeat
    store.add_episode(ep)
    assert store.get_episode(ep.id) == ep


def test_missing_episode_is_a_keyerror_and_a_marfterror(store):
    with pytest.raises(EpisodeNotFound) as e:
        store.get_episode("nope")
    assert isinstance(e.value, KeyError) and isinstance(e.value, MarftError)
    assert str(e.value) == "episode 'nope' is not in the store"


# -- merge --------------------------------------------------------------------------------------


def test_second_half_of_an_episode_is_appended(store):
    first = make_episode(eid="x", n=2)
    first = first.model_copy(update={"status": "running"})
    store.add_episode(first)
    second = {
        "id": "x",
        "status": "completed",
        "ended_at": "2025-03-01T12:10:00Z",
        "metadata": {"half": 2},
        "actions": [
            {"id": "x-b0", "agent": "reviewer", "step": 2, "depends_on": ["x-a1"]},
            {"id": "x-b1", "agent": "coder", "step": 3, "depends_on": ["x-b0", "x-a0"]},
        ],
        "rewards": [{"id": "r1", "value": 0.5, "agent": "reviewer"}],
    }
    store.add_episode(second)
    got = store.get_episode("x")
    assert [a.id for a in got.actions] == ["x-a0", "x-a1", "x-b0", "x-b1"]
    assert got.agents == ["planner", "coder", "reviewer"]
    assert got.status == "completed"
    assert got.ended_at == datetime(2025, 3, 1, 12, 10, tzinfo=timezone.utc)
    assert got.metadata == {"half": 2}
    assert got.task == {"i": 0}
    assert [r.value for r in got.rewards] == [0.5]
    assert store.count(agent="reviewer") == 1
    # Sending the same half again (a retry) changes nothing.
    store.add_episode(second)
    assert store.get_episode("x") == got
    assert store.stats()["actions"] == 4
    assert store.action_ids("x") == {"x-a0", "x-a1", "x-b0", "x-b1"}
    assert store.action_ids("not-stored") == set()


def test_merge_that_breaks_the_dag_is_refused_and_nothing_is_written(store):
    store.add_episode(make_episode(eid="x", n=2))
    before = store.get_episode("x")
    bad = {"id": "x", "actions": [{"id": "new", "agent": "coder", "step": 5, "depends_on": ["ghost"]}]}
    with pytest.raises(RecordError) as e:
        store.add_episode(bad)
    assert e.value.field == "actions.2.depends_on" and "ghost" in e.value.reason
    conflicting = {"id": "x", "actions": [{"id": "x-a0", "agent": "coder", "step": 0}]}
    with pytest.raises(RecordError, match="x-a0.*already stored with other content"):
        store.add_episode(conflicting)
    assert store.get_episode("x") == before
    assert store.stats()["dead_letters"] == 2


# -- late rewards ---------------------------------------------------------------------------------


def test_late_rewards_for_team_agent_and_action(store):
    store.add_episode(make_episode(1))
    assert store.count(has_reward=True) == 0
    r1 = store.add_reward("ep1", 1.0, source="checker")
    r2 = store.add_reward("ep1", -0.5, agent="coder", note="too long")
    r3 = store.add_reward("ep1", 0.25, action_id="1-a2", source="judge")
    got = store.get_episode("ep1")
    assert got.rewards == [r1, r2, r3]
    assert got.team_reward() == 1.0
    assert r2.metadata == {"note": "too long"} and r2.source == "user"
    assert store.count(has_reward=True) == 1 and store.count(has_reward=False) == 0


def test_bad_late_rewards_are_refused_and_dead_lettered(store):
    store.add_episode(make_episode(1))
    with pytest.raises(RecordError, match="^episode ep1: reward.agent: unknown agent 'ghost'$"):
        store.add_reward("ep1", 1.0, agent="ghost")
    with pytest.raises(RecordError, match="unknown action id 'zz'"):
        store.add_reward("ep1", 1.0, action_id="zz")
    with pytest.raises(RecordError, match="^episode nope: no such episode in the store$"):
        store.add_reward("nope", 1.0)
    with pytest.raises(RecordError, match="rewards must be finite"):
        store.add_reward("ep1", float("nan"))
    assert store.get_episode("ep1").rewards == []
    letters = store.dead_letters()
    assert [d.field for d in letters] == ["value", None, "reward.action_id", "reward.agent"]
    assert '"agent": "ghost"' in letters[-1].raw


# -- queries and counts ---------------------------------------------------------------------------


def test_queries_by_time_source_agent_and_reward(store):
    for i in range(6):
        store.add_episode(make_episode(i, source="mcp" if i % 2 else "langgraph",
                                       agents=("planner", "coder") if i < 3 else ("solo",)))
    store.add_reward("ep4", 1.0)
    ids = lambda **f: [e.id for e in store.episodes(**f)]  # noqa: E731
    assert ids() == ["ep0", "ep1", "ep2", "ep3", "ep4", "ep5"]
    assert ids(newest_first=True, limit=2) == ["ep5", "ep4"]
    assert ids(source="mcp") == ["ep1", "ep3", "ep5"]
    assert ids(agent="solo") == ["ep3", "ep4", "ep5"]
    assert ids(agent="coder", source="langgraph") == ["ep0", "ep2"]
    assert ids(since=T0 + timedelta(minutes=2), until=T0 + timedelta(minutes=4)) == ["ep2", "ep3"]
    # The same instant written in another time zone, and a naive time taken as UTC.
    assert ids(since=(T0 + timedelta(minutes=4)).astimezone(timezone(timedelta(hours=-7)))) == ["ep4", "ep5"]
    assert ids(until=datetime(2025, 3, 1, 12, 1)) == ["ep0"]
    assert ids(has_reward=True) == ["ep4"]
    assert store.count() == 6
    assert store.count(source="mcp", has_reward=True) == 0
    assert store.count(agent="planner") == 3
    assert store.count(since="2025-03-01T13:03:00+01:00") == 3  # ISO text works too
    with pytest.raises(MarftError, match="not an ISO date/time: 'yesterday'"):
        store.count(since="yesterday")


def test_stats_counts(store):
    store.add_episode(make_episode(0, source="a2a", n=3))
    store.add_episode(make_episode(1, source="mcp", agents=("solo",), n=1))
    store.add_reward("ep0", 1.0)
    with pytest.raises(RecordError):
        store.add_episode({"id": "bad", "actions": [{"agent": "a", "depends_on": ["x"]}]})
    s = store.stats()
    assert {k: s[k] for k in ("episodes", "actions", "rewards", "dead_letters", "episodes_with_reward")} == {
        "episodes": 2, "actions": 4, "rewards": 1, "dead_letters": 1, "episodes_with_reward": 1}
    assert s["sources"] == {"a2a": 1, "mcp": 1}
    assert s["agents"] == {"coder": {"episodes": 1, "actions": 1}, "planner": {"episodes": 1, "actions": 2},
                           "solo": {"episodes": 1, "actions": 1}}
    assert s["first_started_at"] == T0 and s["last_started_at"] == T0 + timedelta(minutes=1)


def test_change_log_reports_adds_merges_and_rewards_once(store):
    c0 = store.cursor()
    assert store.changed_since(c0) == (c0, [])
    store.add_episode(make_episode(0))
    store.add_episode(make_episode(1))
    c1, ids = store.changed_since(c0)
    assert ids == ["ep0", "ep1"] and c1 > c0
    store.add_reward("ep0", 1.0)
    store.add_episode({"id": "ep1", "actions": [{"id": "late", "agent": "coder", "step": 9}]})
    store.add_episode(make_episode(2))
    c2, ids = store.changed_since(c1)
    assert ids == ["ep0", "ep1", "ep2"] and c2 > c1 == store.changed_since(c0, limit=2)[0]
    assert store.changed_since(c2) == (c2, [])
    assert store.cursor() == c2


# -- bad input in a batch -------------------------------------------------------------------------


def test_batch_with_bad_records_keeps_the_good_ones(store):
    good = [make_episode(i) for i in range(3)]
    later = make_episode(10).model_dump(mode="json")
    later["actions"][1]["depends_on"] = []
    later["actions"][0]["depends_on"] = ["10-a1"]
    cycle = make_episode(11).model_dump(mode="json")
    cycle["actions"][0]["depends_on"] = ["11-a1"]
    cycle["actions"][1]["depends_on"] = ["11-a0"]
    lengths = make_episode(12).model_dump(mode="json")
    lengths["actions"][1]["output"]["logprobs"] = [-1.0]
    version = {**make_episode(13).model_dump(mode="json"), "schema_version": 7}
    wrong_type = {**make_episode(14).model_dump(mode="json"), "actions": "none"}
    big = make_episode(15).model_dump(mode="json")
    big["actions"][2]["agent"] = "x" * 300
    batch = [good[0], "{not json", later, good[1], cycle, lengths, version, wrong_type, big, 42, good[2]]
    report = store.add_episodes(batch)
    assert (report.added, report.refused) == (3, 8)
    reasons = [r.reason for r in report.refusals]
    assert "malformed JSON" in reasons[0]
    assert reasons[1].startswith("episode ep10: actions.0.depends_on: depends on later action '10-a1'")
    assert "dependency cycle" in reasons[2]
    assert reasons[3] == "episode ep12: actions.1.output.logprobs: 1 log-probs for 2 token ids"
    assert "unknown schema version 7" in reasons[4]
    assert reasons[5].startswith("episode ep14: actions: ")
    assert reasons[6].startswith("episode ep15: actions.2.agent: ")
    assert "not int" in reasons[7]
    assert [e.id for e in store.episodes()] == ["ep0", "ep1", "ep2"]
    assert store.stats()["dead_letters"] == 8 and store.stats()["actions"] == 9
    assert store.dead_letters(limit=1)[0].raw == "42"
    assert store.dead_letters()[-1].raw == "{not json"


def test_an_object_that_cannot_be_stored_as_json_is_refused(store):
    ep = make_episode(0)
    ep.metadata["handle"] = object()
    with pytest.raises(RecordError, match="^episode ep0: cannot be stored as JSON"):
        store.add_episode(ep)
    assert store.count() == 0 and store.stats()["dead_letters"] == 1


def test_a_mutated_episode_is_revalidated(store):
    ep = make_episode(0)
    ep.actions[0].output.logprobs.append(-1.0)  # no validation on mutation; the store catches it
    with pytest.raises(RecordError, match="actions.0.output.logprobs: 3 log-probs for 2 token ids"):
        store.add_episode(ep)


# -- opening ------------------------------------------------------------------------------------


def test_a_database_of_another_store_schema_version_is_refused(store_url):
    s = TraceStore.open(store_url)
    s.add_episode(make_episode(0))
    with s._engine.begin() as conn:
        conn.execute(sa.text("update marft_meta set value = '99' where key = 'store_schema_version'"))
    s.close()
    with pytest.raises(MarftError, match="written with store schema version 99, but this marft_bridge uses version 1"):
        TraceStore.open(store_url)


def test_a_write_transaction_holds_the_sqlite_write_lock_from_its_start(tmp_path):
    # A merge reads, then writes: taking the lock at BEGIN (IMMEDIATE) keeps two merging writers
    # from deadlocking on a lock upgrade.
    store = TraceStore.open(tmp_path / "t.db")
    other = sqlite3.connect(tmp_path / "t.db", timeout=0, isolation_level=None)
    with store._writes.begin():
        with pytest.raises(sqlite3.OperationalError, match="database is locked"):
            other.execute("BEGIN IMMEDIATE")
        assert store.count() == 0  # readers go on (WAL)
    other.execute("BEGIN IMMEDIATE")
    other.execute("ROLLBACK")
    other.close()
    store.close()


def test_urls_and_default_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MARFT_STORE", raising=False)
    assert normalize_url(None) == f"sqlite:///{tmp_path}/.marft/traces.db"
    assert normalize_url("x/t.db") == f"sqlite:///{tmp_path}/x/t.db"
    assert normalize_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    with pytest.raises(MarftError) as e:
        TraceStore.open("postgresql://user:s3cret@127.0.0.1:1/db")
    assert "s3cret" not in str(e.value) and "user:***@" in str(e.value)
    with TraceStore.open() as s:
        s.add_episode(make_episode(0))
    assert (tmp_path / ".marft" / "traces.db").is_file()
    with TraceStore.open(tmp_path / ".marft" / "traces.db") as s:
        assert s.count() == 1
        mode = s._engine.connect().exec_driver_sql("pragma journal_mode").scalar()
        assert mode == "wal"
    with pytest.raises(MarftError, match="cannot open trace store"):
        TraceStore.open("postgresql://nobody@127.0.0.1:1/none")
    (tmp_path / "notadb").write_text("hello\n" * 1000)
    with pytest.raises(MarftError, match="cannot open trace store .*notadb: file is not a database"):
        TraceStore.open(tmp_path / "notadb")
    with pytest.raises(MarftError, match="in-memory SQLite trace store is not supported"):
        TraceStore.open("sqlite://")
    (tmp_path / "file").write_text("")
    with pytest.raises(MarftError, match="cannot create the trace store directory"):
        TraceStore.open(tmp_path / "file" / "t.db")


def test_closed_store_refuses_work_but_submit_never_raises(store_url):
    s = TraceStore.open(store_url)
    s.close()
    s.close()
    with pytest.raises(MarftError, match="is closed"):
        s.add_episode(make_episode(0))
    for read in (lambda: s.has_episode("x"), lambda: s.action_ids("x"), lambda: s.episode_rows()):
        with pytest.raises(MarftError, match="is closed"):
            read()
    s.submit(make_episode(0))  # capture hooks call this; it must not raise into the app
    assert s.dropped == 1


def test_oversized_record_is_refused_and_its_dead_letter_is_capped(store):
    from marft_bridge.schema import MAX_TEXT_CHARS
    from marft_bridge.store.rows import MAX_DEAD_LETTER_CHARS

    raw = make_episode(0).model_dump(mode="json")
    raw["actions"][1]["output"]["text"] = "y" * (MAX_TEXT_CHARS + 5)
    with pytest.raises(RecordError) as e:
        store.add_episode(raw)
    assert (e.value.record, e.value.field) == ("episode ep0", "actions.1.output.text")
    (letter,) = store.dead_letters()
    assert letter.field == "actions.1.output.text"
    assert letter.raw.startswith('{"schema_version": 3, "id": "ep0"')
    assert len(letter.raw) < MAX_DEAD_LETTER_CHARS + 100 and letter.raw.endswith("chars kept]")
    assert store.count() == 0


# -- background writer --------------------------------------------------------------------------


def test_submit_and_flush_write_everything_and_never_raise(store):
    for i in range(40):
        store.submit(make_episode(i))
    store.submit({"id": "bad", "actions": [{"agent": "a", "depends_on": ["x"]}]})
    store.submit("{oops")
    assert store.flush(timeout=60)
    assert store.count() == 40
    assert store.stats()["dead_letters"] == 2


def test_submit_snapshots_the_episode(store):
    ep = make_episode(0)
    store.submit(ep)
    ep.actions.append(Action(id="after", agent="coder", step=9))
    store.flush()
    assert [a.id for a in store.get_episode("ep0").actions] == ["0-a0", "0-a1", "0-a2"]


def test_drop_policy_counts_what_a_full_queue_dropped(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    store = TraceStore.open(url, queue_size=2, on_full="drop")
    blocker = sa.create_engine(url).connect()
    blocker.exec_driver_sql("BEGIN IMMEDIATE")  # the writer thread waits on this lock
    try:
        store.submit(make_episode(0))
        writer = store._writer
        while writer._items:  # the writer took episode 0 and is waiting for the lock
            threading.Event().wait(0.01)
        for i in range(1, 8):
            store.submit(make_episode(i))
        assert store.dropped == 5
    finally:
        blocker.exec_driver_sql("ROLLBACK")
        blocker.close()
    assert store.flush(timeout=60)
    assert [e.id for e in store.episodes()] == ["ep0", "ep1", "ep2"]
    assert store.stats()["dropped"] == 5
    store.close()


def test_queued_episodes_are_written_in_order_with_refusals_and_merges(store):
    # One group commit: valid episodes share a transaction; a record that does not validate alone is
    # judged in its place in the order (refused, or merged as the half of a stored episode).
    half = {"id": "ep0", "actions": [{"id": "late", "agent": "critic", "step": 3, "depends_on": ["0-a2"]}]}
    store.submit(make_episode(0))
    store.submit({"id": "bad", "actions": [{"agent": "a", "depends_on": ["ghost"]}]})
    store.submit(make_episode(1))
    store.submit(half)  # invalid alone: depends on actions of the stored half
    store.submit(make_episode(1))  # an identical resend merges as a no-op
    store.submit(make_episode(2))
    assert store.flush(timeout=60)
    assert [e.id for e in store.episodes()] == ["ep0", "ep1", "ep2"]
    assert [a.id for a in store.get_episode("ep0").actions] == ["0-a0", "0-a1", "0-a2", "late"]
    assert store.get_episode("ep1") == make_episode(1)
    assert [d.record for d in store.dead_letters()] == ["episode bad"]
    cursor, ids = store.changed_since(0)
    assert ids == ["ep0", "ep1", "ep2"]


def test_a_failed_group_transaction_is_written_one_by_one(store):
    store.add_episode(make_episode(1))
    conflict = make_episode(1).model_dump(mode="json")
    conflict["actions"][0]["output"]["text"] = "other"  # valid alone; the merge is refused
    store.write_queued([make_episode(0).model_dump_json(), conflict, make_episode(2).model_dump_json()])
    assert [e.id for e in store.episodes()] == ["ep0", "ep1", "ep2"]
    assert store.get_episode("ep1") == make_episode(1)
    (letter,) = store.dead_letters()
    assert letter.record == "episode ep1" and "already stored with other content" in letter.reason


def test_submit_snapshots_a_dict_and_refuses_what_is_not_json(store):
    data = make_episode(0).model_dump()
    store.submit(data)
    data["actions"].clear()
    store.submit({"id": "odd", "actions": [{"id": "x", "agent": "a", "metadata": {"obj": object()}}]})
    assert store.flush(timeout=60)
    assert [a.id for a in store.get_episode("ep0").actions] == ["0-a0", "0-a1", "0-a2"]
    assert not store.has_episode("odd")
    (letter,) = store.dead_letters()
    assert letter.record == "episode odd" and "JSON" in letter.reason


def test_submit_refuses_exactly_what_add_episode_refuses(store):
    # The queue copies dicts faithfully: a key JSON would turn into "1" is still refused.
    bad = {"actions": [{"id": "a", "agent": "x"}], "metadata": {1: "an int key"}}
    with pytest.raises(RecordError) as direct:
        store.add_episode({**bad, "id": "k1"})
    store.submit({**bad, "id": "k2"})
    assert store.flush(timeout=60)
    assert store.count() == 0
    queued, first = store.dead_letters()
    assert (queued.record, first.record) == ("episode k2", "episode k1")
    assert queued.field == first.field == direct.value.field and queued.reason == first.reason


def test_a_full_queue_blocks_the_submitter_until_the_writer_drains(tmp_path):
    store = TraceStore.open(tmp_path / "t.db", queue_size=1, on_full="block")
    for i in range(20):
        store.submit(make_episode(i))
    assert store.flush(timeout=60)
    assert [e.id for e in store.episodes()] == [f"ep{i}" for i in range(20)]
    assert store.dropped == 0
    store.close()


def test_submitted_episodes_are_written_at_interpreter_exit(store_url):
    script = (
        "import sys\n"
        "from marft_bridge.store import TraceStore\n"
        "from marft_bridge.schema import Episode, Action\n"
        "s = TraceStore.open(sys.argv[1])\n"
        "for i in range(25):\n"
        "    s.submit(Episode(id=f'x{i}', actions=[Action(agent='a')]))\n"
        # no flush, no close: the atexit hook must drain the queue
    )
    subprocess.run([sys.executable, "-c", script, store_url], check=True, timeout=120)
    with TraceStore.open(store_url) as s:
        assert s.count() == 25


def test_dead_letter_is_public(store):
    store.dead_letter(RecordError("upstream line 3", "actions.0.agent", "too long"), {"id": "x", "n": 1})
    store.dead_letter(RecordError(None, None, "not UTF-8"), b"\xff{bad")
    newest, oldest = store.dead_letters()
    assert (oldest.record, oldest.field, oldest.reason, oldest.raw) == (
        "upstream line 3", "actions.0.agent", "too long", '{"id": "x", "n": 1}')
    assert (newest.reason, newest.raw) == ("not UTF-8", "\ufffd{bad")


def test_the_store_modules_import_each_other_in_one_direction():
    """tracestore uses files and the writers; they know nothing of it (they take a store object or a callback),
    counting imports anywhere in a module, also inside functions and under TYPE_CHECKING."""
    import ast
    from pathlib import Path

    import marft_bridge.store as pkg

    root = Path(pkg.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
        graph[path.stem] = {d.split(".")[0] for d in deps} - {path.stem}
    # files takes an EpisodeFilter (a leaf: tables and rows only), the writers nothing of the store.
    assert graph["files"] == {"records", "filters"} and graph["writer"] == set()
    assert graph["filters"] == {"tables", "rows"}
    assert {"files", "writer_process", "writer_groups", "records", "tables"} <= graph["tracestore"]
    assert graph["writer_process"] == {"writer"}

    def reach(start: str, seen: set[str]) -> set[str]:
        for d in graph.get(start, ()):
            if d not in seen:
                seen.add(d)
                reach(d, seen)
        return seen

    assert all(m not in reach(m, set()) for m in graph), graph
