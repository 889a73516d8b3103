"""The shared recording core: explicit and implicit episodes, threads, asyncio, rewards, errors."""

from __future__ import annotations

import asyncio
import threading

import pytest

from marft_bridge.capture import recording as rec
from marft_bridge.capture_errors import guarded


def test_episode_records_actions_rewards_and_submits(sqlite_store):
    with rec.episode(store=sqlite_store, task={"q": "2+2"}, source="unit") as ep:
        assert rec.current_episode() is ep
        a = ep.record_action("planner", output={"text": "plan"})
        b = ep.record_action("coder", depends_on=[a], output={"text": "4"}, policy={"name": "coder", "version": 3})
        ep.reward(1.0, source="checker")
        ep.reward(0.5, agent="coder", source="judge")
    assert rec.current_episode() is None
    sqlite_store.flush()
    got = sqlite_store.get_episode(ep.id)
    assert got.task == {"q": "2+2"} and got.source == "unit" and got.status == "completed"
    assert [(x.agent, x.step, x.depends_on) for x in got.actions] == [("planner", 0, []), ("coder", 1, [a])]
    assert got.actions[1].id == b and got.actions[1].policy.version == 3
    assert got.actions[0].token_source == "retokenize"
    assert [(r.value, r.agent, r.source) for r in got.rewards] == [(1.0, None, "checker"), (0.5, "coder", "judge")]
    # a reward after the block goes to the store as a late reward
    ep.reward(2.0, source="user")
    assert [r.value for r in sqlite_store.get_episode(ep.id).rewards] == [1.0, 0.5, 2.0]


def test_step_never_below_a_dependency_and_unknown_deps_dropped(sqlite_store):
    rec.reset_capture_stats()
    with rec.episode(store=sqlite_store) as ep:
        a = ep.record_action("x", step=4)
        b = ep.record_action("y", step=2, depends_on=[a, "nope"])
    assert ep.episode.action(b).step == 4 and ep.episode.action(b).depends_on == [a]
    assert rec.capture_stats()["by_where"] == {"recording.depends_on": 1}
    assert ep.episode.metadata["capture_errors"] == 1


def test_action_links_are_the_graph_in_order_and_copies(sqlite_store):
    with rec.episode(store=sqlite_store) as ep:
        a = ep.record_action("planner", output={"text": "plan"})
        t = ep.record_action("search", kind="tool", depends_on=[a])
        links = ep.action_links()
        assert links == [("llm", "planner", 0, a, []), ("tool", "search", 1, t, [a])]
        links[1][4].append("changed")  # the caller's copy, not the recorder's record
        assert ep.action_links()[1] == ("tool", "search", 1, t, [a])


def test_reward_for_unknown_agent_is_refused_clearly(sqlite_store):
    with rec.episode(store=sqlite_store) as ep:
        ep.record_action("x")
        with pytest.raises(ValueError, match="agent 'nobody' has no action"):
            ep.reward(1.0, agent="nobody")


def test_failed_block_marks_episode_failed(sqlite_store):
    with pytest.raises(KeyError):
        with rec.episode(store=sqlite_store) as ep:
            ep.record_action("x")
            raise KeyError("boom")
    assert ep.episode.status == "failed" and "boom" in ep.episode.metadata["error"]


def test_implicit_episode_joins_open_episode_or_opens_its_own(sqlite_store):
    with rec.episode(store=sqlite_store) as outer:
        with rec.implicit_episode(store=sqlite_store, source="langgraph") as (r, owned):
            assert r is outer and not owned
    with rec.implicit_episode(store=sqlite_store, source="langgraph", task="t") as (r, owned):
        assert owned and rec.current_episode() is r
        r.record_action("a")
    assert r.closed and r.episode.source == "langgraph" and r.episode.task == "t"


def test_context_reaches_asyncio_tasks_and_wrapped_threads(sqlite_store):
    async def agent(name):
        rec.current_episode().record_action(name)

    async def main():
        with rec.episode(store=sqlite_store) as ep:
            await asyncio.gather(agent("a"), agent("b"))
        return ep

    ep = asyncio.run(main())
    assert sorted(a.agent for a in ep.episode.actions) == ["a", "b"]

    with rec.episode(store=sqlite_store) as ep2:
        seen = []
        t = threading.Thread(target=ep2.wrap(lambda: seen.append(rec.current_episode())))
        t.start()
        t.join()
    assert seen == [ep2]


def test_guarded_counts_and_swallows(sqlite_store):
    rec.reset_capture_stats()
    with rec.episode(store=sqlite_store) as ep:
        with guarded("unit.test", ep):
            raise RuntimeError("capture bug")
    assert rec.capture_stats()["errors"] == 1 and ep.episode.metadata["capture_errors"] == 1


def test_listeners_see_finished_episodes(sqlite_store):
    seen = []
    rec.add_episode_listener(seen.append)
    try:
        with rec.episode(store=sqlite_store) as ep:
            ep.record_action("a")
    finally:
        rec.remove_episode_listener(seen.append)
    assert [e.id for e in seen] == [ep.id]


def test_repeated_capture_errors_are_counted_but_logged_once(caplog):
    rec.reset_capture_stats()
    with caplog.at_level("WARNING", logger="marft_bridge.capture"):
        for _ in range(5):
            rec.capture_error("unit.repeat", RuntimeError("same bug"))
    assert rec.capture_stats()["by_where"] == {"unit.repeat": 5}
    assert len([r for r in caplog.records if "unit.repeat" in r.getMessage()]) == 1


def test_jsonable_keeps_plain_inputs_and_flattens_messages():
    from langchain_core.messages import HumanMessage

    flat = {"q": "x", "n": 1}
    assert rec.jsonable(flat) == flat and rec.jsonable(flat) is not flat
    assert rec.jsonable({"messages": [HumanMessage("hi")], "tags": {"a"}}) == {
        "messages": [{"role": "human", "content": "hi"}], "tags": ["a"]}


def test_registry_is_per_episode_and_inherited_by_nested_ones(sqlite_store, tmp_path):
    root = tmp_path / "registry"
    with rec.episode(store=sqlite_store) as plain:
        assert plain.registry is None
    with rec.episode(store=sqlite_store, registry=root) as outer:
        assert outer.registry == root and rec.current_episode().registry == root
        with rec.episode() as inner:
            assert inner.registry == root and inner.store is sqlite_store
        with rec.episode(registry=tmp_path / "other") as own:
            assert own.registry == tmp_path / "other"
        with rec.implicit_episode(registry=tmp_path / "other") as (joined, owned):
            assert joined is outer and not owned and joined.registry == root  # the episode's own wins
    with rec.implicit_episode(store=sqlite_store, registry=root) as (fresh, owned):
        assert owned and fresh.registry == root
    with rec.episode(store=sqlite_store) as bare:
        with rec.implicit_episode(registry=root) as (joined, owned):
            assert joined is bare and bare.registry == root  # joined without one: takes the caller's
