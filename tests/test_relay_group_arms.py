"""The relay's critic-free group arms (issue 33): grpo, grpo_happo, reward_happo, and expert iteration
(issue 36). Each short arm-run plays grouped secrets (episodes / 4 words x 4 rollouts), its episodes
carry (word, rollout) groups of 4, no critic is built, and the arm's config is the one the protocol
declares; expert iteration fine-tunes each agent on its actions of the successful rollouts only."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("torch")
pytest.importorskip("langgraph")

from marft_bridge.benchmarks import ablation  # noqa: E402
from marft_bridge.benchmarks.relay import WORDS, RelaySpec, WarmStartConfig, warm_start  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("models")  # --quick's warm start (100 steps), built once for the module


def test_grouped_secrets_are_distinct_words_times_the_group_size():
    secrets = ablation.secrets_for(5, 3, 32, 4)
    assert Counter(secrets) == {w: 4 for w in WORDS}  # 32 = 8 words x 4
    assert secrets == secrets[:8] * 4  # episode k plays word k mod 8
    assert ablation.groups_of(["ant", "bee", "ant", "ant"]) == [("ant", 0), ("bee", 0), ("ant", 1), ("ant", 2)]
    assert ablation.secrets_for(5, 3, 32) == ablation.secrets_for(5, 3, 32, None)  # older arms: unchanged draws
    with pytest.raises(ValueError, match="not 4 rollouts"):
        ablation.secrets_for(0, 0, 10, 4)
    with pytest.raises(ValueError, match="not 2 rollouts"):
        ablation.secrets_for(0, 0, 18, 2)  # 9 words > 8


def test_group_arm_configs():
    spec = RelaySpec(hops=3)
    c = {a: ablation.arm_config(a, spec, 1e-3, 0) for a in ablation.GROUP_ARMS}
    assert (c["grpo"].advantage, c["grpo"].agent_order, c["grpo"].factor_scope) == ("grpo", "dependency", "none")
    assert (c["grpo_happo"].advantage, c["grpo_happo"].agent_order, c["grpo_happo"].factor_scope,
            c["grpo_happo"].factor_clip) == ("grpo", "random", "round", None)
    assert (c["reward_happo"].advantage, c["reward_happo"].agent_order, c["reward_happo"].factor_scope) == (
        "reward", "random", "round")
    assert (c["expert_iteration"].advantage, c["expert_iteration"].factor_scope) == ("reward", "none")
    assert not any(x.critic or x.normalize_advantages for x in c.values())
    happo = ablation.arm_config("happo", spec, 1e-3, 0)  # the older arm: GAE with its critic, as before
    assert happo.critic and happo.normalize_advantages
    st = ablation.RunSettings()
    assert st.grouped("grpo") and not st.grouped("happo")
    assert ablation.RunSettings(secrets="grouped").grouped("happo")
    assert not ablation.RunSettings(secrets="random").grouped("grpo")


def test_each_group_arm_runs_without_a_critic_on_groups_of_four(tmp_path, models, monkeypatch):
    from marft_bridge.store import TraceStore
    from marft_bridge.trainers import marft

    seen = []  # (trainer, [groups of each update's episodes])

    class Recording(marft.MarftTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append((self, []))

        def train_on(self, episodes, agents=None):
            episodes = list(episodes)
            seen[-1][1].append([ep.group for ep in episodes])
            return super().train_on(episodes, agents)

    monkeypatch.setattr(marft, "MarftTrainer", Recording)
    spec = RelaySpec(hops=2)
    base = warm_start(spec, models, WarmStartConfig(steps=100))
    settings = ablation.RunSettings(iterations=1, episodes=8)
    store = TraceStore.open(tmp_path / "traces.db")
    try:
        for arm in ["grpo", "grpo_happo", "reward_happo"]:
            run = ablation.run_arm(spec, base, arm, 0, 3e-3, settings, store)
            trainer, updates = seen[-1]
            assert trainer.head is None and trainer.critic_optim is None  # no critic built
            assert len(run["j"]) == 2 and all(0.0 <= j <= 1.0 for j in run["j"]) and run["episodes"] == 8
            (groups,) = updates
            words = Counter(g.task_id for g in groups)
            assert len(words) == 2 and set(words.values()) == {4}  # 8 episodes = 2 secrets x 4 rollouts
            assert sorted((g.task_id, g.rollout) for g in groups) == sorted((w, r) for w in words for r in range(4))
            if arm != "reward_happo":  # the trainer formed one group per (secret, agent), each of 4
                g = run["diagnostics"][0][0]["groups"]
                assert (g["groups"], g["group_size_mean"], g["group_singletons"]) == (4, 4.0, 0)
    finally:
        store.close()


def test_expert_iteration_fine_tunes_each_agent_on_its_successful_rollouts_only(tmp_path, models, monkeypatch):
    import math

    from marft_bridge.store import TraceStore
    from marft_bridge.trainers import marft, supervised

    calls = []  # per sft_in_place call: {(episode id, agent) kept}, the trainer
    real = supervised.sft_in_place

    def recording(policy, episodes, **kw):
        calls.append({(ep.id, a.agent) for ep in episodes for a in ep.actions if a.kind == "llm" and kw["keep"](ep, a)})
        return real(policy, episodes, **kw)

    trainers = []

    class Recording(marft.MarftTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            trainers.append(self)

        def train_on(self, episodes, agents=None):
            raise AssertionError("expert iteration takes no policy-gradient step")

    monkeypatch.setattr(supervised, "sft_in_place", recording)
    monkeypatch.setattr(marft, "MarftTrainer", Recording)
    spec = RelaySpec(hops=2)
    base = warm_start(spec, models, WarmStartConfig(steps=100))
    settings = ablation.RunSettings(iterations=2, episodes=8, epochs=3)
    store = TraceStore.open(tmp_path / "traces.db")
    try:
        run = ablation.run_arm(spec, base, "expert_iteration", 0, 3e-3, settings, store)
        stored = {ep.id: ep for ep in store.episodes(source="relay/expert_iteration/s0")}
    finally:
        store.close()
    (trainer,) = trainers
    assert trainer.head is None and trainer.critic_optim is None  # no critic built
    assert len(calls) == 2 and len(run["j"]) == 3 and run["episodes"] == 16
    steps = 0
    for it, kept in enumerate(calls):
        d = run["diagnostics"][it][0]
        wins = {eid for eid, _ in kept}
        assert all(stored[eid].team_reward() == 1.0 for eid in wins)  # successes only
        assert d["kept_rollouts"] == len(wins)
        assert {a for _, a in kept} <= set(spec.agents) and len(kept) == len(wins) * len(spec.agents)
        assert sum(d["kept_actions"].values()) == len(kept)  # each agent on its own actions of the wins
        steps += sum(math.ceil(n / ablation.EI_BATCH) * settings.epochs for n in d["kept_actions"].values())
    played = [ep for ep in stored.values()]
    assert sum(1 for ep in played if ep.team_reward() == 1.0) == sum(len({e for e, _ in k}) for k in calls)
    assert run["optimizer_steps"] == steps > 0


def test_the_cli_selects_the_group_arms_and_can_stop_after_tuning(tmp_path, models):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "marft_ablation.py"
    spec = importlib.util.spec_from_file_location("marft_ablation", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "out"
    report = script.main(["--quick", "--workers", "1", "--arms", "grpo", "reward_happo", "--lr-grid", "3e-3",
                          "--tuning-only", "--out", str(out), "--model-cache", str(models)])
    assert report["lrs"] == {"grpo": 3e-3, "reward_happo": 3e-3} and "runs" not in report  # nothing evaluated
    assert not (out / "runs.jsonl").exists() and len((out / "tuning_runs.jsonl").read_text().splitlines()) == 2  # 2 quick tuning seeds
    assert report["settings"]["secrets"] == "auto" and report["settings"]["group_size"] == 4
    with pytest.raises(SystemExit):
        script.parse_args(["--lr", "1e-3", "--tuning-only"])  # tuning-only needs a grid
