"""Import type-checks every column before use (issue 34): a JSONL field or a Parquet column holding a
wrong type refuses that record (dead-lettered with its reason), never a traceback, and the rest of
the file is imported. Property tests over wrong types per column, both formats; and Episode.group /
Episode.release round-trip through the store (add/get, merge, export/import JSONL and Parquet)."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marft_bridge.errors import RecordError
from marft_bridge.schema import Action, Episode, EpisodeGroup, Output, Reward, parse_episode
from marft_bridge.store import TraceStore

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def episode(eid: str, n: int = 2) -> Episode:
    acts = [Action(id=f"{eid}-a{k}", agent=("planner", "coder")[k % 2], step=k,
                   output=Output(text=f"out {k}", token_ids=[k], logprobs=[-0.5]),
                   depends_on=[f"{eid}-a{k - 1}"] if k else []) for k in range(n)]
    return Episode(id=eid, source="manual", task={"q": eid}, actions=acts, started_at=T0,
                   rewards=[Reward(id=f"{eid}-r", value=1.0, source="checker", created_at=T0)] if n else [],
                   group=EpisodeGroup(task_id=f"task-{eid}", rollout=1), release="r3")


def stored_ids(store: TraceStore) -> list[str]:
    return [e.id for e in store.episodes()]


# Values of many JSON types; each test keeps those of a wrong type for the column it breaks.
json_values = st.one_of(
    st.integers(-3, 3), st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.none(),
    st.text(max_size=4), st.lists(st.integers(0, 3), max_size=2), st.lists(st.lists(st.integers(), max_size=1),
                                                                           max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=2))
EPISODE_FIELDS = sorted(Episode.model_fields)
ACTION_FIELDS = sorted(Action.model_fields)
REWARD_FIELDS = sorted(Reward.model_fields)


def columns():
    return st.one_of(st.sampled_from([(f,) for f in EPISODE_FIELDS]),
                     st.sampled_from([("actions", 1, f) for f in ACTION_FIELDS]),
                     st.sampled_from([("rewards", 0, f) for f in REWARD_FIELDS]))


def set_path(data: dict, path: tuple, value) -> None:
    for p in path[:-1]:
        data = data[p]
    data[path[-1]] = value


@SETTINGS
@given(column=columns(), value=json_values, merge=st.booleans())
def test_jsonl_a_wrong_type_in_any_field_refuses_that_record_only(tmp_path_factory, column, value, merge):
    """B's field set to a value of another JSON type: B is refused exactly when the schema refuses it
    alone (new episode), or the merge of B into the stored half judges it; A and C are always imported,
    nothing raises, and each refusal is a dead letter with its reason."""
    tmp = tmp_path_factory.mktemp("jsonl")
    b = episode("B").model_dump(mode="json")
    if merge:  # B arrives as a second half of a stored episode: the merge path reads B's fields too
        b["id"] = "S"
        for k, a in enumerate(b["actions"]):
            a["id"] = f"S-b{k}"
            a["depends_on"] = [f"S-b{k - 1}"] if k else []
        b["rewards"][0]["id"] = "S-rb"
    set_path(b, column, value)
    lines = [episode("A").model_dump_json(), json.dumps(b), episode("C").model_dump_json()]
    path = tmp / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with TraceStore.open(tmp / "t.db", writer="thread") as store:
        if merge:
            store.add_episode(episode("S"))
        before = store.get_episode("S", exact=True) if merge else None
        report = store.import_(path)
        assert report.added + report.refused == 3 and report.refused <= 1
        assert {"A", "C"} <= set(stored_ids(store))
        assert store.stats()["dead_letters"] == report.refused
        for r in report.refusals:
            assert r.record.startswith("in.jsonl line 2") and r.reason
        if merge:
            if report.refused:
                assert store.get_episode("S", exact=True) == before  # a refused half changes nothing
        else:
            try:
                parse_episode(json.dumps(b))
                expect_refused = False
            except RecordError:
                expect_refused = True
            assert report.refused == expect_refused
            assert ("B" in stored_ids(store)) == (not expect_refused and b.get("id") == "B")


# -- Parquet ---------------------------------------------------------------------------------------

PARQUET_COLUMNS = ["episode_id", "action_index", "action_json", "episode_json", "rewards_json"]
ACTION_COLUMNS = {"action_index", "action_json"}
# Values pyarrow stores in a column of their own type; each test keeps those that are not the column's.
parquet_values = st.one_of(
    st.integers(-3, 3), st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.none(),
    st.text(max_size=4), st.binary(max_size=4), st.lists(st.integers(0, 3), max_size=2),
    st.fixed_dictionaries({"x": st.integers(0, 3)}))


def wrong_for(column: str, value) -> bool:
    if column == "action_index":  # a whole number (a whole float too: pandas writes ints with nulls so)
        return not (isinstance(value, int) and not isinstance(value, bool)
                    or isinstance(value, float) and value.is_integer())
    return not isinstance(value, str)  # text; null is wrong too (an action column needs both set or both null)


def parquet_file(tmp, column: str, value) -> list[dict]:
    """A (no actions), B (2 actions), C (no actions) exported, then ``column`` set to ``value`` in B's
    rows (an action column; A's and C's are null there) or in every row (an episode column)."""
    with TraceStore.open(tmp / "src.db") as src:
        for ep in (episode("A", 0), episode("B"), episode("C", 0)):
            src.add_episode(ep)
        src.export(tmp / "good.parquet")
    rows = pq.read_table(tmp / "good.parquet", columns=PARQUET_COLUMNS).to_pylist()
    assert [r["episode_id"] for r in rows] == ["A", "B", "B", "C"]
    for r in rows:
        if column not in ACTION_COLUMNS or r["episode_id"] == "B":
            r[column] = value
    pq.write_table(pa.Table.from_pylist(rows), tmp / "bad.parquet")
    return rows


@SETTINGS
@given(column=st.sampled_from(PARQUET_COLUMNS), value=parquet_values)
def test_parquet_a_wrong_type_in_any_column_refuses_those_rows_only(tmp_path_factory, column, value):
    if not wrong_for(column, value):
        return
    tmp = tmp_path_factory.mktemp("pq")
    parquet_file(tmp, column, value)
    with TraceStore.open(tmp / "t.db") as store:
        report = store.import_(tmp / "bad.parquet")  # never a traceback
        assert store.stats()["dead_letters"] == report.refused
        if column in ACTION_COLUMNS:
            # B alone is refused, naming its rows and the column; A and C are imported.
            assert (report.added, report.refused) == (2, 1) and stored_ids(store) == ["A", "C"]
            assert report.refusals[0].record == "bad.parquet rows 1-2"
            assert column in report.refusals[0].reason
        elif column == "episode_id":  # every row's id is the same wrong value: one record, refused
            assert (report.added, report.refused) == (0, 1) and stored_ids(store) == []
            assert report.refusals[0].record == "bad.parquet rows 0-3"
            assert "episode_id" in report.refusals[0].reason
        else:
            assert (report.added, report.refused) == (0, 3) and stored_ids(store) == []
            assert [r.record for r in report.refusals] == [f"bad.parquet rows {a}" for a in ("0-0", "1-2", "3-3")]
            assert all(column in r.reason for r in report.refusals)


def test_an_integer_action_json_column_is_refused_with_its_reason(tmp_path):
    """The issue's file: integers where action_json holds text (it ended in a TypeError traceback)."""
    parquet_file(tmp_path, "action_json", 7)
    with TraceStore.open(tmp_path / "t.db") as store:
        report = store.import_(tmp_path / "bad.parquet")
        assert (report.added, report.refused) == (2, 1)
        assert report.refusals[0].reason == "bad.parquet rows 1-2: action_json: row 1 holds int, not text or null"
        (letter,) = store.dead_letters()
        assert (letter.record, letter.field) == ("bad.parquet rows 1-2", "action_json")
        assert json.loads(letter.raw)[0]["action_json"] == 7  # the offending row is the one kept


def test_a_merge_half_with_agents_that_are_not_text_is_refused_not_a_type_error(store):
    store.add_episode(episode("S"))
    with pytest.raises(RecordError, match=r"^episode S: agents\.0: an agent name must be text, not list$"):
        store.add_episode({"id": "S", "agents": [["x"]]})
    with pytest.raises(RecordError, match=r"^episode S: metadata: must be an object, not int$"):
        store.add_episode({"id": "S", "metadata": 5})
    assert store.stats()["dead_letters"] == 2


# -- Episode.group and Episode.release ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_group_and_release_round_trip_through_the_store_and_files(store, tmp_path, fmt):
    ep = episode("G")
    store.add_episode(ep)
    got = store.get_episode("G")
    assert (got.group, got.release) == (EpisodeGroup(task_id="task-G", rollout=1), "r3") and got == ep
    plain = Episode(id="P", started_at=T0)  # neither set: both stay None
    store.add_episode(plain)
    assert (store.get_episode("P").group, store.get_episode("P").release) == (None, None)
    path = tmp_path / f"out.{fmt}"
    assert store.export(path) == 2
    with TraceStore.open(tmp_path / "copy.db") as copy:
        assert copy.import_(path).added == 2
        assert copy.get_episode("G") == ep and copy.get_episode("P") == plain


def test_a_second_half_sets_group_and_release(store):
    store.add_episode(Episode(id="H", started_at=T0, actions=[Action(id="h0", agent="a")]))
    store.add_episode({"id": "H", "actions": [{"id": "h1", "agent": "a", "depends_on": ["h0"]}],
                       "group": {"task_id": "t", "rollout": 4}, "release": "r9"})
    got = store.get_episode("H")
    assert [a.id for a in got.actions] == ["h0", "h1"]
    assert (got.group, got.release) == (EpisodeGroup(task_id="t", rollout=4), "r9")
    with pytest.raises(RecordError, match=r"group\.rollout"):
        store.add_episode({"id": "H", "group": {"task_id": "t", "rollout": -1}})
    assert store.get_episode("H") == got
