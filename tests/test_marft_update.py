"""The sequential update's new parts, by hand: factor_scope round (HAPPO) against ancestors under a
random order, allowed_token_ids masking in every log-prob, update_scheme rerollout, target_kl."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from marft_bridge.trainers.factor import factor_sources, fold_factor  # noqa: E402

LOG_RATIO = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)  # whole-action log pi_new/pi_old per sample


def _m_after(parents, agents, scope, order):
    """log M per sample as each agent's update saw it, updating the agents in ``order`` (one episode)."""
    sources = factor_sources(parents, agents, [0] * len(agents), [0] * len(agents), scope)
    log_m, n = torch.zeros(len(agents), dtype=torch.float64), torch.zeros(len(agents), dtype=torch.float64)
    seen = {}
    for agent in order:
        idx = [k for k, a in enumerate(agents) if a == agent]
        for k in idx:
            seen[k] = float(log_m[k])
        updated = torch.tensor([a == agent for a in agents])
        log_m, n = fold_factor(log_m, n, sources, LOG_RATIO, updated)
    return [seen[k] for k in range(len(agents))]


def test_round_scope_on_a_chain_counts_a_downstream_agent_updated_earlier():
    # A -> B -> C, updated in the random order C, A, B.
    parents, agents = [[], [0], [1]], ["A", "B", "C"]
    # round: A's M holds C's ratio (C was updated first); B's holds C's and A's; C's nothing.
    assert _m_after(parents, agents, "round", ["C", "A", "B"]) == pytest.approx([0.3, 0.3 + 0.1, 0.0])
    # ancestors: only the updated ancestors count: A nothing, B only A, C nothing (updated first).
    assert _m_after(parents, agents, "ancestors", ["C", "A", "B"]) == pytest.approx([0.0, 0.1, 0.0])
    # In dependency order the two scopes agree (every earlier-updated agent is an ancestor).
    assert _m_after(parents, agents, "round", ["A", "B", "C"]) == pytest.approx([0.0, 0.1, 0.3])
    assert _m_after(parents, agents, "ancestors", ["A", "B", "C"]) == pytest.approx([0.0, 0.1, 0.3])


def test_round_scope_on_a_fan_out_counts_siblings_and_descendants():
    # A -> B, A -> C (B and C siblings), updated in the order C, B, A.
    parents, agents = [[], [0], [0]], ["A", "B", "C"]
    # round: B's M holds its sibling C's ratio; A's holds both children's.
    assert _m_after(parents, agents, "round", ["C", "B", "A"]) == pytest.approx([0.2 + 0.3, 0.3, 0.0])
    # ancestors: B never sees its sibling, A never sees its descendants.
    assert _m_after(parents, agents, "ancestors", ["C", "B", "A"]) == pytest.approx([0.0, 0.0, 0.0])


def test_round_scope_keeps_rounds_apart():
    # planner -> solver -> planner -> solver: rounds 0, 0, 1, 1; M pairs never cross a round.
    k, j = factor_sources([[], [0], [1], [2]], ["p", "s", "p", "s"], [0] * 4, [0, 1, 2, 3], "round")
    assert sorted(zip(k.tolist(), j.tolist())) == [(0, 1), (1, 0), (2, 3), (3, 2)]


# -- allowed_token_ids ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    pytest.importorskip("peft")
    from marft_bridge.demo.tinymodel import build_tiny_model
    from marft_bridge.trainers.config import MarftConfig
    from marft_bridge.trainers.policy import MultiAgentPolicy

    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(path, seed=3, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)
    torch.manual_seed(0)
    p = MultiAgentPolicy(path, ["alice"], MarftConfig(device="cpu", logits_chunk_tokens=2), torch.device("cpu"))
    with torch.no_grad():  # a non-identity adapter, so the masked adapter pass differs from the reference's
        for name, w in p.adapter_named_params("alice").items():
            w.normal_(0, 0.3)
    return p


def _samples(allowed):
    from marft_bridge.trainers.batch import Sample

    obs = [[5, 6, 7], [8, 9]]
    acts = [[allowed[0], allowed[1]], [allowed[2]]]
    return [Sample(0, "e", f"x{i}", "alice", 0, o, a, None, 0.7, allowed=tuple(sorted(allowed)))
            for i, (o, a) in enumerate(zip(obs, acts))]


def _direct(policy, adapter, samples, allowed):
    """log-softmax of logits / T with every token outside ``allowed`` at -inf: one plain forward."""
    out = []
    with policy.activate(adapter):
        for s in samples:
            ids = torch.tensor([s.obs_ids + s.act_ids])
            logits = policy.model(input_ids=ids).logits[0].double() / s.temperature  # (T, V)
            mask = torch.full((logits.shape[-1],), -math.inf, dtype=torch.float64)
            mask[list(allowed)] = 0.0
            logp = torch.log_softmax(logits + mask, -1)
            n = len(s.obs_ids)
            out.append(torch.stack([logp[n - 1 + t, y] for t, y in enumerate(s.act_ids)]))
    return torch.cat(out)


def test_masked_logprobs_equal_a_direct_masked_forward_and_sum_to_one(policy):
    from marft_bridge.trainers.passes import SamplePasses

    allowed = [11, 12, 13, 14]
    samples = _samples(allowed)
    passes = SamplePasses(policy, None, lambda: policy.config)
    for adapter in ("alice", None):  # the new/proximal pass and the reference pass
        with torch.no_grad():
            got = passes.forward(adapter, samples, grad=False, entropy=True)
        with torch.no_grad():
            want = _direct(policy, adapter, samples, allowed)
        assert got[0].double().tolist() == pytest.approx(want.tolist(), abs=1e-5)
        assert torch.isfinite(got[1]).all()  # the entropy ignores the masked entries (no -inf * 0)
    # Summed over the allowed tokens, the masked distribution after sample 1's prompt is 1.
    from marft_bridge.trainers.batch import Sample

    total = 0.0
    for y in allowed:
        s = Sample(0, "e", "x", "alice", 0, [8, 9], [y], None, 0.7, allowed=tuple(allowed))
        with torch.no_grad():
            total += float(passes.forward("alice", [s], grad=False)[0].exp().sum())
    assert total == pytest.approx(1.0, abs=1e-5)


def test_masked_gradient_pass_matches_autograd_of_the_direct_forward(policy):
    from marft_bridge.trainers.passes import SamplePasses

    allowed = [11, 12, 13, 14]
    samples = _samples(allowed)
    passes = SamplePasses(policy, None, lambda: policy.config)
    params = policy.adapter_params("alice")
    logp, ent, _, _ = passes.forward("alice", samples, grad=True, entropy=True)  # the chunked custom backward
    (logp.sum() + ent.sum()).backward()
    got = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    direct = _direct(policy, "alice", samples, allowed)
    ent_direct = _masked_entropy(policy, samples, allowed)
    (direct.sum() + ent_direct.sum()).backward()
    for g, p in zip(got, params):
        assert torch.allclose(g.double(), p.grad.double(), atol=1e-5), (g - p.grad).abs().max()
        p.grad = None


def _masked_entropy(policy, samples, allowed):
    out = []
    with policy.activate("alice"):
        for s in samples:
            logits = policy.model(input_ids=torch.tensor([s.obs_ids + s.act_ids])).logits[0].double() / s.temperature
            z = logits[:, list(allowed)]  # only the allowed entries carry probability
            p = torch.softmax(z, -1)
            n = len(s.obs_ids)
            h = -(p * torch.log_softmax(z, -1)).sum(-1)
            out.append(h[n - 1:n - 1 + len(s.act_ids)])
    return torch.cat(out)


# -- rerollout and target_kl, on the relay ------------------------------------------------------------


@pytest.fixture(scope="module")
def relay_base(tmp_path_factory):
    pytest.importorskip("langgraph")
    from marft_bridge.benchmarks.relay import RelaySpec, WarmStartConfig, warm_start

    return warm_start(RelaySpec(hops=2), tmp_path_factory.mktemp("models"), WarmStartConfig(steps=200))


def test_rerollout_updates_each_agent_on_fresh_episodes_of_the_previous_agents_new_adapter(relay_base, tmp_path):
    from marft_bridge.benchmarks.ablation import RunSettings, run_arm
    from marft_bridge.benchmarks.relay import RelaySpec
    from marft_bridge.store import TraceStore

    settings = RunSettings(iterations=2, episodes=9, masked=True)
    with TraceStore.open(tmp_path / "t.db") as store:
        r = run_arm(RelaySpec(hops=2), relay_base, "marft_a_rerollout", 0, 3e-3, settings, store)
        eps = sorted(store.episodes(source="relay/marft_a_rerollout/s0"), key=lambda e: e.started_at)
    assert r["episodes"] == 2 * 9  # the same total as the stale arms
    for it in r["diagnostics"]:
        assert [(u["rerollout"]["agent"], u["rerollout"]["episodes"], u["rerollout"]["swap"]) for u in it] == \
            [("encoder", 5, False), ("decoder", 4, True)]
        assert [list(u["per_agent"]) for u in it] == [["encoder"], ["decoder"]]  # one agent per update
        assert all(a["m_q05"] == a["m_q95"] == 1.0 for u in it for a in u["per_agent"].values())  # M = 1
    # Trainer versions the episodes were played at: 5 at v0 (encoder's share), then 4 at v1, i.e.
    # after the encoder's update (the decoder trains on them), then v2 and v3 in iteration 2.
    versions = [{a.policy.version for a in e.actions} for e in eps]
    assert versions == [{0}] * 5 + [{1}] * 4 + [{2}] * 5 + [{3}] * 4
    assert all(a.sampling.allowed_token_ids for e in eps for a in e.actions)  # masked, recorded
    assert r["optimizer_steps"] == 2 * 2 * 2  # 2 agents x 2 epochs x 1 minibatch x 2 iterations


def test_target_kl_stops_an_agents_epochs_and_logs_it(relay_base, tmp_path):
    from marft_bridge.benchmarks.ablation import RunSettings, run_arm
    from marft_bridge.benchmarks.relay import RelaySpec
    from marft_bridge.store import TraceStore

    settings = RunSettings(iterations=1, episodes=16, epochs=4, target_kl=1e-12)
    with TraceStore.open(tmp_path / "t.db") as store:
        r = run_arm(RelaySpec(hops=2), relay_base, "marft_a", 0, 5e-3, settings, store)
    (update,) = r["diagnostics"][0]
    # The approx-KL of an epoch is measured in its minibatches' forwards, before their steps (CleanRL):
    # epoch 1 sees the proximal policy itself (KL 0), epoch 2 the first step's (> 1e-12), so each
    # agent stops after epoch 2 of 4, logged, with 2 optimiser steps instead of 4.
    assert [(s["agent"], s["epoch"]) for s in update["early_stops"]] == [("encoder", 2), ("decoder", 2)]
    assert all(s["approx_kl"] > 1e-12 for s in update["early_stops"])
    assert {a: (d["epochs"], d["optimizer_steps"]) for a, d in update["per_agent"].items()} == \
        {"encoder": (2, 2), "decoder": (2, 2)}
    assert r["optimizer_steps"] == 4
