"""The capture's contract with LangGraph: channel kinds, restorable hooks, signature changes, the
supported-version gate, and the pure provenance rules."""

from __future__ import annotations

import gc
import inspect
import logging
import operator
from typing import Annotated, Any, TypedDict

import langgraph.channels as lg_channels
import pytest
from langchain_core.callbacks import manager as lc_manager
from langchain_core.messages import HumanMessage
from langgraph.channels.base import BaseChannel
from langgraph.errors import EmptyChannelError
from langgraph.graph import START, StateGraph
from langgraph.pregel import _loop, _runner
from test_capture_langgraph import chain_app, edges, fake, stored

import marft_bridge as mb
from marft_bridge.capture import recording
from marft_bridge.integrations.langgraph import LANGGRAPH, channels, precision
from marft_bridge.integrations.langgraph import provenance as pv

# -- channel kinds -------------------------------------------------------------------------------


def test_every_channel_class_langgraph_exports_is_classified():
    exported = [getattr(lg_channels, n) for n in dir(lg_channels)]
    classes = [c for c in exported if inspect.isclass(c) and issubclass(c, BaseChannel) and c is not BaseChannel]
    assert len(classes) >= 9
    kinds = {c.__name__: channels.classify(c) for c in classes}
    assert "unknown" not in kinds.values(), kinds
    assert kinds["LastValue"] == "replace" and kinds["BinaryOperatorAggregate"] == "accumulate"
    if "DeltaChannel" in kinds:
        assert kinds["DeltaChannel"] == "accumulate"


def _list_graph(channel: Any):
    S = TypedDict("S", {"q": str, "log": Annotated[list, channel]}, total=False)  # noqa: N806

    models = {n: fake(f"{n} says") for n in "abc"}

    def node(name):
        def run(s):
            return {"log": [models[name].invoke([HumanMessage(" ".join(s.get("log", [])) or s["q"])]).content]}
        return run

    g = StateGraph(S)
    for n in "abc":
        g.add_node(n, node(n))
    g.add_edge(START, "a")
    g.add_edge("a", "b")
    g.add_edge("b", "c")
    return g.compile()


@pytest.mark.parametrize("channel", ["add", pytest.param("delta", marks=pytest.mark.skipif(
    not hasattr(lg_channels, "DeltaChannel"), reason="this LangGraph has no DeltaChannel"))])
def test_reducer_channels_accumulate_provenance(sqlite_store, channel):
    chan = operator.add if channel == "add" else lg_channels.DeltaChannel(lambda state, writes: state + sum(writes, []))
    recording.reset_capture_stats()
    app = mb.instrument(_list_graph(chan), store=sqlite_store)
    out = app.invoke({"q": "go"})
    assert out["log"] == ["a says", "b says", "c says"]
    assert edges(stored(sqlite_store, app)) == {"a@1": ("llm", []), "b@2": ("llm", ["a@1"]),
                                                "c@3": ("llm", ["a@1", "b@2"])}
    assert recording.capture_stats()["errors"] == 0
    mb.uninstrument(app)


class _Appending(BaseChannel):
    """A user's own accumulating channel, unknown to the capture."""

    def __init__(self, typ: Any = list) -> None:
        super().__init__(typ)
        self.value: list = []

    @property
    def ValueType(self) -> Any:
        return list

    @property
    def UpdateType(self) -> Any:
        return list

    def from_checkpoint(self, checkpoint: Any) -> _Appending:
        new = _Appending()
        new.key = self.key
        new.value = list(checkpoint) if isinstance(checkpoint, list) else []
        return new

    def get(self) -> list:
        if not self.value:
            raise EmptyChannelError()
        return list(self.value)

    def is_available(self) -> bool:
        return bool(self.value)

    def checkpoint(self) -> list:
        return list(self.value)

    def update(self, values: Any) -> bool:
        for v in values:
            self.value.extend(v)
        return bool(values)


def test_an_unknown_channel_class_accumulates_and_is_counted(sqlite_store):
    recording.reset_capture_stats()
    app = mb.instrument(_list_graph(_Appending()), store=sqlite_store)
    assert app.invoke({"q": "go"})["log"] == ["a says", "b says", "c says"]
    assert edges(stored(sqlite_store, app))["c@3"] == ("llm", ["a@1", "b@2"])
    assert channels.classify(_Appending) == "unknown"
    by_where = recording.capture_stats()["by_where"]
    assert [k for k in by_where if k.startswith("langgraph.unknown_channel")] == [
        f"langgraph.unknown_channel {__name__}._Appending"]
    assert sum(by_where.values()) == 1  # once per class, not per write
    mb.uninstrument(app)


# -- hooks are undone --------------------------------------------------------------------------------

_HOOKED = [(_loop.PregelLoop, "tick"), (_loop.PregelLoop, "after_tick"), (_loop.PregelLoop, "accept_push"),
           (_loop.SyncPregelLoop, "__exit__"), (_loop.AsyncPregelLoop, "__aexit__"), (_runner, "_call"),
           (_runner, "_acall")]
_LANGCHAIN = [(lc_manager.CallbackManager, "on_chat_model_start"), (lc_manager.CallbackManager, "on_llm_start"),
              (lc_manager.AsyncCallbackManager, "on_chat_model_start"),
              (lc_manager.CallbackManagerForLLMRun, "on_llm_end"), (lc_manager.CallbackManagerForLLMRun, "on_llm_error")]


def _precise() -> bool:
    """Whether the precision tier's hooks are in place (the capture state exists and applied them)."""
    return LANGGRAPH.state is not None and LANGGRAPH.state.hooks.installed


def _uninstrument_everything() -> None:
    gc.collect()
    mb.uninstrument()


def test_the_last_uninstrument_puts_every_original_back(sqlite_store):
    _uninstrument_everything()
    originals = {(o, a): vars(o)[a] for o, a in _HOOKED + _LANGCHAIN}
    assert not _precise()
    one, two = mb.instrument(chain_app(), store=sqlite_store), mb.instrument(chain_app(), store=sqlite_store)
    assert _precise() and _loop.PregelLoop.tick is not originals[(_loop.PregelLoop, "tick")]
    mb.uninstrument(one)
    assert _precise()  # another app is still instrumented
    two.invoke({"question": "q"})
    mb.uninstrument(two)
    for (owner, attr), original in originals.items():
        assert vars(owner)[attr] is original, attr
    assert _loop.PregelLoop.tick is originals[(_loop.PregelLoop, "tick")]
    with mb.capture(store=sqlite_store):
        assert _precise()
        chain_app().invoke({"question": "q"})
    assert not _precise() and _runner._call is originals[(_runner, "_call")]


def test_an_upstream_signature_change_does_not_reach_the_app(sqlite_store, monkeypatch):
    """LangGraph adds a keyword to a hooked callable and its caller passes it: the hook passes it on."""
    _uninstrument_everything()
    expected = chain_app().invoke({"question": "2+2?"})
    seen = []
    real_tick, real_enter = _loop.PregelLoop.tick, _loop.SyncPregelLoop.__enter__

    def tick(self, *, upstream_budget=None):  # the new upstream signature
        seen.append(upstream_budget)
        return real_tick(self)

    def enter(self):  # the new upstream caller: loop.tick(upstream_budget=...)
        loop = real_enter(self)
        loop.__dict__["tick"] = lambda: type(loop).tick(loop, upstream_budget=7)
        return loop

    monkeypatch.setattr(_loop.PregelLoop, "tick", tick)
    monkeypatch.setattr(_loop.SyncPregelLoop, "__enter__", enter)
    recording.reset_capture_stats()
    app = mb.instrument(chain_app(), store=sqlite_store)
    assert app.invoke({"question": "2+2?"}) == expected
    assert seen and set(seen) == {7}
    assert [a.agent for a in stored(sqlite_store, app).actions] == ["planner", "coder", "reviewer"]
    assert recording.capture_stats()["errors"] == 0
    mb.uninstrument(app)
    assert vars(_loop.PregelLoop)["tick"] is tick  # what it found is what it put back


# -- outside the supported range: public tier alone -----------------------------------------------


def test_outside_the_supported_range_the_public_tier_records_alone(sqlite_store, monkeypatch, caplog):
    _uninstrument_everything()
    monkeypatch.setattr(precision, "SUPPORTED", ((0, 1), (0, 2)))
    recording.reset_capture_stats()
    with caplog.at_level(logging.WARNING, logger="marft_bridge.capture"):
        app = mb.instrument(chain_app(), store=sqlite_store)
        out = app.invoke({"question": "2+2?"})
        app.invoke({"question": "again"})
    assert not _precise()
    assert len([r for r in caplog.records if "outside the supported range" in r.getMessage()]) == 1
    assert out["review"] == "looks right"
    ep = stored(sqlite_store, app)
    assert ep.metadata["dependency_source"] == "langgraph_run_metadata"
    # Agents, kinds and steps from run metadata; each action depends on everything before it.
    assert edges(ep) == {"planner@1": ("llm", []), "coder@2": ("llm", ["planner@1"]),
                         "reviewer@3": ("llm", ["coder@2", "planner@1"])}
    assert recording.capture_stats()["errors"] == 0
    mb.uninstrument(app)


def test_inside_the_range_episodes_say_the_dependencies_follow_channels(sqlite_store):
    app = mb.instrument(chain_app(), store=sqlite_store)
    app.invoke({"question": "q"})
    assert stored(sqlite_store, app).metadata["dependency_source"] == "langgraph_channels"
    assert precision.supported()
    mb.uninstrument(app)


# -- the provenance rules on their own ------------------------------------------------------------------


def test_writes_replace_or_accumulate_by_channel_kind():
    prov: dict[str, frozenset[str]] = {"plan": frozenset({"p0"}), "log": frozenset({"l0"})}
    acc = {"log"}.__contains__
    pv.apply_writes(prov, [(frozenset({"a"}), ["plan", "log"]), (frozenset({"b"}), ["plan"])], acc)
    # Two writes to one replace channel in one step: the reducer saw both.
    assert prov == {"plan": frozenset({"a", "b"}), "log": frozenset({"l0", "a"})}
    pv.apply_writes(prov, [(frozenset({"c"}), ["plan", "log"])], acc)
    assert prov == {"plan": frozenset({"c"}), "log": frozenset({"l0", "a", "c"})}
    assert pv.inputs(prov, ["plan", "missing"]) == frozenset({"c"})
    pv.drop_cleared(prov, lambda ch: ch != "plan")
    assert prov == {"log": frozenset({"l0", "a", "c"})}


def test_a_checkpointed_thread_keeps_what_still_holds():
    then = {"plan": frozenset({"a"}), "log": frozenset({"b"}), "note": frozenset({"c"})}
    versions_then = {"plan": 1, "log": 1, "note": 1}
    now = {"plan": 2, "log": 2, "note": 1}  # plan and log changed outside the captured runs
    assert pv.restore(then, versions_then, now, {"log"}.__contains__) == {"log": frozenset({"b"}),
                                                                          "note": frozenset({"c"})}


def test_task_results_and_what_a_task_has_seen():
    run = object()
    caller = pv.Task("t0", run, "main", "main", 0, [0], "", frozenset({"in"}))
    child = pv.Task("t1", run, "child", "child", 0, [0], "", frozenset({"in"}))
    child.actions.append("c1")
    assert pv.seen(caller) == {"in"}
    caller.received.add(child)
    caller.actions.append("m1")
    assert pv.seen(caller) == {"in", "m1", "c1"}
    assert pv.result(child) == {"c1"} and pv.task_output(child) == {"c1"}
    silent = pv.Task("t2", run, "env", "env", 0, [0], "", frozenset({"in"}))
    assert pv.task_output(silent) is None  # recorded as an env step first
    silent.calls = 1
    assert pv.task_output(silent) == {"in"}  # its calls failed to record: the inputs pass on
    late = pv.Task("t3", run, "late", "late", 2, [2], "", frozenset())
    early = pv.Task("t4", run, "early", "early", 1, [1], "", frozenset())
    early.actions.append("e1")
    same = pv.Task("t5", run, "same", "same", 2, [2], "", frozenset())
    same.actions.append("s1")
    assert pv.public_deps([late, early, same], late) == {"e1"}


def test_capture_blocks_work_on_the_public_tier_alone(sqlite_store, monkeypatch):
    _uninstrument_everything()
    monkeypatch.setattr(precision, "SUPPORTED", ((0, 1), (0, 2)))
    recording.reset_capture_stats()
    with mb.capture(store=sqlite_store) as c:
        assert chain_app().invoke({"question": "q"})["review"] == "looks right"
        fake("plain call outside any graph").invoke("hi")  # no graph run: no episode
        chain_app().invoke({"question": "again"})
    assert not _precise() and len(c.episode_ids) == 2
    sqlite_store.flush()
    for eid in c.episode_ids:
        ep = sqlite_store.get_episode(eid)
        assert [a.agent for a in ep.actions] == ["planner", "coder", "reviewer"]
        assert ep.metadata["dependency_source"] == "langgraph_run_metadata" and ep.task["question"] in ("q", "again")
    assert recording.capture_stats()["errors"] == 0
