"""``marft demo`` end to end: server, capture into the store, MARFT from the store, publish and
hot-swap, held-out evaluation, results table and learning-curve PNG."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("langgraph")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from marft_bridge.demo.run import DemoSettings, run_demo

    out = tmp_path_factory.mktemp("demo")
    # A short warm start keeps the test quick: it checks the loop, not how good the model gets.
    settings = DemoSettings.quick().model_copy(update={"warmstart": {"steps": 60}})
    results = run_demo(out=out, settings=settings, model_cache=tmp_path_factory.mktemp("models"))
    return out, results


def test_demo_prints_results_and_writes_the_curve(demo):
    out, results = demo
    systems = [r["system"] for r in results["rows"]]
    assert systems == ["untrained two-agent system", "untrained single-agent system", "MARFT-A", "independent PPO",
                       "MARFT-T", "single-agent PPO"]
    by = {r["system"]: r for r in results["rows"]}
    s = results["settings"]
    for row in results["rows"]:
        mean, ci = row["accuracy"]
        assert 0.0 <= mean <= 1.0 and ci >= 0.0 and 0.0 <= row["plan_prob"] <= 1.0
    # each trained system is compared with its own untrained start
    assert by["MARFT-A"]["vs_untrained"]["against"] == "untrained two-agent system"
    assert by["single-agent PPO"]["vs_untrained"]["against"] == "untrained single-agent system"
    diff = by["independent PPO"]["accuracy"][0] - by["untrained two-agent system"]["accuracy"][0]
    assert by["independent PPO"]["vs_untrained"]["diff"] == pytest.approx(diff)
    for evals in results["final_eval"].values():  # eval_samples per held-out question, kept per question
        assert len(evals) == s["seeds"] and all(len(e["per_question"]) == s["heldout"] for e in evals)
        assert all(e["samples"] == s["eval_samples"] for e in evals)
    assert set(results["comparisons"]) >= {"MARFT-A - independent PPO"}
    assert (out / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "results.json").read_text())["rows"] == json.loads(json.dumps(results["rows"]))
    # one trainer metrics file per (method, seed) run, one line per update: what `marft ui --runs` plots
    runs = sorted(p.parent.name for p in (out / "runs").glob("*/metrics.jsonl"))
    assert runs == sorted(f"{m}-s{seed}" for m in s["methods"] for seed in range(s["seeds"]))
    lines = (out / "runs" / runs[0] / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == s["iterations"] and "reward_mean" in json.loads(lines[0])


def test_episodes_have_the_right_agents_dependencies_and_versions(demo):
    from marft_bridge.store import TraceStore

    out, results = demo
    store = TraceStore.open(out / "traces.db")
    s = results["settings"]
    runs = len(s["methods"]) * s["seeds"]
    # every run goes through marft fit: its training rollouts, and the held-out questions once per iteration
    # (the untrained start included), all in the one store
    assert store.count() == runs * (s["iterations"] * s["episodes_per_iteration"] + (s["iterations"] + 1) * s["heldout"])
    assert results["checks"]["episodes"] == runs * s["iterations"] * s["episodes_per_iteration"]

    two_agent = [ep for ep in store.episodes(source="demo/marft_a/s0") if ep.metadata["fit"]["split"] == "train"]
    assert len(two_agent) == s["iterations"] * s["episodes_per_iteration"]
    assert all(ep.group is not None and ep.group.task_id == ep.task["question"] for ep in two_agent)
    for ep in two_agent:
        assert [a.agent for a in ep.actions] == ["planner", "solver"]
        planner, solver = ep.actions
        assert planner.depends_on == [] and solver.depends_on == [planner.id]
        assert solver.step > planner.step
        assert len(ep.rewards) == 1 and ep.rewards[0].value in (0.0, 1.0)
        for a in ep.actions:  # token-level data came from the server, exactly as sampled
            assert a.token_source == "server" and len(a.output.token_ids) == len(a.output.logprobs) > 0
            assert a.observation.prompt_token_ids
        assert solver.sampling.seed == planner.sampling.seed + 1  # seeded requests: reproducible sampling

    # The untrained adapters were v1; each iteration published and hot-swapped the next version,
    # and the episodes of iteration k were served by version k+1, as their actions record.
    by_version: dict[int, int] = {}
    for ep in two_agent:
        versions = {a.policy.name: a.policy.version for a in ep.actions}
        assert set(versions) == {"planner-marft-a-s0", "solver-marft-a-s0"}
        assert len(set(versions.values())) == 1
        v = versions["planner-marft-a-s0"]
        by_version[v] = by_version.get(v, 0) + 1
    assert by_version == {k + 1: s["episodes_per_iteration"] for k in range(s["iterations"])}
    assert results["checks"]["versions_recorded"] is True

    single = list(store.episodes(source="demo/single_agent/s0"))
    assert single and all([a.agent for a in ep.actions] == ["agent"] for ep in single)


def test_registry_holds_every_published_version(demo):
    from marft_bridge.serving import AdapterRegistry

    out, results = demo
    reg = AdapterRegistry(out / "registry")
    n = results["settings"]["iterations"] + 1  # the untrained v1, then one per iteration
    for run, name in (("marft_a-s0", "planner-marft-a-s0"), ("marft_t-s0", "solver-marft-t-s0"),
                      ("single_agent-s0", "agent-single-agent-s0")):
        assert reg.versions(name) == list(range(1, n + 1))
        assert reg.manifest(name, n).parent == n - 1
        # at the end fit promotes the versions with the best held-out accuracy (the earliest on ties)
        best = json.loads((out / "runs" / run / "results.json").read_text())["best"]
        assert reg.current(name) == best["versions"][name]


def test_demo_never_empties_a_folder_it_did_not_make(tmp_path):
    import subprocess
    import sys

    (tmp_path / "precious.txt").write_text("keep me")
    r = subprocess.run([sys.executable, "-m", "marft_bridge", "demo", "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"marft: error: {tmp_path} is not empty and was not made by marft demo; choose another --out"]
    assert (tmp_path / "precious.txt").read_text() == "keep me"
