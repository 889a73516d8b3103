"""One ``EpisodeFilter`` shared by the store's ``episodes``, ``count``, ``episode_rows`` and ``export``
(issue 32): the keyword arguments build it, an object and keywords combine, a bad filter fails when
the call is made, and the four agree on what they select. And the group commit as a collaborator of
the store, built with explicit callables."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import sqlalchemy as sa
from test_store import T0, make_episode

from marft_bridge.errors import MarftError, RecordError
from marft_bridge.limits import RecordLimits
from marft_bridge.store import EpisodeFilter, TraceStore
from marft_bridge.store.rows import to_data
from marft_bridge.store.transactions import WriteTransactions
from marft_bridge.store.writer import Snapshot
from marft_bridge.store.writer_groups import GroupCommit, validated_rows


@pytest.fixture
def six(store):
    """ep0..ep5 a minute apart; odd ones from mcp; ep3..ep5 by agent solo; ep4 rewarded."""
    for i in range(6):
        store.add_episode(make_episode(i, source="mcp" if i % 2 else "langgraph",
                                       agents=("planner", "coder") if i < 3 else ("solo",)))
    store.add_reward("ep4", 1.0)
    return store


def test_a_filter_object_and_keywords_select_the_same(six, tmp_path):
    f = EpisodeFilter(source="mcp", newest_first=True)
    assert [e.id for e in six.episodes(f)] == ["ep5", "ep3", "ep1"]
    assert [e.id for e in six.episodes(source="mcp", newest_first=True)] == ["ep5", "ep3", "ep1"]
    # Keywords lay over the object's fields.
    assert [e.id for e in six.episodes(f, limit=2)] == ["ep5", "ep3"]
    assert [e.id for e in six.episodes(f, source="langgraph")] == ["ep4", "ep2", "ep0"]
    assert [r["id"] for r in six.episode_rows(f)] == ["ep5", "ep3", "ep1"]
    assert six.count(f) == 3 and six.count(source="mcp") == 3
    assert six.count(f, limit=2) == 2  # count is how many ``episodes`` lists, at most its limit
    assert six.count(EpisodeFilter(agent="solo", has_reward=False)) == 2
    assert six.export(tmp_path / "out.jsonl", where=EpisodeFilter(agent="solo"), has_reward=True) == 1
    assert [json.loads(x)["id"] for x in (tmp_path / "out.jsonl").read_text().splitlines()] == ["ep4"]


@pytest.mark.parametrize("f, expected", [
    (EpisodeFilter(), ["ep0", "ep1", "ep2", "ep3", "ep4", "ep5"]),
    (EpisodeFilter(agent="coder", source="langgraph"), ["ep0", "ep2"]),
    (EpisodeFilter(since=T0 + timedelta(minutes=2), until=T0 + timedelta(minutes=4)), ["ep2", "ep3"]),
    (EpisodeFilter(has_reward=True), ["ep4"]),
    (EpisodeFilter(ids=["ep5", "ep1", "nope"]), ["ep1", "ep5"]),
    (EpisodeFilter(ids=["ep5", "ep1"], source="langgraph"), []),
    (EpisodeFilter(limit=0), []),
    (EpisodeFilter(agent="planner", newest_first=True, limit=2), ["ep2", "ep1"]),
])
def test_episodes_count_rows_and_export_agree(six, tmp_path, f, expected):
    assert [e.id for e in six.episodes(f)] == expected
    assert [r["id"] for r in six.episode_rows(f)] == expected
    assert six.count(f) == len(expected)
    path = tmp_path / "out.jsonl"
    assert six.export(path, where=f) == len(expected)
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == expected


def test_a_bad_filter_fails_at_the_call(store):
    with pytest.raises(MarftError, match="not an ISO date/time: 'yesterday'"):
        store.episodes(since="yesterday")  # at the call: nothing iterated yet
    with pytest.raises(MarftError, match="filter has_reward must be True, False or None, not 'yes'"):
        EpisodeFilter(has_reward="yes")
    with pytest.raises(MarftError, match="filter limit must be a whole number >= 0 or None, not -1"):
        store.count(limit=-1)
    with pytest.raises(MarftError, match="filter source must be text, not int"):
        store.episode_rows(source=3)
    with pytest.raises(MarftError, match="filter ids must be a list of episode ids"):
        EpisodeFilter(ids="ep1")
    with pytest.raises(TypeError, match="unknown episode filter\\(s\\) sauce; use: source, agent"):
        store.count(sauce="mcp")
    with pytest.raises(TypeError, match="expected an EpisodeFilter, not dict"):
        store.count({"source": "mcp"})
    assert EpisodeFilter(ids=["a"]) == EpisodeFilter(ids=("a",))  # kept as a tuple: frozen and hashable


# -- the group commit, a collaborator --------------------------------------------------------------


def test_the_group_commit_uses_only_the_callables_it_is_given(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    TraceStore.open(url).close()  # creates the tables
    engine = sa.create_engine(url)
    limits = RecordLimits()
    calls: list[tuple[str, object]] = []

    def validate(data):
        if (data["id"] if isinstance(data, dict) else json.loads(data)["id"]) == "ep1":
            raise RecordError("episode ep1", None, "refused by the test")
        return validated_rows(data, limits)

    def record(name, result=None):
        return lambda *args: calls.append((name, args[-1] if name != "merge" else args[1])) or result

    groups = GroupCommit(WriteTransactions(engine), validate=validate,
                         to_data=lambda item: record("to_data")(item) or to_data(item, limits),
                         add_one=record("add_one"), dead_letter=record("dead_letter"), merge_tx=record("merge", True))
    items = [make_episode(0).model_dump_json(), make_episode(1).model_dump_json(), make_episode(2).model_dump()]
    groups.write_queued(items)
    # ep1 did not validate alone: handed to add_one in its place; ep0 and ep2 (a dict: to_data) written.
    assert calls == [("add_one", items[1]), ("to_data", items[2])]
    with TraceStore.open(url) as store:
        assert [e.id for e in store.episodes()] == ["ep0", "ep2"]
        assert store.get_episode("ep2") == make_episode(2)
        assert store.changed_since(0)[1] == ["ep0", "ep2"]
    # An id already stored is merged through merge_tx, in the group's transaction.
    groups.write_queued([make_episode(0).model_dump_json()])
    assert calls[-1] == ("merge", "ep0")
    broken = Snapshot(b"not a pickle")
    groups.write_queued([broken])  # cannot be loaded back: dead-lettered, never raised
    assert calls[-1] == ("dead_letter", broken)
    engine.dispose()
