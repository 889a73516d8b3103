"""``marft service`` killed with SIGKILL at each step of a round, then restarted: exactly one registry
version per agent per round, the accepted checkpoint whole, and a ``status`` that tells what happened.

The kill is real: a child process runs the service with one library call patched to SIGKILL the
process at the chosen point (after a version is published, after it is promoted, while the accepted
checkpoint is swapped, ...). The restart runs here, in-process, on the same state directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from marft_bridge.schema import Action, Episode, Message, Observation, Output, Policy, Reward  # noqa: E402
from marft_bridge.service import ContinuousService, ServiceConfig  # noqa: E402
from marft_bridge.store import TraceStore  # noqa: E402

AGENTS = ["planner", "solver"]


def _episode(i: int, version: int) -> Episode:
    plan = Action(agent="planner", observation=Observation(messages=[Message(role="user", content="plan")]),
                  output=Output(text="a" if i % 2 else "b", finish_reason="stop"),
                  policy=Policy(name="planner", version=version))
    solve = Action(agent="solver", depends_on=[plan.id],
                   observation=Observation(messages=[Message(role="user", content=plan.output.text)]),
                   output=Output(text="c", finish_reason="stop"), policy=Policy(name="solver", version=version))
    return Episode(source="test", actions=[plan, solve], rewards=[Reward(value=float(i % 2), source="checker")])


def _fill(store_path, n: int, version: int, start: int = 0) -> None:
    store = TraceStore.open(store_path)
    for i in range(start, start + n):
        store.add_episode(_episode(i, version))
    store.close()


def _config(root, base) -> ServiceConfig:
    trainer = {"lr": 1e-3, "ppo_epochs": 1, "num_minibatches": 1, "lora_r": 4, "lora_alpha": 8, "seed": 0}
    return ServiceConfig(store=str(root / "traces.db"), base_model=str(base), agents=AGENTS,
                         registry=str(root / "registry"), state_dir=str(root / "svc"), min_new_episodes=6,
                         heldout_fraction=0.0, rollback_window=1000, trainer=trainer)


def _always_promote(adapters) -> float:
    return 1.0  # candidate == live: the gate (margin 0) promotes


# The child: patch one call to SIGKILL the process at the named point, then run one service step.
CHILD = textwrap.dedent('''
    import os, signal, sys
    import marft_bridge.durable as durable
    from marft_bridge.service import ContinuousService, ServiceConfig
    from marft_bridge.serving.registry import AdapterRegistry
    from marft_bridge.trainers.marft import MarftTrainer

    cfg = ServiceConfig.model_validate_json(open(sys.argv[1]).read())
    point = sys.argv[2]
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)

    def after(owner, name, when):
        orig = getattr(owner, name)
        def patched(*a, **kw):
            out = orig(*a, **kw)
            if when(*a, **kw):
                die()
            return out
        setattr(owner, name, patched)

    def before(owner, name, when):
        orig = getattr(owner, name)
        def patched(*a, **kw):
            if when(*a, **kw):
                die()
            return orig(*a, **kw)
        setattr(owner, name, patched)

    kind, _, agent = point.partition(":")
    if kind == "training":
        before(MarftTrainer, "train_on", lambda *a, **k: True)
    elif kind == "gating":
        before(ContinuousService, "evaluate", lambda self, adapters, candidate: candidate)
    elif kind == "publish":      # the version directory exists, not yet promoted
        after(AdapterRegistry, "publish", lambda self, a, *rest, **k: a == agent)
    elif kind == "promote":      # this agent is live, the next one not yet published
        after(AdapterRegistry, "promote", lambda self, a, *rest, **k: a == agent)
    elif kind == "checkpoint-copied":   # accepted.new complete, the swap not started
        after(durable, "fsync_tree", lambda d: d.name == "accepted.new")
    elif kind == "checkpoint-swapping":  # the old accepted moved aside, the new one not yet in place
        before(durable.os, "rename", lambda src, dst: str(src).endswith("accepted.new"))
    ContinuousService(cfg, eval_fn=lambda adapters: 1.0).step()
    print("NOT KILLED")
''')


def _kill_at(tmp_path, cfg: ServiceConfig, point: str) -> None:
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(cfg.model_dump_json())
    r = subprocess.run([sys.executable, "-c", CHILD, str(cfg_file), point], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == -9, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])


def _round_ids(svc: ContinuousService) -> dict[str, list[str | None]]:
    return {a: [svc.registry.manifest(a, v).round_id for v in svc.registry.versions(a)] for a in AGENTS}


@pytest.fixture(scope="module")
def after_round_one(tmp_path_factory, tiny_model_dir):
    """A service state after the baseline and one clean round: every agent has v1 (baseline) and v2."""
    root = tmp_path_factory.mktemp("svc1")
    cfg = _config(root, tiny_model_dir)
    _fill(cfg.store, 6, version=1)
    svc = ContinuousService(cfg, eval_fn=_always_promote)
    assert svc.step()["decision"] == "promote"
    assert {a: svc.registry.versions(a) for a in AGENTS} == {a: [1, 2] for a in AGENTS}
    svc.store.close()
    _fill(cfg.store, 6, version=2, start=6)  # enough new episodes for round 2
    return root


@pytest.mark.parametrize("point, phase, adopted", [
    ("training", "training", {}),
    ("gating", "training", {}),
    ("publish:planner", "publishing", {"planner": 3}),
    ("promote:planner", "publishing", {"planner": 3}),
    ("publish:solver", "publishing", {"planner": 3, "solver": 3}),
    ("checkpoint-copied", "checkpointing", {"planner": 3, "solver": 3}),
    ("checkpoint-swapping", "checkpointing", {"planner": 3, "solver": 3}),
])
def test_a_round_killed_at_each_step_publishes_each_agent_once(tmp_path, tiny_model_dir, after_round_one,
                                                               point, phase, adopted):
    root = tmp_path / "state"
    shutil.copytree(after_round_one, root)
    cfg = _config(root, tiny_model_dir)
    _kill_at(tmp_path, cfg, point)

    before = ContinuousService(cfg, eval_fn=_always_promote).status()  # status reads, changes nothing
    assert before["interrupted_round"]["phase"] == phase and before["interrupted_round"]["round"] == 2

    svc = ContinuousService(cfg, eval_fn=_always_promote)
    row = svc.step()
    assert row["decision"] == "promote", row
    assert {a: svc.registry.versions(a) for a in AGENTS} == {a: [1, 2, 3] for a in AGENTS}
    assert {a: svc.registry.current(a) for a in AGENTS} == {a: 3 for a in AGENTS}
    ids = _round_ids(svc)
    assert ids["planner"] == ids["solver"] and len(set(ids["planner"])) == 3  # one round id per round
    assert ids["planner"][2] == row["round_id"]

    # The accepted checkpoint is whole and is what round 2 published.
    assert not any(p.name.startswith("accepted.") for p in (root / "svc").iterdir())
    ContinuousService(cfg, eval_fn=_always_promote).trainer.save_adapters(tmp_path / "accepted_adapters")
    for a in AGENTS:
        assert ((tmp_path / "accepted_adapters" / a / "adapter_model.safetensors").read_bytes()
                == (svc.registry.path(a, 3) / "adapter_model.safetensors").read_bytes())

    status = svc.status()
    assert status["interrupted_round"] is None
    resume = status["resumes"][-1]
    assert resume["phase"] == phase and resume["adopted"] == ({} if phase == "training" else adopted)
    if phase == "training":
        assert resume["round_id"] != row["round_id"]  # the killed round published nothing; it ran again
        assert "nothing was published" in resume["reason"]
    else:
        assert resume["round_id"] == row["round_id"]
    if point == "checkpoint-swapping":
        assert "completed the interrupted replacement" in resume["checkpoint"]
    decisions = [d["decision"] for d in status["recent_decisions"]]
    assert decisions[-2:] == ["resume", "promote"] and decisions.count("promote") == 2


def test_a_kill_while_publishing_the_baseline_adopts_what_was_published(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, tiny_model_dir)
    _fill(cfg.store, 6, version=1)
    _kill_at(tmp_path, cfg, "publish:solver")
    svc = ContinuousService(cfg, eval_fn=_always_promote)
    assert svc.status()["interrupted_round"]["phase"] == "baseline"
    assert svc.step()["decision"] == "promote"
    assert {a: svc.registry.versions(a) for a in AGENTS} == {a: [1, 2] for a in AGENTS}
    ids = _round_ids(svc)
    assert ids["planner"] == ids["solver"]
    assert [d["decision"] for d in svc.status()["recent_decisions"]] == ["resume", "baseline", "promote"]
    assert svc.status()["resumes"][0]["adopted"] == {"planner": 1, "solver": 1}


def test_a_torn_last_decision_line_is_skipped(tmp_path, tiny_model_dir, caplog):
    cfg = _config(tmp_path, tiny_model_dir)
    svc = ContinuousService(cfg, eval_fn=_always_promote)
    svc.decide("wait", "nothing yet")
    with open(tmp_path / "svc" / "decisions.jsonl", "a") as f:
        f.write('{"time": "2026-12-01T00:00:00", "decis')  # a kill in the middle of an append
    status = ContinuousService(cfg, eval_fn=_always_promote).status()
    assert [d["decision"] for d in status["recent_decisions"]] == ["wait"]
    assert "not whole JSON" in caplog.text
    json.dumps(status, default=str)
