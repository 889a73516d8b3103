"""Group-relative advantages (groups.py) by hand on 2 tasks x 3 rollouts x 2 agents: grpo, rloo,
advantage_scale none, reward and AT-GRPO's task_agent_round groups; the loss aggregations by hand;
and a trainer under a group estimator builds and runs no critic."""

from __future__ import annotations

import math

import pytest
import torch

from marft_bridge.errors import MarftError
from marft_bridge.schema import Action, Episode, EpisodeGroup, Observation, Output, Policy, Reward
from marft_bridge.trainers import losses as L
from marft_bridge.trainers.batch import build_batch
from marft_bridge.trainers.config import MarftConfig
from marft_bridge.trainers.factor import action_rounds
from marft_bridge.trainers.groups import EPS, group_advantages, missing_groups
from test_trainer import FAST, make_env, model_dir  # noqa: F401 - model_dir is a fixture


def _act(agent: str, aid: str, step: int, deps: list[str]) -> Action:
    return Action(id=aid, agent=agent, step=step, depends_on=deps, policy=Policy(name=agent, version=0),
                  observation=Observation(prompt_token_ids=[1, 2]), output=Output(token_ids=[3, 4], logprobs=[-1.0, -1.0]))


def _episode(task: str, rollout: int, agents: str, rewards: list[Reward]) -> Episode:
    """``agents`` e.g. "aba": a -> b -> a, each depending on the previous action."""
    acts, prev = [], []
    for k, agent in enumerate(agents):
        acts.append(_act(agent, f"{task}{rollout}{k}", k, prev))
        prev = [acts[-1].id]
    return Episode(id=f"{task}/{rollout}", actions=acts, rewards=rewards, group=EpisodeGroup(task_id=task, rollout=rollout))


def episodes() -> list[Episode]:
    # T1: team rewards 1, 0, 0.5; rollout 0 has a second round of a, rollout 2 has no b at all.
    # T2: per-agent rewards only: a scores 1 in every rollout, b scores 0, 3, 0.
    return [_episode("T1", 0, "aba", [Reward(value=1.0)]), _episode("T1", 1, "ab", [Reward(value=0.0)]),
            _episode("T1", 2, "a", [Reward(value=0.5)])] + \
        [_episode("T2", r, "ab", [Reward(value=1.0, agent="a"), Reward(value=b, agent="b")])
         for r, b in enumerate([0.0, 3.0, 0.0])]


def _advantages(**cfg):
    batch = build_batch(episodes(), None, {"a", "b"}, 100, 64, 1.0)
    S = batch.samples
    rounds = action_rounds([s.parents for s in S], [s.agent for s in S])
    adv, stats = group_advantages(batch, ["a", "b"], rounds, MarftConfig(**cfg))
    return {s.action_id: a for s, a in zip(S, adv)}, stats


# Action ids: task, rollout, position. T1/0: a b a; T1/1: a b; T1/2: a; T2/r: a b.
def test_grpo_by_task_scores_each_agent_against_its_task_rollouts():
    adv, stats = _advantages(advantage="grpo")
    # T1 (team 1, 0, 0.5): mean 0.5, sample std 0.5; every agent's actions get its rollout's A, both of
    # a's actions in rollout 0, and b's group still counts rollout 2 (its team reward) where b never acted.
    z = 0.5 / (0.5 + EPS)
    assert adv == pytest.approx({"T100": z, "T101": z, "T102": z, "T110": -z, "T111": -z, "T120": 0.0,
                                 # T2: a's scores 1, 1, 1 -> 0; b's 0, 3, 0: mean 1, std sqrt(3)
                                 "T200": 0.0, "T210": 0.0, "T220": 0.0,
                                 "T201": -1 / (math.sqrt(3) + EPS), "T211": 2 / (math.sqrt(3) + EPS),
                                 "T221": -1 / (math.sqrt(3) + EPS)}, abs=1e-12)
    assert stats == {"groups": 4, "group_size_mean": 3.0, "group_singletons": 0, "groups_all_equal": 1}


def test_dr_grpo_drops_the_std_and_rloo_leaves_one_out():
    adv, _ = _advantages(advantage="grpo", advantage_scale="none")
    assert adv == pytest.approx({"T100": 0.5, "T101": 0.5, "T102": 0.5, "T110": -0.5, "T111": -0.5, "T120": 0.0,
                                 "T200": 0.0, "T210": 0.0, "T220": 0.0, "T201": -1.0, "T211": 2.0, "T221": -1.0})
    adv, _ = _advantages(advantage="rloo")
    # r_i - mean of the other two: T1 1 - 0.25, 0 - 0.75, 0.5 - 0.5; T2 b 0 - 1.5, 3 - 0, 0 - 1.5
    assert adv == pytest.approx({"T100": 0.75, "T101": 0.75, "T102": 0.75, "T110": -0.75, "T111": -0.75, "T120": 0.0,
                                 "T200": 0.0, "T210": 0.0, "T220": 0.0, "T201": -1.5, "T211": 3.0, "T221": -1.5})
    adv, stats = _advantages(advantage="reward")  # the agent's return itself: team + its own rewards
    assert adv == {"T100": 1.0, "T101": 1.0, "T102": 1.0, "T110": 0.0, "T111": 0.0, "T120": 0.5,
                   "T200": 1.0, "T210": 1.0, "T220": 1.0, "T201": 0.0, "T211": 3.0, "T221": 0.0}
    assert stats == {}


def test_task_agent_round_groups_one_agents_actions_of_one_round():
    adv, stats = _advantages(advantage="grpo", group_by="task_agent_round")
    z = 0.5 / (0.5 + EPS)
    b = 0.5 / (math.sqrt(0.5) + EPS)  # (T1, b, 0): rollouts 0 and 1 only, scores 1, 0
    assert adv == pytest.approx({"T100": z, "T110": -z, "T120": 0.0,  # (T1, a, 0): 1, 0, 0.5
                                 "T102": 0.0,  # (T1, a, 1): a's second turn, alone in its group
                                 "T101": b, "T111": -b,
                                 "T200": 0.0, "T210": 0.0, "T220": 0.0,
                                 "T201": -1 / (math.sqrt(3) + EPS), "T211": 2 / (math.sqrt(3) + EPS),
                                 "T221": -1 / (math.sqrt(3) + EPS)}, abs=1e-12)
    assert stats == {"groups": 5, "group_size_mean": 12 / 5, "group_singletons": 1, "groups_all_equal": 1}


def test_an_episode_without_a_group_is_refused_with_a_count():
    eps = episodes()
    eps[1] = eps[1].model_copy(update={"group": None})
    eps[4] = eps[4].model_copy(update={"group": None})
    for how in ("grpo", "rloo"):
        with pytest.raises(MarftError, match=f"advantage: {how} .* 2 of 6 episodes have no group"):
            missing_groups(eps, how)
    missing_groups(eps, "reward")  # needs no group
    missing_groups(eps, "gae")


def test_loss_aggregations_by_hand():
    # Two actions of 1 and 3 tokens, per-token terms w * min(r A, clip(r) A) = A (r = 1, w = 1): 1 | 2, 3, 4.
    lens = torch.tensor([1, 3])
    terms = L.surrogate_terms(torch.zeros(4), torch.zeros(4), torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.ones(4), 0.2)
    assert -terms.mean() == pytest.approx(-2.5)  # token_mean: (1 + 2 + 3 + 4) / 4
    w = L.token_weights(lens, "seq_mean_token_mean", 2)
    assert w.tolist() == pytest.approx([1 / 2, 1 / 6, 1 / 6, 1 / 6])
    assert -(w * terms).sum() == pytest.approx(-(1 / 1 + 9 / 3) / 2)  # mean over actions of token means: -2
    w = L.token_weights(lens, "seq_mean_token_sum", 2)
    assert -(w * terms).sum() == pytest.approx(-(1 + 9) / 2)  # mean over actions of token sums: -5
    with pytest.raises(ValueError):
        L.token_weights(lens, "token_mean", 2)
    with pytest.raises(ValueError, match="needs mode marft_t"):
        MarftConfig(loss_aggregation="seq_mean_token_mean")


def _grouped(eps):
    return [e.model_copy(update={"group": EpisodeGroup(task_id=f"t{i // 4}", rollout=i % 4)}) for i, e in enumerate(eps)]


def test_a_group_estimator_builds_and_runs_no_critic(model_dir, monkeypatch, tmp_path):  # noqa: F811
    from marft_bridge.trainers import critic, passes
    from marft_bridge.trainers.marft import MarftTrainer
    from marft_bridge.trainers.rollout import RolloutPolicy

    tr = MarftTrainer(MarftConfig(**FAST, advantage="grpo", critic_backbone="lora"), model_dir, agents=["a", "b"])
    assert tr.head is None and tr.critic_optim is None
    assert "critic" not in tr.optimizers() and "marft_critic" not in tr.policy.model.peft_config
    assert not any("value_head" in n or "marft_critic" in n for n in tr.named_weights())
    assert not tr.config.normalize_advantages  # a group estimator's A is not re-centred unless asked

    def no_critic(*a, **k):
        raise AssertionError("a value pass ran")

    monkeypatch.setattr(critic, "values", no_critic)
    monkeypatch.setattr(passes, "values", no_critic)
    monkeypatch.setattr(passes, "features", no_critic)
    eps = _grouped(make_env()(RolloutPolicy(tr), 16, 3))
    m = tr.train_on(eps)
    assert m["group_advantage"]["groups"] == 4 * 2  # 4 tasks x 2 agents
    assert math.isnan(m["value_loss"]) and m["per_agent"]["a"]["optimizer_steps"] == 2 * 2
    tr.save_checkpoint(tmp_path / "ckpt")
    tr.load_checkpoint(tmp_path / "ckpt")  # no critic in the checkpoint either
    with pytest.raises(MarftError, match="16 of 16 episodes have no group"):
        tr.train_on(make_env()(RolloutPolicy(tr), 16, 4))


def test_per_action_aggregation_is_the_same_step_whatever_the_micro_batches(model_dir):  # noqa: F811
    from marft_bridge.trainers.backward import Counts, policy_backward
    from marft_bridge.trainers.marft import MarftTrainer
    from marft_bridge.trainers.rollout import RolloutPolicy
    from marft_bridge.trainers.update import rollout_batch

    cfg = MarftConfig(**FAST, mode="marft_t", advantage="grpo", loss_aggregation="seq_mean_token_mean")
    tr = MarftTrainer(cfg, model_dir, agents=["a", "b"])
    eps = _grouped(make_env(b_tokens=3)(RolloutPolicy(tr), 8, 5))
    batch = build_batch(eps, tr.policy.tokenizer, set(tr.agents), tr.policy.vocab_size, tr.policy.max_context, 1.0)
    rounds = action_rounds([s.parents for s in batch.samples], [s.agent for s in batch.samples])
    adv, _ = group_advantages(batch, tr.agents, rounds, cfg)
    rb = rollout_batch(batch.samples, tr.passes, tr.config, tr.device, adv)
    mb = [i for i, s in enumerate(batch.samples) if s.agent == "b"]
    grads = []
    for tokens in (10_000, 4):  # one micro-batch, then one per action
        tr.config = cfg.model_copy(update={"micro_batch_tokens": tokens})
        policy_backward(tr, "b", rb, mb, Counts(rb.n_units(mb), rb.n_tokens(mb), len(mb)))
        ps = tr.policy.adapter_params("b")
        grads.append([p.grad.clone() for p in ps])
        for p in ps:
            p.grad = None
    assert any(g.abs().sum() > 0 for g in grads[0])
    for g1, g2 in zip(*grads):
        assert torch.allclose(g1, g2, atol=1e-6, rtol=1e-4)


def test_two_gloo_processes_share_groups_split_by_the_sharding(tiny_model_dir, tmp_path):
    """Episodes go to ranks by index, so a task's rollouts land on both ranks: the group means are
    taken over all of them, and the two ranks' step is one process's step on all episodes."""
    import json

    from safetensors.torch import load_file

    from marft_bridge.trainers.marft import MarftTrainer
    from marft_bridge.trainers.rollout import RolloutPolicy
    from test_trainer_ddp import CONFIG, WORKER, run_torchrun

    cfg = {**CONFIG, "advantage": "grpo"}
    eps = [e.model_copy(update={"group": EpisodeGroup(task_id=f"t{i // 3}", rollout=i % 3)}) for i, e in
           enumerate(make_env(3)(RolloutPolicy(MarftTrainer(MarftConfig(), tiny_model_dir, agents=["a", "b"])), 15, 21))]
    (tmp_path / "eps.jsonl").write_text("".join(e.model_dump_json() + "\n" for e in eps))
    run_torchrun(WORKER, [str(tiny_model_dir), str(tmp_path / "eps.jsonl"), str(tmp_path), json.dumps(cfg)], tmp_path)
    s0, s1 = (json.loads((tmp_path / f"summary{k}.json").read_text()) for k in (0, 1))
    assert s0["step"] == s1["step"] and s0["init"] != s0["step"]
    single = MarftTrainer(MarftConfig(**cfg), tiny_model_dir, agents=["a", "b"])
    single.train_on(eps)
    single.save_adapters(tmp_path / "single")
    f = "adapter_model.safetensors"
    for agent in ("a", "b"):
        got, want = load_file(str(tmp_path / "step" / agent / f)), load_file(str(tmp_path / "single" / agent / f))
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=5e-5, rtol=1e-4, msg=k)
