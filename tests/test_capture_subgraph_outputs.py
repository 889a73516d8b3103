"""What a subgraph hands back, value by value: a parent channel it writes holds the provenance of the
subgraph channel the value came from, not of everything the subgraph did — whether the subgraph is
a node of its own or a node invokes it by hand. The node's trigger still carries all of it (the
routing edge)."""

from __future__ import annotations

from typing import TypedDict

from langgraph.graph import END, START, StateGraph
from test_capture_langgraph import fake, team_subgraph

import marft_bridge as mb


class Outer(TypedDict, total=False):
    q: str
    plan: str
    draft: str
    final: str
    post: str


class PlanOnly(TypedDict):
    plan: str


def app(team_node):
    planner, editor, publisher = fake("plan"), fake("final"), fake("posted")
    g = StateGraph(Outer)
    g.add_node("planner", lambda s: {"plan": planner.invoke(s["q"]).content})
    g.add_node("team", team_node)
    g.add_node("editor", lambda s: {"final": editor.invoke(s["draft"]).content})
    # reads only the plan, the value the subgraph passed through from the planner
    g.add_node("publisher", lambda s: {"post": publisher.invoke(s["plan"]).content}, input_schema=PlanOnly)
    for a, b in [(START, "planner"), ("planner", "team"), ("team", "editor"), ("editor", "publisher"),
                 ("publisher", END)]:
        g.add_edge(a, b)
    return g.compile()


def by_hand():
    sub = team_subgraph()

    def team(s):
        out = sub.invoke({"plan": s["plan"]})
        return {"plan": out["plan"], "draft": out["draft"]}

    return team


def edges(store, app) -> dict[str, list[str]]:
    store.flush()
    ep = store.get_episode(app.last_episode_id)
    names = {a.id: f"{a.agent}@{a.step}" for a in ep.actions}
    return {names[a.id]: sorted(names[d] for d in a.depends_on) for a in ep.actions}


def test_a_parent_channel_written_by_a_subgraph_node_holds_its_values_provenance(sqlite_store):
    captured = mb.instrument(app(team_subgraph()), store=sqlite_store)
    assert captured.invoke({"q": "?"})["post"] == "posted"
    assert edges(sqlite_store, captured) == {
        "planner@1": [],
        "team/researcher@2": ["planner@1"],
        "team/writer@2": ["planner@1", "team/researcher@2"],
        "editor@3": ["planner@1", "team/researcher@2", "team/writer@2"],  # team's trigger: all it handed back
        "publisher@4": ["editor@3", "planner@1"],  # the plan came through the team from the planner only
    }


def test_a_subgraph_invoked_by_hand_hands_back_each_value_with_its_provenance(sqlite_store):
    captured = mb.instrument(app(by_hand()), store=sqlite_store)
    assert captured.invoke({"q": "?"})["post"] == "posted"
    got = edges(sqlite_store, captured)
    assert got["publisher@4"] == ["editor@3", "planner@1"]
    assert got["team/writer@2"] == ["planner@1", "team/researcher@2"]


def test_a_value_the_node_computed_from_the_subgraph_carries_all_it_handed_back(sqlite_store):
    sub = team_subgraph()

    def team(s):
        out = sub.invoke({"plan": s["plan"]})
        return {"plan": out["plan"].upper(), "draft": out["draft"]}  # a new value: no channel holds it

    captured = mb.instrument(app(team), store=sqlite_store)
    assert captured.invoke({"q": "?"})["post"] == "posted"
    assert edges(sqlite_store, captured)["publisher@4"] == ["editor@3", "planner@1", "team/researcher@2",
                                                            "team/writer@2"]


def test_a_model_call_after_a_subgraph_invoked_by_hand_depends_on_what_it_handed_back(sqlite_store):
    sub, reviewer = team_subgraph(), fake("reviewed")

    def team(s):
        out = sub.invoke({"plan": s["plan"]})
        return {"plan": out["plan"], "draft": reviewer.invoke(out["draft"]).content}

    captured = mb.instrument(app(team), store=sqlite_store)
    assert captured.invoke({"q": "?"})["post"] == "posted"
    got = edges(sqlite_store, captured)
    assert got["team@2"] == ["planner@1", "team/researcher@2", "team/writer@2"]  # was: the planner only
    assert got["editor@3"] == ["planner@1", "team/researcher@2", "team/writer@2", "team@2"]
