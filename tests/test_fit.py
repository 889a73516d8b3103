"""``marft fit`` end to end on the embedded server with a tiny model built in-process: the quickstart
example through the CLI, episodes grouped and versioned, failures excluded and counted, bad task files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("langgraph")

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "fit_quickstart"
# group-relative advantages: the groups fit records on every episode reach the trainer
TINY = {"ppo_epochs": 1, "num_minibatches": 1, "lr": 1e-3, "advantage": "grpo"}


def run_cli(argv: list[str]) -> int:
    from marft_bridge.fitting.cli import add_commands

    parser = argparse.ArgumentParser(prog="marft")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def in_quickstart(monkeypatch):
    """Run from the example's folder, as its README says (`app:build_app` imports from there)."""
    monkeypatch.chdir(QUICKSTART)
    monkeypatch.syspath_prepend(str(QUICKSTART))
    yield
    for name in ("app", "reward"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def quickstart_run(tiny_model_dir, tmp_path_factory):
    """The README's command, in a quick mode: 2 iterations of 2 tasks x 2 rollouts, 3 val tasks."""
    import os

    tmp = tmp_path_factory.mktemp("fitq")
    val = tmp / "val.jsonl"
    val.write_text("".join((QUICKSTART / "val.jsonl").read_text().splitlines(keepends=True)[:3]))
    (tmp / "marft.yaml").write_text(json.dumps(TINY))  # JSON is YAML
    cwd = os.getcwd()
    os.chdir(QUICKSTART)
    sys.path.insert(0, str(QUICKSTART))
    try:
        rc = run_cli(["fit", "--app", "app:build_app", "--tasks", "tasks.jsonl", "--val", str(val), "--reward",
                      "reward:score", "--base-model", str(tiny_model_dir), "--agents", "planner", "solver",
                      "--out", str(tmp / "out"), "--config", str(tmp / "marft.yaml"), "--iterations", "2",
                      "--tasks-per-iteration", "2", "--group-size", "2", "--concurrency", "4", "--no-progress"])
    finally:
        os.chdir(cwd)
        sys.path.remove(str(QUICKSTART))
        for name in ("app", "reward"):
            sys.modules.pop(name, None)
    return rc, tmp / "out"


def test_quickstart_publishes_one_version_per_agent_per_iteration(quickstart_run):
    from marft_bridge.serving import AdapterRegistry

    rc, out = quickstart_run
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["iteration"] for r in results["iterations"]] == [0, 1, 2]
    assert [r["versions"] for r in results["iterations"]] == [{"planner": v, "solver": v} for v in (1, 2, 3)]
    assert all(r["val_n"] == 3 for r in results["iterations"])
    for r in results["iterations"][1:]:  # (task, agent) groups: 2 tasks x 2 agents, 2 rollouts each
        assert r["metrics"]["group_advantage"]["groups"] == 4
        assert r["metrics"]["group_advantage"]["group_size_mean"] == 2.0
    assert results["episodes"] == {"ok": 8, "failed": 0, "timeout": 0, "reward_error": 0, "invalid": 0}
    reg = AdapterRegistry(out / "registry")
    for agent in ("planner", "solver"):
        assert reg.versions(agent) == [1, 2, 3]
        # the best val versions are live at the end (ties: the earliest)
        assert reg.current(agent) == results["best"]["versions"][agent]
        rounds = [reg.manifest(agent, v).round_id for v in (1, 2, 3)]
        assert len(set(rounds)) == 3 and None not in rounds
    assert (out / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (out / "adapters").iterdir() if p.is_dir()) == ["planner", "solver"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2  # the trainer's line per update


def test_every_stored_episode_has_its_group_seed_and_the_live_version(quickstart_run):
    from marft_bridge.store import TraceStore

    _, out = quickstart_run
    store = TraceStore.open(out / "traces.db")
    eps = list(store.episodes())
    train = [e for e in eps if e.metadata["fit"]["split"] == "train"]
    val = [e for e in eps if e.metadata["fit"]["split"] == "val"]
    assert len(train) == 2 * 2 * 2 and len(val) == 3 * 3
    assert all(e.group is not None for e in eps)
    for it in (1, 2):
        mine = [e for e in train if e.metadata["fit"]["iteration"] == it]
        groups = {}
        for e in mine:
            groups.setdefault(e.group.task_id, []).append(e.group.rollout)
            assert [a.agent for a in e.actions] == ["planner", "solver"]
            # iteration k is played by version k (v1 is the untrained start), as the actions record
            assert {a.policy.version for a in e.actions} == {it}
            planner, solver = e.actions
            assert solver.sampling.seed == planner.sampling.seed + 1 == e.metadata["fit"]["seed"] + 1
        assert sorted(map(sorted, groups.values())) == [[0, 1], [0, 1]]
        assert len({e.metadata["fit"]["seed"] for e in mine}) == 4  # distinct sampling seeds
    # val: the same seeds at every iteration
    seeds = {it: sorted(e.metadata["fit"]["seed"] for e in val if e.metadata["fit"]["iteration"] == it)
             for it in (0, 1, 2)}
    assert seeds[0] == seeds[1] == seeds[2] and len(set(seeds[0])) == 3


def test_a_task_line_that_is_not_an_object_is_refused_with_its_line_number(tmp_path, tiny_model_dir):
    from marft_bridge.errors import MarftError
    from marft_bridge.fitting import fit

    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"question": "1+2*3"}\n\n[1, 2]\n')
    with pytest.raises(MarftError, match=r"tasks.jsonl line 3: a JSON list, not an object"):
        fit(lambda ep: None, bad, lambda t, o: 0.0, tiny_model_dir, ["planner"], tmp_path / "out")
    bad.write_text('{"question": "1+2*3"}\n{"question": \n')
    with pytest.raises(MarftError, match=r"tasks.jsonl line 2: not JSON"):
        fit(lambda ep: None, bad, lambda t, o: 0.0, tiny_model_dir, ["planner"], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything started
