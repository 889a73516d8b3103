"""kill -9 of ``fit`` in the middle of an iteration, then ``resume``: the run continues from the last completed
iteration and publishes exactly one version per agent per iteration.

The first kill lands between two publications of iteration 1 (the planner's v2 is published and live,
the solver's v2 published but not yet loaded): the resume adopts both. The second comes from the reward
function, which SIGKILLs its own process at a chosen call (a counter file shared by the runs): in the
middle of iteration 2's rollouts, which the resume plays again. The server is owned by the test (``server=``), so a killed run
leaves no process behind. The same for PPO and for expert iteration (whose step keeps the top rollout of
each group: every reward here is 0)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("langgraph")

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "fit_quickstart"

REWARD = textwrap.dedent("""
    import fcntl, os, signal

    def score(task, output):
        with open(os.environ["COUNTER"], "a+") as f:  # one line per call, across the runs
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write("x\\n")
            f.flush()
            f.seek(0)
            n = len(f.read().splitlines())
        if n == int(os.environ.get("KILL_AT", "0")):
            os.kill(os.getpid(), signal.SIGKILL)
        return 0.0
""")

DRIVER = textwrap.dedent("""
    import json, os, signal, sys
    from marft_bridge.fitting import fit
    from marft_bridge.serving.registry import AdapterRegistry

    if os.environ.get("KILL_PUBLISH"):  # SIGKILL right after publishing this agent's version
        agent, version = os.environ["KILL_PUBLISH"].split(":")
        real = AdapterRegistry.publish

        def publish(self, name, *a, **kw):
            v = real(self, name, *a, **kw)
            if (name, v) == (agent, int(version)):
                os.kill(os.getpid(), signal.SIGKILL)
            return v

        AdapterRegistry.publish = publish

    app, reward, base, out, val, url, key, resume, algorithm = sys.argv[1:10]
    fit(app, "{tasks}", reward, base, ["planner", "solver"], out, val=val, iterations=2, tasks_per_iteration=2,
        group_size=2, concurrency=4, server=url, api_key=key, publisher="embedded", resume=resume == "1",
        progress=False, config={{"ppo_epochs": 1, "num_minibatches": 1}}, algorithm=algorithm,
        **({{"top_k_per_group": 1}} if algorithm == "expert_iteration" else {{}}))
""")


@pytest.mark.parametrize("algorithm", ["ppo", "expert_iteration"])
def test_sigkill_mid_iteration_then_resume_publishes_one_version_per_agent_per_iteration(tmp_path, tiny_model_dir,
                                                                                        algorithm):
    from marft_bridge.serving import AdapterRegistry, ServerProcess

    (tmp_path / "reward_kill.py").write_text(REWARD)
    (tmp_path / "driver.py").write_text(DRIVER.format(tasks=QUICKSTART / "tasks.jsonl"))
    val = tmp_path / "val.jsonl"
    val.write_text("".join((QUICKSTART / "val.jsonl").read_text().splitlines(keepends=True)[:2]))
    out = tmp_path / "out"
    registry = AdapterRegistry(out / "registry")
    # reward calls: iteration 0 val 1-2, iteration 1 train 3-6 (then killed while publishing); the resume
    # finishes iteration 1 (val 7-8) and plays iteration 2's train 9-12 (killed at 11: mid-rollouts); the
    # last run plays iteration 2 again from its start (13-16, val 17-18).
    with ServerProcess(tiny_model_dir, registry, api_key="k") as server:
        def run(kill_at: int, resume: bool, kill_publish: str = "") -> subprocess.CompletedProcess:
            env = {"COUNTER": str(tmp_path / "calls"), "KILL_AT": str(kill_at), "PYTHONPATH": str(tmp_path),
                   "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "KILL_PUBLISH": kill_publish}
            return subprocess.run([sys.executable, str(tmp_path / "driver.py"), f"{QUICKSTART / 'app.py'}:build_app",
                                   "reward_kill:score", str(tiny_model_dir), str(out), str(val), server.url, "k",
                                   "1" if resume else "0", algorithm], capture_output=True, text=True, timeout=600,
                                  env=env)

        first = run(0, resume=False, kill_publish="solver:2")
        assert first.returncode == -9, first.stderr[-3000:]
        # both v2 exist; the planner's is live, the solver's was never loaded
        assert registry.versions("planner") == registry.versions("solver") == [1, 2]
        assert (registry.current("planner"), registry.current("solver")) == (2, 1)
        second = run(11, resume=True)
        assert second.returncode == -9, second.stderr[-3000:]
        assert "iteration 1 was interrupted while publishing; adopting" in second.stdout
        assert registry.versions("solver") == [1, 2] and registry.current("solver") == 2  # adopted, not again
        calls = len((tmp_path / "calls").read_text().splitlines())  # 11, or 12 if a concurrent call beat the kill
        last = run(0, resume=True)
        assert last.returncode == 0, last.stderr[-3000:]
        assert "iteration 2 was interrupted while rollouts; nothing was published; it runs again" in last.stdout

    for agent in ("planner", "solver"):
        assert registry.versions(agent) == [1, 2, 3]  # v1 untrained, one per iteration, none twice
        assert len({registry.manifest(agent, v).round_id for v in (1, 2, 3)}) == 3
    results = json.loads((out / "results.json").read_text())
    assert [r["iteration"] for r in results["iterations"]] == [0, 1, 2]
    assert [r["versions"]["planner"] for r in results["iterations"]] == [1, 2, 3]
    assert not (out / "state" / "journal.json").exists()
    assert len((tmp_path / "calls").read_text().splitlines()) == calls + 4 + 2  # iteration 2 again: train, val
