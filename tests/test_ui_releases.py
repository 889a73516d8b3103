"""`marft ui`'s Releases panel (/api/releases): per release and per agent, the live reward of the episodes
the release served, its always-valid 95% interval and n, beside the gate score it was promoted on, and
`drifted` when the live mean is below the gate score by more than the margin. Real registry, real release
store, real trace store; the numbers are worked out by hand below."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from marft_bridge.schema import Action, Episode, Reward  # noqa: E402
from marft_bridge.serving.fixtures import make_random_adapter  # noqa: E402
from marft_bridge.serving.registry import AdapterRegistry  # noqa: E402
from marft_bridge.serving.releases import ReleaseStore  # noqa: E402


def episode(eid: str, reward: float | None, versions: dict[str, int], release: str | None) -> Episode:
    acts = [Action(id=agent, agent=agent, step=k, kind="llm", output={"text": "ok"},
                   policy={"name": agent, "version": v}) for k, (agent, v) in enumerate(versions.items())]
    return Episode(id=eid, agents=list(versions), actions=acts, release=release,
                   rewards=[] if reward is None else [Reward(value=reward, source="checker")])


@pytest.fixture
def client(tiny_model_dir, tmp_path, store):
    from fastapi.testclient import TestClient

    from marft_bridge.ui.app import create_app

    reg = AdapterRegistry(tmp_path / "registry")
    for agent, v, score in (("planner", 1, 0.5), ("planner", 2, 0.8), ("coder", 1, 0.5)):
        src = make_random_adapter(tiny_model_dir, tmp_path / f"{agent}{v}", seed=v)
        assert reg.publish(agent, src, metrics={"eval_score": score}) == v
    releases = ReleaseStore(reg)
    releases.create({"planner": 1, "coder": 1}, gate_score=0.5)
    releases.promote("r1")
    releases.create({"planner": 2, "coder": 1}, gate_score=0.8)
    releases.promote("r2")
    r1, r2 = {"planner": 1, "coder": 1}, {"planner": 2, "coder": 1}
    for k, reward in enumerate([0.4, 0.6, 0.5]):
        store.add_episode(episode(f"a{k}", reward, r1, "r1"))
    store.add_episode(episode("a-unpinned", 0.7, r1, None))  # no pin: r1 by the versions that served it
    store.add_episode(episode("a-unrewarded", None, r1, "r1"))  # no reward yet: not counted
    for k, reward in enumerate([0.2, 0.4]):  # r2, both agents act
        store.add_episode(episode(f"b{k}", reward, r2, "r2"))
    for k, reward in enumerate([0.3, 0.5]):  # r2, only planner acts
        store.add_episode(episode(f"c{k}", reward, {"planner": 2}, "r2"))
    app = create_app(store, registry=reg.root)
    assert app.state.index.ready.wait(60)
    return TestClient(app, base_url="http://127.0.0.1"), store


def test_live_reward_interval_and_drift_per_release_and_agent(client):
    c, store = client
    d = c.get("/api/releases").json()
    assert (d["stable"], d["canary"], d["margin"], d["alpha"]) == ("r2", None, 0.1, 0.05)
    r2, r1 = d["releases"]  # newest first
    # Always-valid interval mean ± sqrt(V (V+τ²)/τ² · ln((V+τ²)/(V α²))), V = s²/n, τ = 0.1, α = 0.05.
    # r1: [0.4, 0.6, 0.5, 0.7]: mean 0.55, s² = 0.05/3, V = 1/240, (V+τ²)/V = 3.4,
    #     h² = V (V+τ²)/τ² · ln((V+τ²)/(V α²)) = (1/240)(3.4/240)/0.01 · ln(3.4/0.0025) = 0.0059028 · 7.2152, h = 0.206373.
    assert (r1["release"], r1["n"], r1["gate_score"], r1["stable"]) == ("r1", 4, 0.5, False)
    assert r1["live_reward"] == pytest.approx(0.55)
    assert r1["interval"] == pytest.approx([0.55 - 0.206373, 0.55 + 0.206373], abs=1e-6)
    assert r1["drifted"] is False  # 0.55 >= 0.5 - 0.1
    # r2: [0.2, 0.4, 0.3, 0.5]: the same spread, mean 0.35 < 0.8 - 0.1 → drifted.
    assert (r2["release"], r2["n"], r2["gate_score"], r2["stable"], r2["drifted"]) == ("r2", 4, 0.8, True, True)
    assert r2["live_reward"] == pytest.approx(0.35)
    assert r2["interval"] == pytest.approx([0.35 - 0.206373, 0.35 + 0.206373], abs=1e-6)
    # Per agent in r2: planner v2 (gate 0.8) acted in all 4; coder v1 (its own gate 0.5) in [0.2, 0.4]:
    # mean 0.3, s² = 0.02, V = 0.01, h = sqrt(0.01·0.02/0.01 · ln(0.02/0.000025)) = sqrt(0.02 ln 800) = 0.365639.
    coder, planner = r2["agents"]
    assert (planner["agent"], planner["version"], planner["n"], planner["gate_score"]) == ("planner", 2, 4, 0.8)
    assert planner["live_reward"] == pytest.approx(0.35) and planner["drifted"] is True
    assert (coder["agent"], coder["version"], coder["n"], coder["gate_score"]) == ("coder", 1, 2, 0.5)
    assert coder["live_reward"] == pytest.approx(0.3)
    assert coder["interval"] == pytest.approx([0.3 - 0.365639, 0.3 + 0.365639], abs=1e-6)
    assert coder["drifted"] is True  # 0.3 < 0.5 - 0.1
    assert [(a["agent"], a["n"], a["drifted"]) for a in r1["agents"]] == [("coder", 4, False), ("planner", 4, False)]

    # A wider margin: nothing is past it (0.35 >= 0.8 - 0.5, 0.3 >= 0.5 - 0.5).
    wide = c.get("/api/releases?margin=0.5").json()["releases"][0]
    assert wide["drifted"] is False and [a["drifted"] for a in wide["agents"]] == [False, False]
    assert c.get("/api/releases?margin=-1").status_code == 400

    # A new rewarded r2 episode is counted at the next look (the store's change log).
    store.add_episode(episode("b-late", 0.35, {"planner": 2, "coder": 1}, "r2"))
    again = c.get("/api/releases").json()["releases"][0]
    assert again["n"] == 5 and again["agents"][0]["n"] == 3


def test_no_releases_is_an_empty_list_not_an_error(store, tmp_path):
    from fastapi.testclient import TestClient

    from marft_bridge.ui.app import create_app

    app = create_app(store, registry=tmp_path / "no-registry")
    d = TestClient(app, base_url="http://127.0.0.1").get("/api/releases").json()
    assert d["releases"] == [] and d["stable"] is None and d["problems"] == []
