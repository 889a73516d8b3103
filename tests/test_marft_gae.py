"""GAE by backward induction over D, by hand: the fan-out/fan-in episode A -> B, A -> C, (B, C) -> D
at action and token level; parallel branches never bootstrap from a sibling; rounds chain through D."""

from __future__ import annotations

import inspect

import pytest
import torch

from marft_bridge.trainers.advantages import gae_along_d, successors
from test_trainer import FAST, model_dir  # noqa: F401 - model_dir is a fixture

# Samples in topological order: A = 0, B = 1, C = 2, D = 3 (Sample.parents).
FAN = [[], [0], [0], [1, 2]]
REWARDS = [0.0, 0.1, 0.0, 1.0]  # an action reward on B, the team reward on the terminal D


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_successors_follow_d():
    assert successors(FAN, [0, 0, 0, 0]) == [[1, 2], [3], [3], []]
    # Two episodes in one batch: D never links them; the episode recorded without D is a chain.
    assert successors([[], [0], [], []], [0, 0, 1, 1]) == [[1], [], [3], []]


def test_fan_out_fan_in_action_level_by_hand():
    adv, ret = gae_along_d(REWARDS, [t(0.5), t(0.2), t(0.6), t(0.4)], successors(FAN, [0] * 4),
                           gamma=0.9, lam=0.8)
    # D: 1 - 0.4 = 0.6 (terminal: bootstraps from 0)
    # B: delta = 0.1 + 0.9*0.4 - 0.2 = 0.26 ;  A = 0.26 + 0.72*0.6 = 0.692
    # C: delta = 0 + 0.9*0.4 - 0.6 = -0.24 ;  A = -0.24 + 0.432 = 0.192   (from D, not from its sibling)
    # A: successors B, C: mean V = 0.4, mean A = 0.442 ; delta = 0.9*0.4 - 0.5 = -0.14 ;
    #    A = -0.14 + 0.72*0.442 = 0.17824
    assert torch.cat(adv).tolist() == pytest.approx([0.17824, 0.692, 0.192, 0.6], abs=1e-12)
    assert torch.cat(ret).tolist() == pytest.approx([0.67824, 0.892, 0.792, 1.0], abs=1e-12)


def test_fan_out_fan_in_token_level_by_hand():
    values = [t(0.5, 0.3), t(0.2), t(0.6, 0.1), t(0.4)]  # per token; token 0's is the observation's value
    succ = successors(FAN, [0] * 4)
    adv, ret = gae_along_d(REWARDS, values, succ, gamma=0.9, lam=0.8)  # token_gamma = token_lambda = 1
    # D: 0.6 ; B: 0.1 + 0.36 - 0.2 + 0.432 = 0.692
    # C: last: 0.36 - 0.1 + 0.432 = 0.692 ; first: 0.1 - 0.6 + 0.692 = 0.192
    # A: last: 0.9*mean(0.2, 0.6) - 0.3 + 0.72*mean(0.692, 0.192) = 0.06 + 0.31824 = 0.37824
    #    first: 0.3 - 0.5 + 0.37824 = 0.17824  (token_lambda = 1: the first token sees the whole return)
    assert [a.tolist() for a in adv] == [pytest.approx([0.17824, 0.37824], abs=1e-12), pytest.approx([0.692]),
                                         pytest.approx([0.192, 0.692], abs=1e-12), pytest.approx([0.6])]
    assert torch.cat(ret).tolist() == pytest.approx([0.67824, 0.67824, 0.892, 0.792, 0.792, 1.0], abs=1e-12)
    # token_lambda = 0.5 inside actions, gae_lambda = 0.8 between them:
    adv, _ = gae_along_d(REWARDS, values, succ, gamma=0.9, lam=0.8, token_lambda=0.5)
    # C first: 0.1 - 0.6 + 0.5*0.692 = -0.154 ; A last: 0.06 + 0.72*mean(0.692, -0.154) = 0.25368 ;
    # A first: 0.3 - 0.5 + 0.5*0.25368 = -0.07316
    assert torch.cat(adv).tolist() == pytest.approx([-0.07316, 0.25368, 0.692, -0.154, 0.692, 0.6], abs=1e-12)


def test_parallel_branches_do_not_bootstrap_from_a_sibling():
    # A and B in parallel, C reads both: A's successor is C, not B (the next in topological order).
    adv, _ = gae_along_d([0.0, 0.0, 1.0], [t(0.0), t(5.0), t(0.3)], successors([[], [], [0, 1]], [0] * 3),
                         gamma=1.0, lam=1.0)
    # C: 1 - 0.3 = 0.7 ; A: 0 + 0.3 - 0 + 0.7 = 1.0 ; B: 0.3 - 5 + 0.7 = -4.0
    assert torch.cat(adv).tolist() == pytest.approx([1.0, -4.0, 0.7], abs=1e-12)


def test_rounds_chain_through_d_and_a_dead_branch_gets_only_its_own_reward():
    # planner0 -> solver0 -> planner1 -> solver1, plus a side action (3) that nothing reads.
    parents = [[], [0], [1], [0], [2]]
    adv, _ = gae_along_d([0.0, 0.0, 0.0, 0.2, 1.0], [t(0.1)] * 5, successors(parents, [0] * 5), gamma=0.5, lam=1.0)
    # 4: 1 - 0.1 = 0.9 ; 3 (dead branch): 0.2 - 0.1 = 0.1 ; 2: 0.05 - 0.1 + 0.45 = 0.4
    # 1: 0.05 - 0.1 + 0.5*0.4 = 0.15 ; 0: successors 1 and 3: 0.5*0.1 - 0.1 + 0.5*mean(0.15, 0.1) = 0.0125
    assert torch.cat(adv).tolist() == pytest.approx([0.0125, 0.15, 0.4, 0.1, 0.9], abs=1e-12)


def test_a_successor_before_its_parent_is_refused():
    with pytest.raises(ValueError, match="successor"):
        gae_along_d([0.0, 0.0], [t(0.0), t(0.0)], [[], [0]], gamma=1.0, lam=1.0)


def test_the_trainer_runs_gae_along_the_recorded_d(model_dir, monkeypatch):
    """Captured fan-out/fan-in episodes: the trainer hands GAE the successors from D (not the
    flattened order), per-token values in MARFT-T, and gae_lambda / token_lambda as configured."""
    from marft_bridge.schema import Episode, Reward
    from marft_bridge.trainers import update as marft_module  # where the update calls GAE
    from marft_bridge.trainers.config import MarftConfig
    from marft_bridge.trainers.marft import MarftTrainer
    from marft_bridge.trainers.rollout import RolloutPolicy

    calls = []
    real = marft_module.gae_along_d

    def spy(*args, **kwargs):
        calls.append(inspect.signature(real).bind(*args, **kwargs).arguments)
        return real(*args, **kwargs)

    monkeypatch.setattr(marft_module, "gae_along_d", spy)
    cfg = MarftConfig(**{**FAST, "mode": "marft_t", "ppo_epochs": 1, "gae_lambda": 0.9, "token_lambda": 0.7})
    tr = MarftTrainer(cfg, model_dir, agents=["A", "B", "C", "D"])
    pol, g = RolloutPolicy(tr), torch.Generator().manual_seed(0)
    eps = []
    for _ in range(2):
        msg = [{"role": "user", "content": "q"}]
        a = pol.act("A", msg, max_new_tokens=2, generator=g)
        b = pol.act("B", msg, max_new_tokens=2, generator=g, depends_on=[a.id], step=1)
        c = pol.act("C", msg, max_new_tokens=2, generator=g, depends_on=[a.id], step=1)
        d = pol.act("D", msg, max_new_tokens=2, generator=g, depends_on=[b.id, c.id], step=2)
        eps.append(Episode(actions=[a, b, c, d], rewards=[Reward(value=1.0)]))
    m = tr.train_on(eps)
    got = calls[0]
    assert got["succ"] == [[1, 2], [3], [3], [], [5, 6], [7], [7], []]
    assert got["rewards"] == [0.0, 0.0, 0.0, 1.0] * 2
    assert [len(v) for v in got["values"]] == [len(x.output.token_ids) for e in eps for x in e.actions]
    assert (got["gamma"], got["lam"], got["token_gamma"], got["token_lambda"]) == (cfg.gamma, 0.9, cfg.token_gamma, 0.7)
    assert m["agent_order"] == ["A", "B", "C", "D"]
