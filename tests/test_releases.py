"""Team releases over a real `marft serve`: promote/rollback the whole team, a canary share sticky per
episode that never mixes releases inside an episode (a 2-agent LangGraph app with ChatOpenAI), and a
probe that catches an adapter whose weights were swapped on disk behind the registry's back."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from typing import TypedDict

import pytest

pytest.importorskip("torch")

from marft_bridge.release_names import in_canary  # noqa: E402
from marft_bridge.serving.adapter_files import AdapterError  # noqa: E402
from marft_bridge.serving.fixtures import make_random_adapter  # noqa: E402
from marft_bridge.serving.publishers import EmbeddedServerPublisher  # noqa: E402
from marft_bridge.serving.registry import AdapterRegistry  # noqa: E402
from marft_bridge.serving.releases import ReleaseStore  # noqa: E402

KEY = "rel-key"
AGENTS = ("planner", "coder")


@pytest.fixture(scope="module")
def registry(tiny_model_dir, tmp_path_factory):
    """planner and coder, v1 and v2 each (random adapters whose outputs differ)."""
    tmp = tmp_path_factory.mktemp("releases")
    reg = AdapterRegistry(tmp / "registry")
    for i, agent in enumerate(AGENTS):
        for v in (1, 2):
            reg.publish(agent, make_random_adapter(tiny_model_dir, tmp / f"{agent}{v}", seed=10 * i + v, scale=3.0))
    return reg


@pytest.fixture(scope="module")
def server(tiny_model_dir, registry):
    from marft_bridge.serving.process import ServerProcess

    with ServerProcess(tiny_model_dir, registry.root, api_key=KEY, extra_args=["--threads", "1"]) as srv:
        yield srv


def _cli(store_root, *argv) -> str:
    from marft_bridge.serving import releases_cli

    parser = argparse.ArgumentParser(prog="marft")
    releases_cli.add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["releases", *argv, "--registry", str(store_root)])
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    return out.getvalue()


def test_promote_and_rollback_move_the_whole_team(tmp_path, registry):
    reg = AdapterRegistry(tmp_path / "reg")
    for agent in AGENTS:
        for v in (1, 2):
            reg.publish(agent, registry.path(agent, v))
    store = ReleaseStore(reg)
    r1 = store.adopt({"planner": 1, "coder": 1}, by="test")
    r2 = store.create({"planner": 2, "coder": 1}, gate_score=0.5, live_score=0.25)
    assert (r1.id, r2.id, r2.parent) == ("r1", "r2", "r1")
    with pytest.raises(AdapterError, match="no version 9"):
        store.create({"planner": 9})
    with pytest.raises(ValueError, match="frozen"):  # immutable
        r2.gate_score = 1.0  # type: ignore[misc]
    diff = {row["agent"]: row for row in store.diff("r1", "r2")}
    assert diff["planner"]["changed"] and not diff["coder"]["changed"]
    assert diff["planner"]["r2_sha256"] == reg.manifest("planner", 2).sha256 != diff["planner"]["r1_sha256"]

    store.promote("r2", by="test", reason="gate")
    assert {a: reg.current(a) for a in AGENTS} == {"planner": 2, "coder": 1} and store.state().stable == "r2"
    back = store.rollback(by="test")
    assert back.id == "r1" and {a: reg.current(a) for a in AGENTS} == {"planner": 1, "coder": 1}
    assert store.state().history == ["r1"]
    with pytest.raises(AdapterError, match="no earlier stable"):
        store.rollback()

    # A kill between recording a promotion and applying it: recover finishes it, once.
    state = store.state()
    state.pending = {"op": "promote", "release": "r2", "by": "test", "reason": "killed"}
    (store.dir / "state.json").write_text(state.model_dump_json())
    assert store.recover() == "finished the interrupted promote to r2"
    assert reg.current("planner") == 2 and store.state().stable == "r2" and store.recover() is None

    listing = _cli(reg.root, "list")
    assert "r2     stable" in listing and "planner=v2" in listing
    shown = json.loads(_cli(reg.root, "show", "r2"))
    assert shown["gate_score"] == 0.5 and [p["op"] for p in shown["promotions"]] == ["promote", "promote"]
    assert "planner" in _cli(reg.root, "diff", "r1", "r2") and "changed" in _cli(reg.root, "diff", "r1")
    assert "rolled back to r1" in _cli(reg.root, "rollback")


class S(TypedDict, total=False):
    q: str
    plan: str
    code: str


def _app(url: str, between=None):
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    planner = ChatOpenAI(base_url=url, api_key=KEY, model="planner", max_tokens=3, temperature=0, max_retries=0)
    coder = ChatOpenAI(base_url=url, api_key=KEY, model="coder", max_tokens=3, temperature=0, max_retries=0)

    def plan(s):
        out = {"plan": planner.invoke(s["q"]).content}
        if between is not None:
            between()
        return out

    g = StateGraph(S)
    g.add_node("planner", plan)
    g.add_node("coder", lambda s: {"code": coder.invoke("code: " + s["plan"]).content})
    g.add_edge(START, "planner")
    g.add_edge("planner", "coder")
    g.add_edge("coder", END)
    return g.compile()


def test_canary_share_is_sticky_and_never_mixes_releases(tmp_path, registry, server):
    import marft_bridge as mb
    from marft_bridge.store import TraceStore

    pub = EmbeddedServerPublisher(server.url, KEY)
    store = ReleaseStore(registry)
    stable = store.adopt({"planner": 1, "coder": 1}, by="test")
    store.promote(stable.id, [pub])
    canary = store.create({"planner": 2, "coder": 2})
    store.start_canary(canary.id, 0.5, [pub])
    traces = TraceStore.open(tmp_path / "t.db")
    promoted = []

    def promote_once():  # mid-episode, the canary becomes stable: the running episode keeps its release
        if not promoted:
            promoted.append(store.promote(canary.id, [pub]).id)

    app = mb.instrument(_app(server.base_url), store=traces, registry=registry.root)
    ids = []
    for i in range(12):
        app.invoke({"q": f"task {i}"})
        ids.append(app.last_episode_id)
    traces.flush()
    sides = {}
    for eid in ids:
        ep = traces.get_episode(eid)
        rel = ep.release or ep.metadata.get("release")
        sides[eid] = rel
        assert rel == (canary.id if in_canary(eid, canary.id, 0.5) else stable.id)  # sticky: the id decides
        want = (store.get(rel).versions)
        served = {a.policy.name: a.policy.version for a in ep.actions if a.kind == "llm"}
        assert served == want, (rel, served)  # the server's own word: each agent on its release's version
        assert all(a.metadata.get("adapter_version_source") == "server" for a in ep.actions if a.kind == "llm")
    assert set(sides.values()) == {stable.id, canary.id}

    # An episode running when the canary is promoted finishes on the release it started on.
    mixed = mb.instrument(_app(server.base_url, between=promote_once), store=traces, registry=registry.root)
    started_on = None
    for i in range(40):
        mixed.invoke({"q": f"late {i}"})
        traces.flush()
        ep = traces.get_episode(mixed.last_episode_id)
        started_on = ep.release or ep.metadata.get("release")
        if promoted:
            break
    served = {a.policy.name: a.policy.version for a in ep.actions if a.kind == "llm"}
    assert served == store.get(started_on).versions
    assert store.state().stable == canary.id
    mb.uninstrument(app)
    mb.uninstrument(mixed)
    traces.close()


def test_probe_catches_weights_swapped_behind_the_registrys_back(tmp_path, tiny_model_dir, registry, server):
    from marft_bridge.serving.probe import record_expected, verify_release

    pub = EmbeddedServerPublisher(server.url, KEY)
    store = ReleaseStore(registry)
    for agent in AGENTS:
        for v in (1, 2):
            record_expected(registry, agent, v, tiny_model_dir, max_tokens=4)
    rel = store.create({"planner": 2, "coder": 2})
    store.promote(rel.id, [pub])
    ok = verify_release(store, rel.id, server.url, api_key=KEY)
    assert ok["ok"], ok
    assert all(a["max_logprob_diff"] < 1e-3 for a in ok["agents"].values())

    # Someone copies v1's weights over planner v2 and fixes the manifest's sha256 to match: the
    # registry's own checks pass, the server reloads it, and only the probe notices.
    v2 = registry.path("planner", 2)
    shutil.copyfile(registry.path("planner", 1) / "adapter_model.safetensors", v2 / "adapter_model.safetensors")
    manifest = json.loads((v2 / "manifest.json").read_text())
    manifest["sha256"] = hashlib.sha256((v2 / "adapter_model.safetensors").read_bytes()).hexdigest()
    (v2 / "manifest.json").write_text(json.dumps(manifest))
    pub.load("planner", v2, version=2)
    bad = verify_release(store, rel.id, server.url, api_key=KEY)
    assert not bad["ok"] and not bad["agents"]["planner"]["ok"] and bad["agents"]["coder"]["ok"]
    assert "differ" in bad["agents"]["planner"]["reason"]
    assert store.state().probes[rel.id]["ok"] is False


def test_served_names_and_release_of_an_episode():
    from marft_bridge.release_names import served_name, split_served_name
    from marft_bridge.schema import Action, Episode, Output, Policy, Reward
    from marft_bridge.service.canary import file_live, release_of

    assert served_name("planner", "r12") == "planner@r12"
    assert split_served_name("planner@r12") == ("planner", "r12") and split_served_name("planner") == ("planner", None)
    for bad in ("planner@12", "plan/ner@r1", "@r1", "planner@r0"):
        with pytest.raises(ValueError, match="not a served release name"):
            split_served_name(bad)
    # the same episode id always lands on the same side; about `fraction` of ids land on the canary
    ids = [f"ep-{i}" for i in range(2000)]
    share = sum(in_canary(i, "r3", 0.1) for i in ids) / len(ids)
    assert 0.08 < share < 0.12 and [in_canary(i, "r3", 0.1) for i in ids[:50]] == [in_canary(i, "r3", 0.1) for i in ids[:50]]

    def ep(versions, release=None, reward=1.0):
        acts = [Action(agent=a, output=Output(text="x"), policy=Policy(name=a, version=v)) for a, v in versions.items()]
        return Episode(actions=acts, rewards=[Reward(value=reward, source="t")], release=release)

    candidates = {"r1": {"planner": 1, "coder": 1}, "r2": {"planner": 2, "coder": 1}}
    assert release_of(ep({"planner": 2, "coder": 1}), candidates) == "r2"  # by the versions that served it
    assert release_of(ep({"planner": 1, "coder": 1}, release="r2"), candidates) == "r2"  # capture's pin wins
    assert release_of(ep({"planner": 2, "coder": 2}), candidates) is None  # no release served that mix
    live: dict = {}
    file_live(live, ep({"planner": 1, "coder": 1}, reward=0.5), candidates)
    file_live(live, ep({"planner": 1, "coder": 1}, release="nonsense"), candidates)  # not a release id: by versions
    assert [list(v.values()) for v in live.values()] == [[0.5, 1.0]] and list(live) == ["r1"]
