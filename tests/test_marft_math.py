"""Hand-computed numbers for GAE (action and token level), the factor M, the losses and the decoupled weights."""

from __future__ import annotations

import math

import pytest
import torch

from marft_bridge.trainers import losses as L
from marft_bridge.trainers.advantages import action_level_steps, gae, token_level_steps


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_gae_action_level_by_hand():
    # Episode 1: two actions, team reward 1 on the last; episode 2: one action, reward 2.
    r, g, d = action_level_steps([0.0, 1.0, 2.0], [False, True, True], gamma=0.9)
    adv, ret = gae(r, t(0.5, 0.2, 1.0), g, d, lam=0.8)
    # A1 = 1 - 0.2 = 0.8 ; A0 = (0 + 0.9*0.2 - 0.5) + 0.9*0.8*0.8 = -0.32 + 0.576 = 0.256 ; A2 = 2 - 1 = 1
    assert adv.tolist() == pytest.approx([0.256, 0.8, 1.0], abs=1e-12)
    assert ret.tolist() == pytest.approx([0.756, 1.0, 2.0], abs=1e-12)


def test_gae_token_level_by_hand():
    # Action 1 has two tokens, action 2 one token with reward 1; gamma per hop 0.9, 1.0 inside an action.
    r, g, d = token_level_steps([0.0, 1.0], [2, 1], [False, True], gamma=0.9, token_gamma=1.0)
    assert r.tolist() == [0.0, 0.0, 1.0]
    assert g.tolist() == pytest.approx([1.0, 0.9, 0.9])
    assert d.tolist() == [0.0, 0.0, 1.0]
    adv, ret = gae(r, t(0.5, 0.4, 0.2), g, d, lam=0.8)
    # A2 = 0.8 ; A1 = (0.9*0.2 - 0.4) + 0.9*0.8*0.8 = 0.356 ; A0 = (1.0*0.4 - 0.5) + 1.0*0.8*0.356 = 0.1848
    assert adv.tolist() == pytest.approx([0.1848, 0.356, 0.8], abs=1e-12)
    assert ret.tolist() == pytest.approx([0.6848, 0.756, 1.0], abs=1e-12)


def test_factor_m_folds_ratios_per_episode_step():
    keys = [(0, 1), (0, 1), (1, 1)]
    m = L.fold_factor({(0, 1): 2.0}, keys, t(-1.0, -2.0, -0.5), t(-1.2, -1.9, -0.5))
    # (0,1): 2 * e^{0.2} * e^{-0.1} = 2 e^{0.1} ; (1,1): e^0 = 1
    assert m[(0, 1)] == pytest.approx(2 * math.exp(0.1), rel=1e-12)
    assert m[(1, 1)] == pytest.approx(1.0, rel=1e-12)
    assert set(m) == {(0, 1), (1, 1)}


def test_clipped_surrogate_by_hand():
    new = t(math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.5))
    prox = torch.zeros(4, dtype=torch.float64)
    adv = t(1.0, 1.0, -2.0, -1.0)
    w = t(1.0, 0.5, 2.0, 1.0)
    # 1: min(1.5, 1.2)*1 = 1.2 ; 2: min(0.5, 0.8)*1 *0.5 = 0.25 ; 3: -2.2 * 2 = -4.4 ; 4: min(-0.5, -0.8) = -0.8
    loss = L.clipped_surrogate(new, prox, adv, w, clip=0.2)
    assert loss.item() == pytest.approx(-(1.2 + 0.25 - 4.4 - 0.8) / 4, abs=1e-12)


def test_decoupled_behaviour_weights_by_hand():
    w = L.behaviour_weights(t(-1.0, -1.0, -3.0, 0.0), t(-1.5, -1.0, -1.0, -3.0), cap=5.0)
    assert w.tolist() == pytest.approx([math.exp(0.5), 1.0, math.exp(-2.0), 5.0], rel=1e-12)


def test_clipped_huber_value_loss_by_hand():
    loss = L.clipped_value_loss(t(1.0, 3.0), t(0.5, 0.5), t(2.0, 0.0), clip=0.2, delta=1.0)
    # 1: max(huber(-1)=0.5, huber(0.7-2=-1.3)=0.8) = 0.8 ; 2: max(huber(3)=2.5, huber(0.7)=0.245) = 2.5
    assert loss.item() == pytest.approx((0.8 + 2.5) / 2, abs=1e-12)


def test_kl_k3_and_entropy_by_hand():
    assert L.kl_to_reference(t(-1.0), t(-1.5)).item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, abs=1e-12)
    assert L.kl_to_reference(t(-2.0), t(-2.0)).item() == 0.0
    uniform = torch.log_softmax(torch.zeros(1, 4), -1)
    assert L.entropy(uniform).item() == pytest.approx(math.log(4), abs=1e-6)
    # p = (1/2, 1/4, 1/4): H = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2
    assert L.entropy(t(0.5, 0.25, 0.25).log()).item() == pytest.approx(1.5 * math.log(2), abs=1e-12)


def test_normalize_zero_mean_unit_std():
    a = L.normalize(t(1.0, 2.0, 3.0))
    assert a.tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
