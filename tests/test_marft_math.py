"""Hand-computed numbers for GAE on chains (action and token level), the losses, the KL estimators and
the decoupled weights. GAE along D: tests/test_marft_gae.py; the factor M: tests/test_marft_factor.py."""

from __future__ import annotations

import math

import pytest
import torch

from marft_bridge.trainers import losses as L
from marft_bridge.trainers.advantages import gae_along_d, successors


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_gae_chain_by_hand():
    # Episode 0: two actions recorded without D (taken as a chain), team reward 1 on the last;
    # episode 1: one action, reward 2.
    succ = successors([[], [], []], [0, 0, 1])
    assert succ == [[1], [], []]
    adv, ret = gae_along_d([0.0, 1.0, 2.0], [t(0.5), t(0.2), t(1.0)], succ, gamma=0.9, lam=0.8)
    # A1 = 1 - 0.2 = 0.8 ; A0 = (0 + 0.9*0.2 - 0.5) + 0.9*0.8*0.8 = -0.32 + 0.576 = 0.256 ; A2 = 2 - 1 = 1
    assert torch.cat(adv).tolist() == pytest.approx([0.256, 0.8, 1.0], abs=1e-12)
    assert torch.cat(ret).tolist() == pytest.approx([0.756, 1.0, 2.0], abs=1e-12)


def test_gae_token_level_chain_by_hand():
    # Action 1 has two tokens, action 2 one token with reward 1; gamma per hop 0.9, 1.0 inside an action.
    succ = successors([[], [0]], [0, 0])
    adv, ret = gae_along_d([0.0, 1.0], [t(0.5, 0.4), t(0.2)], succ, gamma=0.9, lam=0.8, token_gamma=1.0,
                           token_lambda=0.8)
    # A2 = 0.8 ; A1 = (0.9*0.2 - 0.4) + 0.9*0.8*0.8 = 0.356 ; A0 = (1.0*0.4 - 0.5) + 1.0*0.8*0.356 = 0.1848
    assert torch.cat(adv).tolist() == pytest.approx([0.1848, 0.356, 0.8], abs=1e-12)
    assert torch.cat(ret).tolist() == pytest.approx([0.6848, 0.756, 1.0], abs=1e-12)


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


def test_kl_estimators_and_entropy_by_hand():
    assert L.kl_k3(t(-1.0), t(-1.5)).item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, abs=1e-12)
    assert L.kl_k3(t(-2.0), t(-2.0)).item() == 0.0
    assert L.kl_k2(t(-1.0), t(-1.5)).item() == pytest.approx(0.5 * 0.25, abs=1e-12)
    # approx_kl = (r - 1) - log r with r = exp(new - prox) = e^0.5
    assert L.approx_kl(t(-1.0), t(-1.5)).item() == pytest.approx(math.exp(0.5) - 1 - 0.5, abs=1e-12)
    uniform = torch.log_softmax(torch.zeros(1, 4), -1)
    assert L.entropy(uniform).item() == pytest.approx(math.log(4), abs=1e-6)
    # p = (1/2, 1/4, 1/4): H = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2
    assert L.entropy(t(0.5, 0.25, 0.25).log()).item() == pytest.approx(1.5 * math.log(2), abs=1e-12)


def test_k2_loss_gradient_is_the_gradient_of_kl_pi_ref():
    """On tokens sampled from pi, E[grad k2] = grad KL(pi || ref) exactly; k3's is grad KL(ref || pi)."""
    theta = torch.tensor([0.3, -0.2, 0.9, 0.0], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.5, -0.4, 0.2], dtype=torch.float64), -1)

    def expected_grad(estimator):
        logp = torch.log_softmax(theta, -1)
        loss = (logp.exp().detach() * estimator(logp, ref)).sum()  # E_{y ~ pi} over the whole vocabulary
        return torch.autograd.grad(loss, theta)[0]

    logp = torch.log_softmax(theta, -1)
    kl_pi_ref = (logp.exp() * (logp - ref)).sum()
    kl_ref_pi = (ref.exp() * (ref - logp)).sum()
    g_forward = torch.autograd.grad(kl_pi_ref, theta, retain_graph=True)[0]
    g_reverse = torch.autograd.grad(kl_ref_pi, theta)[0]
    assert torch.allclose(expected_grad(L.kl_k2), g_forward, atol=1e-12)
    assert torch.allclose(expected_grad(L.kl_k3), g_reverse, atol=1e-12)
    assert not torch.allclose(g_forward, g_reverse, atol=1e-3)


def test_normalize_zero_mean_unit_std():
    a = L.normalize(t(1.0, 2.0, 3.0))
    assert a.tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
