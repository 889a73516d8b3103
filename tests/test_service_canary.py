"""The service's team canary: a gated round becomes a release served to a share of episodes under
``<agent>@r<N>``; a worse canary is rolled back (the team stays on the stable release), a better one
promoted as a whole; a service killed with SIGKILL in the middle of the canary's promotion resumes
the same canary and finishes it once."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from marft_bridge.schema import Action, Episode, Message, Observation, Output, Policy, Reward  # noqa: E402
from marft_bridge.service import ContinuousService, ServiceConfig  # noqa: E402
from marft_bridge.store import TraceStore  # noqa: E402

AGENTS = ["planner", "solver"]
KEY = "canary-key"


def _episode(i: int, versions: dict[str, int] | None, reward: float, release: str | None = None) -> Episode:
    v = versions or {}
    plan = Action(agent="planner", observation=Observation(messages=[Message(role="user", content="plan")]),
                  output=Output(text="a" if i % 2 else "b", finish_reason="stop"),
                  policy=Policy(name="planner", version=v.get("planner")))
    solve = Action(agent="solver", depends_on=[plan.id],
                   observation=Observation(messages=[Message(role="user", content=plan.output.text)]),
                   output=Output(text="c", finish_reason="stop"), policy=Policy(name="solver", version=v.get("solver")))
    return Episode(source="test", actions=[plan, solve], rewards=[Reward(value=reward, source="checker")],
                   release=release)


def _live(store_path, release, versions, rate: float, n: int = 20) -> None:
    """``n`` live episodes served by ``release``, a share ``rate`` of them rewarded 1."""
    store = TraceStore.open(store_path)
    for i in range(n):
        store.add_episode(_episode(i, versions, 1.0 if i < rate * n else 0.0, release))
    store.close()


def _config(root, base) -> ServiceConfig:
    trainer = {"lr": 1e-3, "ppo_epochs": 1, "num_minibatches": 1, "lora_r": 4, "lora_alpha": 8, "seed": 0}
    return ServiceConfig(store=str(root / "traces.db"), base_model=str(base), agents=AGENTS,
                         registry=str(root / "registry"), state_dir=str(root / "svc"), min_new_episodes=6,
                         heldout_fraction=0.0, rollback_window=1000, trainer=trainer,
                         canary={"fraction": 0.5, "min_episodes": 10, "effect": 0.5})


def _first_canary(root, base, publishers=None) -> ContinuousService:
    cfg = _config(root, base)
    store = TraceStore.open(cfg.store)
    for i in range(6):
        store.add_episode(_episode(i, None, float(i % 2)))
    store.close()
    svc = ContinuousService(cfg, eval_fn=lambda adapters: 1.0, publishers=publishers)
    row = svc.step()
    assert row["decision"] == "canary" and row["release"] == "r2", row
    return svc


def _served(server, model: str) -> int:
    from openai import OpenAI

    reply = OpenAI(base_url=server.base_url, api_key=KEY).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    return reply.model_extra["adapter"]["version"]


@pytest.fixture
def server(tmp_path, tiny_model_dir):
    from marft_bridge.serving import ServerProcess

    with ServerProcess(tiny_model_dir, tmp_path / "registry", api_key=KEY, extra_args=["--threads", "1"]) as srv:
        yield srv


def test_worse_canary_rolled_back_better_one_promoted(tmp_path, tiny_model_dir, server):
    from marft_bridge.serving import EmbeddedServerPublisher

    pubs = [EmbeddedServerPublisher(server.url, KEY)]
    svc = _first_canary(tmp_path, tiny_model_dir, pubs)
    cfg, team = svc.config, svc.team.store
    # r1: the untrained baseline (stable), r2: round 1's candidate, published but not current.
    assert team.get("r1").versions == {"planner": 1, "solver": 1} and team.get("r2").versions == {"planner": 2, "solver": 2}
    assert {a: svc.registry.current(a) for a in AGENTS} == {"planner": 1, "solver": 1}
    routing = json.loads((svc.registry.root / ".releases" / "routing.json").read_text())
    assert routing["canary"] == {"id": "r2", "versions": {"planner": 2, "solver": 2}, "fraction": 0.5}
    assert (_served(server, "planner@r2"), _served(server, "planner@r1"), _served(server, "planner")) == (2, 1, 1)

    # A restart mid-canary resumes the same canary, with what it had counted.
    _live(cfg.store, "r2", {"planner": 2, "solver": 2}, rate=0.2, n=5)
    assert svc.step()["decision"] == "canary"  # 5 of 10 canary episodes: keep collecting
    svc = ContinuousService(cfg, eval_fn=lambda adapters: 1.0, publishers=pubs)
    assert svc.state.canary["release"] == "r2" and len(svc.state.canary["rewards"]["canary"]) == 5
    assert svc.status()["canary"]["release"] == "r2"

    # Worse: 20% of canary episodes rewarded against 80% of stable ones -> rolled back, team stays on r1.
    _live(cfg.store, "r2", {"planner": 2, "solver": 2}, rate=0.2, n=15)
    _live(cfg.store, "r1", {"planner": 1, "solver": 1}, rate=0.8)
    row = svc.step()
    assert row["decision"] == "rollback" and row["release"] == "r2", row
    assert row["interval"]["hi"] < 0 and "below" in row["reason"]
    assert {a: svc.registry.current(a) for a in AGENTS} == {"planner": 1, "solver": 1}
    assert team.state().stable == "r1" and team.state().canary is None and svc.state.canary is None
    assert _served(server, "planner") == 1

    # The next round trains again and canaries r3; this time it earns more: promoted as a team.
    row = svc.step()
    assert row["decision"] == "canary" and row["release"] == "r3" and team.get("r3").parent == "r1", row
    _live(cfg.store, "r3", {"planner": 3, "solver": 3}, rate=0.8)
    _live(cfg.store, "r1", {"planner": 1, "solver": 1}, rate=0.2)
    row = svc.step()
    assert row["decision"] == "promote" and row["versions"] == {"planner": 3, "solver": 3}, row
    assert row["interval"]["lo"] > 0
    assert {a: svc.registry.current(a) for a in AGENTS} == {"planner": 3, "solver": 3}
    assert team.state().stable == "r3" and team.state().history == ["r1", "r3"]
    assert (_served(server, "planner"), _served(server, "solver")) == (3, 3)
    # The accepted checkpoint is the promoted candidate's.
    svc.trainer.save_adapters(tmp_path / "accepted")
    for a in AGENTS:
        assert ((tmp_path / "accepted" / a / "adapter_model.safetensors").read_bytes()
                == (svc.registry.path(a, 3) / "adapter_model.safetensors").read_bytes())
    drift = {r["release"]: r for r in svc.status()["releases"]}
    assert drift["r3"]["episodes"] == 20 and drift["r3"]["live_reward"] == pytest.approx(0.8)


CHILD = textwrap.dedent('''
    import os, signal, sys
    from marft_bridge.service import ContinuousService, ServiceConfig
    from marft_bridge.serving.registry import AdapterRegistry

    cfg = ServiceConfig.model_validate_json(open(sys.argv[1]).read())
    orig = AdapterRegistry.promote
    def promote(self, agent, *a, **k):  # the canary's team promotion: killed after its first agent
        out = orig(self, agent, *a, **k)
        os.kill(os.getpid(), signal.SIGKILL)
    AdapterRegistry.promote = promote
    ContinuousService(cfg, eval_fn=lambda adapters: 1.0).step()
    print("NOT KILLED")
''')


def test_kill_during_the_canarys_promotion_resumes_it(tmp_path, tiny_model_dir):
    svc = _first_canary(tmp_path, tiny_model_dir)
    cfg = svc.config
    svc.store.close()
    _live(cfg.store, "r2", {"planner": 2, "solver": 2}, rate=0.8)
    _live(cfg.store, "r1", {"planner": 1, "solver": 1}, rate=0.2)
    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "cfg.json")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == -9, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])

    svc = ContinuousService(cfg, eval_fn=lambda adapters: 1.0)
    assert svc.state.canary["release"] == "r2"  # the same canary
    assert svc.team.store.state().pending["op"] == "promote"  # the team swap the kill cut
    assert {a: svc.registry.current(a) for a in AGENTS} == {"planner": 2, "solver": 1}  # half a team
    row = svc.step()
    assert row["decision"] == "promote" and row["release"] == "r2", row
    assert {a: svc.registry.current(a) for a in AGENTS} == {"planner": 2, "solver": 2}
    assert svc.team.store.state().stable == "r2" and svc.state.canary is None
    decisions = [json.loads(x)["decision"] for x in (tmp_path / "svc" / "decisions.jsonl").read_text().splitlines()]
    assert decisions == ["baseline", "canary", "promote"]
    svc.trainer.save_adapters(tmp_path / "accepted")
    for a in AGENTS:
        assert ((tmp_path / "accepted" / a / "adapter_model.safetensors").read_bytes()
                == (svc.registry.path(a, 2) / "adapter_model.safetensors").read_bytes())


def test_probe_failure_stops_the_canary(tmp_path, tiny_model_dir, server):
    """Planner v2's weights are changed on disk and its manifest made to match, then reloaded: the
    registry's checks pass, the identity probe does not; the canary stops, the team stays on r1."""
    import hashlib

    from safetensors.torch import load_file, save_file

    from marft_bridge.serving import EmbeddedServerPublisher

    pubs = [EmbeddedServerPublisher(server.url, KEY)]
    cfg = ServiceConfig.model_validate({**_config(tmp_path, tiny_model_dir).model_dump(), "probe": {"max_tokens": 4}})
    store = TraceStore.open(cfg.store)
    for i in range(6):
        store.add_episode(_episode(i, None, float(i % 2)))
    store.close()
    svc = ContinuousService(cfg, eval_fn=lambda adapters: 1.0, publishers=pubs)
    assert svc.step()["decision"] == "canary"
    assert svc.step()["decision"] == "canary"  # probed after the swap: both releases answer as recorded
    probes = svc.team.store.state().probes
    assert probes["r1"]["ok"] and probes["r2"]["ok"], probes

    v2 = svc.registry.path("planner", 2)
    weights = load_file(str(v2 / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    save_file({k: t + 3.0 * torch.randn(t.shape, generator=gen) if "lora_B" in k else t for k, t in weights.items()},
              str(v2 / "adapter_model.safetensors"))
    manifest = json.loads((v2 / "manifest.json").read_text())
    manifest["sha256"] = hashlib.sha256((v2 / "adapter_model.safetensors").read_bytes()).hexdigest()
    (v2 / "manifest.json").write_text(json.dumps(manifest))
    pubs[0].load("planner@r2", v2, version=2)
    svc.team.probe_due()
    row = svc.step()
    assert row["decision"] == "rollback" and row["release"] == "r2" and "identity probe failed" in row["reason"], row
    assert svc.state.canary is None and svc.team.store.state().canary is None
    assert {a: svc.registry.current(a) for a in AGENTS} == {"planner": 1, "solver": 1}
    decisions = [json.loads(x)["decision"] for x in (tmp_path / "svc" / "decisions.jsonl").read_text().splitlines()]
    assert decisions[-2:] == ["unhealthy", "rollback"]
