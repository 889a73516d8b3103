"""The sequential trust-region factor M by hand (3-agent chain, fan-out/fan-in graph, each
factor_scope, dependency and random orders, clipping, rounds), the dependency order, and in the
trainer: factor_scope none is independent PPO, ancestors couples an agent to its ancestors only,
M uses sum log-probs whatever the reduction, shared_adapter is one group."""

from __future__ import annotations

import math
import random

import pytest
import torch

from marft_bridge.schema import Episode, Reward
from marft_bridge.trainers.config import MarftConfig
from marft_bridge.trainers.factor import (action_rounds, agent_graph_stats, clip_factor, dependency_order,
                                          factor_sources, fold_factor, same_round_ancestors)
from marft_bridge.trainers.marft import MarftTrainer
from marft_bridge.trainers.rollout import RolloutPolicy
from test_trainer import FAST, make_env, model_dir, same, weights  # noqa: F401 - model_dir is a fixture

CHAIN = dict(parents=[[], [0], [1]], agents=["x", "y", "z"], episodes=[0, 0, 0], steps=[0, 1, 2])
CHAIN_LOG_RATIO = [0.1, -0.2, 0.3]
# A -> B, A -> C, (B, C) -> D; B and C act in parallel (same step).
FAN = dict(parents=[[], [0], [0], [1, 2]], agents=["A", "B", "C", "D"], episodes=[0] * 4, steps=[0, 1, 1, 2])
FAN_LOG_RATIO = [0.1, 0.2, -0.3, 0.4]


def sequential_m(graph: dict, log_ratio: list[float], order: list[str], scope: str, eps=None) -> list[float]:
    """The M each sample's update uses when the agents are updated in ``order`` (as the trainer does)."""
    k = len(graph["agents"])
    sources = factor_sources(graph["parents"], graph["agents"], graph["episodes"], graph["steps"], scope)
    log_m, n = torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64)
    seen = [None] * k
    for agent in order:
        idx = [i for i, a in enumerate(graph["agents"]) if a == agent]
        m, _ = clip_factor(log_m, n, eps)
        for i in idx:
            seen[i] = float(m[i])
        updated = torch.tensor([a == agent for a in graph["agents"]])
        log_m, n = fold_factor(log_m, n, sources, torch.tensor(log_ratio, dtype=torch.float64), updated)
    return seen


def order_of(graph: dict) -> list[str]:
    names = sorted(set(graph["agents"]))
    anc = factor_sources(graph["parents"], graph["agents"], graph["episodes"], graph["steps"], "ancestors")
    stats = agent_graph_stats(names, graph["agents"], graph["episodes"], anc)
    n = len(names)
    return dependency_order(names, stats[:, :n], stats[:, n + 1] / stats[:, n + 2])


e = math.exp


@pytest.mark.parametrize("scope,order,expect", [
    # dependency order x, y, z: y sees x's ratio, z sees x's and y's (its ancestors)
    ("ancestors", ["x", "y", "z"], [1.0, e(0.1), e(-0.1)]),
    ("episode", ["x", "y", "z"], [1.0, e(0.1), e(-0.1)]),
    ("step", ["x", "y", "z"], [1.0, 1.0, 1.0]),  # three steps: no two actions share one
    ("none", ["x", "y", "z"], [1.0, 1.0, 1.0]),
    # a random draw z, x, y: under ancestors nobody sees a descendant's ratio ...
    ("ancestors", ["z", "x", "y"], [1.0, e(0.1), 1.0]),
    # ... the trajectory-level variant does: x's M holds z's ratio, y's holds z's and x's
    ("episode", ["z", "x", "y"], [e(0.3), e(0.4), 1.0]),
    ("none", ["z", "x", "y"], [1.0, 1.0, 1.0]),
])
def test_m_on_a_three_agent_chain_by_hand(scope, order, expect):
    assert order_of(CHAIN) == ["x", "y", "z"]
    assert sequential_m(CHAIN, CHAIN_LOG_RATIO, order, scope) == pytest.approx(expect, rel=1e-12)


@pytest.mark.parametrize("scope,order,expect", [
    # dependency order A, B, C, D: C's M holds A's ratio only (B is its sibling), D's A's, B's and C's
    ("ancestors", ["A", "B", "C", "D"], [1.0, e(0.1), e(0.1), e(0.0)]),
    ("episode", ["A", "B", "C", "D"], [1.0, e(0.1), e(0.3), e(0.0)]),  # C also counts its sibling B
    ("step", ["A", "B", "C", "D"], [1.0, 1.0, e(0.2), 1.0]),  # HAPPO over the parallel pair B, C
    ("none", ["A", "B", "C", "D"], [1.0, 1.0, 1.0, 1.0]),
    # a random draw D, C, A, B
    ("ancestors", ["D", "C", "A", "B"], [1.0, e(0.1), 1.0, 1.0]),
    ("episode", ["D", "C", "A", "B"], [e(0.1), e(0.2), e(0.4), 1.0]),
    ("step", ["D", "C", "A", "B"], [1.0, e(-0.3), 1.0, 1.0]),
])
def test_m_on_the_fan_out_fan_in_graph_by_hand(scope, order, expect):
    assert order_of(FAN) == ["A", "B", "C", "D"]  # B, C: no edge between them; B acts earlier
    assert sequential_m(FAN, FAN_LOG_RATIO, order, scope) == pytest.approx(expect, rel=1e-12)


def test_clipping_bounds_m_per_folded_ratio():
    # eps 0.05: y's M = e^0.1 = 1.105 > 1.05 is clipped; z's M = e^-0.1 = 0.905 lies inside
    # [0.95^2, 1.05^2] = [0.9025, 1.1025] (two ratios folded) and is not.
    got = sequential_m(CHAIN, CHAIN_LOG_RATIO, ["x", "y", "z"], "ancestors", eps=0.05)
    assert got == pytest.approx([1.0, 1.05, e(-0.1)], rel=1e-12)
    m, clipped = clip_factor(torch.tensor([0.0, 5.0, -5.0, 5.0], dtype=torch.float64),
                             torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float64), 0.2)
    assert m.tolist() == pytest.approx([1.0, 1.2, 0.64, 1.728], rel=1e-12)
    assert clipped.tolist() == [False, True, True, True]


def test_rounds_by_hand():
    # planner -> solver -> planner -> solver: the planner acting again starts round 1
    assert action_rounds([[], [0], [1], [2]], ["p", "s", "p", "s"]) == [0, 0, 1, 1]
    assert action_rounds(FAN["parents"], FAN["agents"]) == [0, 0, 0, 0]
    # one agent in two parallel branches is one round; the join after it too
    assert action_rounds([[], [0], [0], [1, 2]], ["a", "b", "b", "c"]) == [0, 0, 0, 0]
    # solver1's M never holds round 0's ratios: its only same-round ancestor is planner1
    assert same_round_ancestors([[], [0], [1], [2]], ["p", "s", "p", "s"]) == [set(), {0}, set(), {2}]
    with pytest.raises(ValueError, match="not earlier"):
        action_rounds([[1], []], ["a", "b"])


def test_ancestors_sources_are_same_round_ancestors_on_random_graphs():
    rng = random.Random(0)
    for _ in range(200):
        k = rng.randint(1, 9)
        parents = [sorted(rng.sample(range(i), rng.randint(0, min(i, 2)))) for i in range(k)]
        agents = [rng.choice("pqr") for _ in range(k)]
        rounds = action_rounds(parents, agents)
        closure: list[set[int]] = []
        for ps in parents:
            closure.append(set(ps).union(*(closure[p] for p in ps)))
        ks, js = factor_sources(parents, agents, [0] * k, list(range(k)), "ancestors")
        pairs = set(zip(ks.tolist(), js.tolist()))
        expect = {(i, j) for i in range(k) for j in closure[i] if rounds[j] == rounds[i]}
        assert pairs == expect  # never a descendant, a sibling, another round; never its own agent
        assert all(agents[i] != agents[j] for i, j in pairs)
        assert all(rounds[i] >= rounds[p] for i in range(k) for p in parents[i])


def test_dependency_order_breaks_cycles_deterministically():
    # Episode 0: p -> q ; episode 1: q -> p ; episode 2: p -> q. More pairs p -> q: p first.
    graph = dict(parents=[[], [0], [], [2], [], [4]], agents=["p", "q", "q", "p", "p", "q"],
                 episodes=[0, 0, 1, 1, 2, 2], steps=[0, 1, 0, 1, 0, 1])
    assert order_of(graph) == ["p", "q"]
    assert order_of(dict(parents=[[], []], agents=["b", "a"], episodes=[0, 1], steps=[0, 0])) == ["a", "b"]


# -- in the trainer ----------------------------------------------------------------------------------


def _trained(model_dir, eps, order, monkeypatch, **cfg):
    tr = MarftTrainer(MarftConfig(**{**FAST, **cfg}), model_dir, agents=["a", "b"])
    monkeypatch.setattr(tr, "_agent_order", lambda batch, anc: order)
    m = tr.train_on(eps)
    assert m["agent_order"] == order
    return {a: weights(tr, a) for a in ("agent_a", "b")}


def test_factor_scope_none_is_independent_ppo_and_ancestors_is_not(model_dir, monkeypatch):
    env = make_env(2)
    eps = env(RolloutPolicy(MarftTrainer(MarftConfig(**FAST), model_dir, agents=["a", "b"])), 16, 23)
    ab = _trained(model_dir, eps, ["a", "b"], monkeypatch, factor_scope="none")
    ba = _trained(model_dir, eps, ["b", "a"], monkeypatch, factor_scope="none")
    assert same(ab["agent_a"], ba["agent_a"]) and same(ab["b"], ba["b"])  # bit-identical in any order
    ab = _trained(model_dir, eps, ["a", "b"], monkeypatch, factor_scope="ancestors")
    ba = _trained(model_dir, eps, ["b", "a"], monkeypatch, factor_scope="ancestors")
    assert same(ab["agent_a"], ba["agent_a"])  # b is a's descendant: never in a's M
    assert not same(ab["b"], ba["b"])  # a, b's ancestor, updated first: b's update changes


def test_m_folds_sum_log_probs_even_with_mean_reduction(model_dir):
    """MARFT-A with logprob_reduction mean: b's M = exp(sum_t new - sum_t prox) over a's 3 tokens."""
    def env(policy, n, seed):
        g = torch.Generator().manual_seed(seed)
        acts_a = policy.act_many("a", [[{"role": "user", "content": "go"}]] * n, max_new_tokens=3, generator=g)
        acts_b = policy.act_many("b", [[{"role": "user", "content": a.output.text or "-"}] for a in acts_a],
                                 max_new_tokens=1, generator=g, depends_on=[[a.id] for a in acts_a], step=1)
        return [Episode(actions=[a, b], rewards=[Reward(value=float(len(a.output.token_ids) == 3))])
                for a, b in zip(acts_a, acts_b)]

    tr = MarftTrainer(MarftConfig(**{**FAST, "logprob_reduction": "mean", "factor_clip": None}), model_dir,
                      agents=["a", "b"])
    eps = env(RolloutPolicy(tr), 8, 29)
    prox = [sum(e.actions[0].output.logprobs) for e in eps]
    m = tr.train_on(eps)
    assert m["agent_order"] == ["a", "b"]
    tr.policy.model.set_adapter("agent_a")
    new = []
    with torch.no_grad():
        for e in eps:
            obs, ids = e.actions[0].observation.prompt_token_ids, e.actions[0].output.token_ids
            logp = torch.log_softmax(tr.policy.model(torch.tensor([obs + ids])).logits[0].float(), -1)
            new.append(float(sum(logp[len(obs) - 1 + j, tok] for j, tok in enumerate(ids))))
    assert any(len(e.actions[0].output.token_ids) > 1 for e in eps)
    assert tr.last_factor[1::2] == pytest.approx([math.exp(x - y) for x, y in zip(new, prox)], rel=1e-4)


def test_factor_clip_bounds_m_in_the_update(model_dir):
    env = make_env(2)
    tr = MarftTrainer(MarftConfig(**{**FAST, "factor_clip": 0.01, "lr": 5e-2}), model_dir, agents=["a", "b"])
    m = tr.train_on(env(RolloutPolicy(tr), 16, 31))
    b = tr.last_factor[1::2]
    assert all(0.99 - 1e-9 <= x <= 1.01 + 1e-9 for x in b)
    assert m["factor_clipfrac"] > 0 and m["factor_max"] <= 1.01 + 1e-9 and m["factor_min"] >= 0.99 - 1e-9
    assert m["factor_min"] <= m["factor_q05"] <= m["factor_q50"] <= m["factor_q95"] <= m["factor_max"]


def test_shared_adapter_is_one_group_equal_to_single_agent_mode(model_dir):
    """shared_adapter in marft_a updates the one adapter once per epoch on all agents' samples (M = 1):
    the same update as single-agent PPO on the same samples, bit for bit."""
    env = make_env(2)
    eps = env(RolloutPolicy(MarftTrainer(MarftConfig(**FAST), model_dir, agents=["a", "b"])), 16, 37)
    shared = MarftTrainer(MarftConfig(**{**FAST, "shared_adapter": True}), model_dir, agents=["a", "b"])
    single = MarftTrainer(MarftConfig(**{**FAST, "mode": "single_agent"}), model_dir, agents=["a", "b"])
    ms, m1 = shared.train_on(eps), single.train_on(eps)
    assert ms["agent_order"] == ["shared"] and m1["agent_order"] == ["single"]
    assert ms["factor_samples"] == 0
    assert same(weights(shared, "shared"), weights(single, "single"))
    assert not same(weights(shared, "shared"), weights(MarftTrainer(MarftConfig(**FAST), model_dir,
                                                                    agents=["a", "b"]), "agent_a"))
