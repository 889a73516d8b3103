"""The whole loop with vLLM as the server: the demo's planner -> solver LangGraph app (``ChatOpenAI``
agents) captured against vLLM -> ``marft train`` on the store -> ``marft adapters publish`` and
``promote --vllm`` -> the next episodes are served by the new versions: attributed to them by the
registry (vLLM reports no version) and sampled with log-probs equal to a direct forward pass of base
+ the new adapter (not the old one). Then ``marft service`` with a vLLM publisher completes a round."""

from __future__ import annotations

import json

import pytest

import marft_bridge as mb
from marft_bridge.cli import main
from marft_bridge.demo import task
from marft_bridge.demo.app import build_app
from marft_bridge.serving import AdapterRegistry
from marft_bridge.serving.fixtures import DirectModel, make_random_adapter
from marft_bridge.store import TraceStore
from vllm_stack import KEY, processed_reference

AGENTS = ("planner", "solver")
TEMPERATURE = 1.0
TOL = 1e-4
TRAINER = {"ppo_epochs": 2, "num_minibatches": 1, "batch_episodes": 8, "lr": 1e-2, "lora_r": 8, "lora_alpha": 16,
           "kl_coef": 0.0, "entropy_coef": 0.0, "seed": 0}


def digit_share(inputs, outputs) -> float:
    """A reward that varies on a random base: the share of digits in the solver's answer."""
    answer = outputs.get("answer") or ""
    return sum(c.isdigit() for c in answer) / max(len(answer), 1)


def run_episodes(url: str, store, registry_root, seeds) -> list:
    app = mb.instrument(build_app(url, api_key=KEY, temperature=TEMPERATURE, max_tokens=12), store=store,
                        registry=registry_root, reward_fn=digit_share)
    problems = task.all_problems()
    ids = []
    for seed in seeds:
        app.invoke({"question": problems[seed].question, "seed": seed})
        ids.append(app.last_episode_id)
    store.flush()
    return [store.get_episode(i) for i in ids]


def served_by(episodes, base_model, registry, version: int) -> float:
    """Check every llm action was attributed to ``version`` and sampled from it (log-probs equal to
    base + that version's adapter); return the log-probs' largest distance from version 1's."""
    away_from_v1 = 0.0
    for ep in episodes:
        for a in ep.actions:
            if a.kind != "llm":
                continue
            assert (a.policy.name, a.policy.version) == (a.agent, version)
            assert a.metadata["adapter_version_source"] == "registry"
            prompt, tokens = a.observation.prompt_token_ids, a.output.token_ids
            ref = processed_reference(DirectModel(base_model, registry.path(a.agent, version)), prompt, tokens,
                                      temperature=TEMPERATURE)
            assert max(abs(p - q) for p, q in zip(ref, a.output.logprobs)) <= TOL
            v1 = processed_reference(DirectModel(base_model, registry.path(a.agent, 1)), prompt, tokens,
                                     temperature=TEMPERATURE)
            away_from_v1 = max([away_from_v1, *(abs(p - q) for p, q in zip(v1, a.output.logprobs))])
    return away_from_v1


@pytest.fixture(scope="module")
def captured(vllm_server, base_model, tmp_path_factory):
    """A registry whose v1 of each agent is an untrained LoRA (B = 0: the base), published and promoted
    into vLLM through the CLI, and a store holding 8 episodes the app ran against vLLM."""
    tmp = tmp_path_factory.mktemp("loop")
    reg_root = tmp / "registry"
    for agent in AGENTS:
        zero = make_random_adapter(base_model, tmp / f"{agent}-v1", seed=0, rank=8, scale=0.0)
        assert main(["adapters", "publish", agent, str(zero), "--registry", str(reg_root), "--promote",
                     "--vllm", vllm_server.url, "--api-key", KEY]) == 0
    store = TraceStore.open(tmp / "traces.db")
    episodes = run_episodes(vllm_server.base_url, store, reg_root, range(8))
    yield tmp, AdapterRegistry(reg_root), store, episodes
    store.close()


def test_capture_train_promote_and_serve_the_new_versions(captured, vllm_server, base_model):
    tmp, reg, store, episodes = captured
    assert served_by(episodes, base_model, reg, 1) <= TOL  # attributed to v1 and sampled from it
    rewards = [ep.team_reward() for ep in episodes]
    assert len(set(rewards)) > 1, rewards  # advantages are not all zero: training moves the adapters

    cfg = tmp / "trainer.yaml"
    cfg.write_text("".join(f"{k}: {v}\n" for k, v in TRAINER.items()))
    assert main(["train", "--store", str(tmp / "traces.db"), "--base-model", str(base_model), "--config", str(cfg),
                 "--out", str(tmp / "run"), "--agents", ",".join(AGENTS), "--no-progress"]) == 0
    for agent in AGENTS:
        assert main(["adapters", "publish", agent, str(tmp / "run" / "adapters" / agent), "--registry",
                     str(reg.root)]) == 0
        assert main(["adapters", "promote", agent, "2", "--registry", str(reg.root), "--vllm", vllm_server.url,
                     "--api-key", KEY]) == 0
    after = run_episodes(vllm_server.base_url, store, reg.root, range(8, 10))
    # Sampled from v2, and v2 is far enough from v1 that the check above tells them apart.
    assert served_by(after, base_model, reg, 2) > 100 * TOL


def accept_every_candidate(adapters) -> float:
    """The service's evaluation here: the gate is tested in tests/test_service.py, not against vLLM."""
    return 0.0


def test_service_round_publishes_to_vllm(captured, vllm_server, base_model, monkeypatch):
    tmp, _, store, _ = captured
    svc_dir = tmp / "service"
    monkeypatch.setenv("MARFT_TEST_VLLM_KEY", KEY)
    config = {
        "store": str(tmp / "traces.db"), "base_model": str(base_model), "agents": list(AGENTS),
        "registry": str(svc_dir / "registry"), "state_dir": str(svc_dir / "state"),
        "publishers": [{"kind": "vllm", "url": vllm_server.url, "api_key_env": "MARFT_TEST_VLLM_KEY"}],
        "min_new_episodes": 8, "heldout_fraction": 0.0, "eval_function": "test_loop:accept_every_candidate",
        "trainer": TRAINER,
    }
    (tmp / "service.yaml").write_text(json.dumps(config))  # JSON is YAML
    assert main(["service", "--config", str(tmp / "service.yaml"), "--max-rounds", "1"]) == 0
    decisions = [json.loads(x) for x in (svc_dir / "state" / "decisions.jsonl").read_text().splitlines()]
    assert [d["decision"] for d in decisions] == ["baseline", "promote"], decisions
    reg = AdapterRegistry(svc_dir / "registry")
    assert all(reg.current(a) == 2 for a in AGENTS)
    # The next episodes, attributed through the service's registry, come from its v2 in vLLM.
    assert served_by(run_episodes(vllm_server.base_url, store, reg.root, [10]), base_model, reg, 2) > 100 * TOL
