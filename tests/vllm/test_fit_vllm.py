"""``marft fit --server URL --api-key-env VAR`` against the session's real vLLM: the quickstart app
(planner -> solver LangGraph, ``ChatOpenAI`` per agent), 1 iteration x 2 tasks x 2 rollouts. Episodes
carry their (task, rollout) group and vLLM's token ids and log-probs; each agent's v2 is published to
the registry and loaded into vLLM through the vLLM publisher (iteration 1's val episodes are sampled
from it, not from v1); after the run, a request by the adapter's name is served by the registry's
current version; results.json is written."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

import marft_bridge as mb
from marft_bridge.serving import AdapterRegistry
from marft_bridge.serving.fixtures import DirectModel
from marft_bridge.store import TraceStore
from vllm_stack import KEY, processed_reference

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "fit_quickstart"
AGENTS = ("planner", "solver")
TEMPERATURE = 0.7  # the quickstart app's
TOL = 1e-4
# test_loop's update: large enough that v2's log-probs are far from v1's
TRAINER = {"ppo_epochs": 2, "num_minibatches": 1, "lr": 1e-2, "lora_r": 8, "lora_alpha": 16, "kl_coef": 0.0,
           "entropy_coef": 0.0}
# A reward that varies on the tiny base (the quickstart's exact-answer reward is always 0 there).
REWARD = '''def digit_share(task, output):
    s = output.get("solution") or ""
    return sum(c.isdigit() for c in s) / max(len(s), 1)
'''


TOKEN_DATA = 'logprobs=True, extra_body={"return_token_ids": True}'


def quickstart_app_asking_for_token_data(tmp: Path) -> Path:
    """The quickstart app, its models asking vLLM for the sampled tokens' log-probs and the token ids
    (vLLM sends neither unless asked; the embedded server always does)."""
    src = (QUICKSTART / "app.py").read_text()
    if TOKEN_DATA not in src:
        old = "temperature=0.7, max_tokens=32)"
        assert src.count(old) == 1, "the quickstart app's ChatOpenAI line changed"
        src = src.replace(old, f"temperature=0.7, max_tokens=32, {TOKEN_DATA})")
    (tmp / "app.py").write_text(src)
    return tmp / "app.py"


def run_cli(argv: list[str]) -> int:
    from marft_bridge.fitting.cli import add_commands

    parser = argparse.ArgumentParser(prog="marft")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture(scope="module")
def fit_run(vllm_server, base_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fit-vllm")
    (tmp / "reward.py").write_text(REWARD)
    app = quickstart_app_asking_for_token_data(tmp)
    (tmp / "marft.yaml").write_text(json.dumps(TRAINER))  # JSON is YAML
    val = tmp / "val.jsonl"
    val.write_text("".join((QUICKSTART / "val.jsonl").read_text().splitlines(keepends=True)[:2]))
    mp = pytest.MonkeyPatch()
    mp.setenv("MARFT_TEST_FIT_KEY", KEY)
    try:
        rc = run_cli(["fit", "--app", f"{app}:build_app", "--tasks", str(QUICKSTART / "tasks.jsonl"),
                      "--val", str(val), "--reward", f"{tmp}/reward.py:digit_share", "--base-model", str(base_model),
                      "--agents", *AGENTS, "--out", str(tmp / "out"), "--config", str(tmp / "marft.yaml"),
                      "--iterations", "1", "--tasks-per-iteration", "2", "--group-size", "2", "--concurrency", "4",
                      "--server", vllm_server.url, "--api-key-env", "MARFT_TEST_FIT_KEY", "--no-progress"])
    finally:
        mp.undo()
        for name in ("app", "reward"):
            sys.modules.pop(name, None)
    store = TraceStore.open(tmp / "out" / "traces.db")
    yield rc, tmp / "out", store, app
    store.close()


def llm_actions(episodes):
    return [a for ep in episodes for a in ep.actions if a.kind == "llm"]


def distance(base_model, adapter, action) -> float:
    """The largest gap between vLLM's log-probs of the action and a direct forward of base + ``adapter``."""
    ref = processed_reference(DirectModel(base_model, adapter), action.observation.prompt_token_ids,
                              action.output.token_ids, temperature=TEMPERATURE)
    return max(abs(p - q) for p, q in zip(ref, action.output.logprobs))


def test_fit_on_vllm_stores_groups_and_publishes_the_next_versions(fit_run, base_model):
    rc, out, store, _ = fit_run
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["iteration"] for r in results["iterations"]] == [0, 1]
    assert [r["versions"] for r in results["iterations"]] == [{"planner": 1, "solver": 1}, {"planner": 2, "solver": 2}]
    assert results["episodes"]["ok"] == 4 and results["episodes"]["failed"] == 0
    reg = AdapterRegistry(out / "registry")
    assert all(reg.versions(a) == [1, 2] for a in AGENTS)

    episodes = list(store.episodes())
    train = [ep for ep in episodes if ep.metadata["fit"]["split"] == "train"]
    assert len(train) == 4
    groups: dict[str, set[int]] = {}
    for ep in train:
        groups.setdefault(ep.group.task_id, set()).add(ep.group.rollout)
    assert len(groups) == 2 and all(len(r) == 2 for r in groups.values()), groups  # 2 tasks x 2 rollouts
    for a in llm_actions(episodes):  # token data as vLLM reported it
        assert a.observation.prompt_token_ids and a.output.token_ids
        assert len(a.output.logprobs) == len(a.output.token_ids)
    for a in llm_actions(train):  # iteration 1's rollouts: sampled from v1 (the untrained adapters)
        assert (a.policy.name, a.policy.version) == (a.agent, 1)
        assert distance(base_model, reg.path(a.agent, 1), a) <= TOL
    # Iteration 1's val rollouts ran after the v2 publish: vLLM had loaded v2 under each agent's name.
    val1 = [ep for ep in episodes if ep.metadata["fit"]["split"] == "val" and ep.metadata["fit"]["iteration"] == 1]
    assert len(val1) == 2
    away = 0.0
    for a in llm_actions(val1):
        assert (a.policy.name, a.policy.version) == (a.agent, 2)
        assert distance(base_model, reg.path(a.agent, 2), a) <= TOL
        away = max(away, distance(base_model, reg.path(a.agent, 1), a))
    assert away > 100 * TOL  # v2 is far enough from v1 that the check above tells them apart
    assert {a.agent for a in llm_actions(val1)} == set(AGENTS)


def test_after_fit_vllm_serves_the_registry_current_version(fit_run, vllm_server, base_model, tmp_path):
    from marft_bridge.fitting import Endpoint

    from marft_bridge.fitting.settings import load_callable

    _, out, _, app_file = fit_run
    try:
        build_app = load_callable(f"{app_file}:build_app", "--app")
    finally:
        sys.modules.pop("app", None)
    reg = AdapterRegistry(out / "registry")
    best = json.loads((out / "results.json").read_text())["best"]["versions"]
    assert {a: reg.current(a) for a in AGENTS} == best  # fit promoted the best-val versions
    with TraceStore.open(tmp_path / "after.db") as store:
        app = mb.instrument(build_app(Endpoint(vllm_server.url, KEY, {a: a for a in AGENTS})), store=store,
                            registry=out / "registry")
        app.invoke({"question": "4+5*3"})
        store.flush()
        ep = store.get_episode(app.last_episode_id)
    actions = llm_actions([ep])
    assert {a.agent for a in actions} == set(AGENTS)
    for a in actions:
        assert (a.policy.name, a.policy.version) == (a.agent, best[a.agent])
        assert distance(base_model, reg.path(a.agent, best[a.agent]), a) <= TOL
