"""The codebook relay: codes, exact J against direct forward passes, the instrumented graph, stats."""

from __future__ import annotations

import itertools
import math

import pytest

from marft_bridge.benchmarks import relay, stats
from marft_bridge.benchmarks.relay import SIZE, WORDS, RelaySpec

# -- task: codes and prompts ----------------------------------------------------------------------


def _compose(spec: RelaySpec, choice: tuple[str, ...], word: int) -> int:
    x = word
    for hop, code in enumerate(choice):
        x = (spec.code_a if code == "A" else spec.code_b)[hop][x]
    return x


@pytest.mark.parametrize("hops", [2, 3, 4])
def test_codes_interlock_and_the_mixture_scores_hops_over_two_to_the_hops(hops):
    spec = RelaySpec(hops=hops, seed=7)
    assert len(spec.agents) == hops and spec.agents[0] == "encoder" and spec.agents[-1] == "decoder"
    for hop in range(hops):  # every map is a bijection between the hop's alphabets
        assert sorted(spec.code_a[hop]) == list(range(SIZE)) == sorted(spec.code_b[hop])
        assert all(a != b for a, b in zip(spec.code_a[hop], spec.code_b[hop]))
    right = {}
    for choice in itertools.product("AB", repeat=hops):
        right[choice] = [_compose(spec, choice, w) == w for w in range(SIZE)]
        assert len(set(right[choice])) == 1  # a per-hop code choice is right for every word or none
    consistent = {c for c, ok in right.items() if ok[0]}
    # all-A, and exactly one upstream B followed by the decoder's B
    expected = {("A",) * hops} | {tuple("B" if h in (k, hops - 1) else "A" for h in range(hops)) for k in range(hops - 1)}
    assert consistent == expected
    assert len(consistent) / 2 ** hops == spec.untrained_j() == hops / 2 ** hops


def test_roles_write_different_alphabets_unless_same_alphabet():
    spec = RelaySpec(hops=4)
    assert spec.alphabet(0) == spec.alphabet(4) == WORDS
    assert [spec.alphabet(p)[0] for p in (1, 2, 3)] == ["0", "A", "!"]
    same = RelaySpec(hops=4, same_alphabet=True)
    assert [same.alphabet(p) for p in (1, 2, 3)] == [tuple("01234567")] * 3
    assert spec.messages(1, "3") == [{"role": "system", "content": "relay1"}, {"role": "user", "content": "3"}]
    assert RelaySpec(seed=1).code_a != RelaySpec(seed=2).code_a
    assert relay.reward("fox", " fox\n") == 1.0 and relay.reward("fox", "fo") == 0.0 and relay.reward("fox", None) == 0.0
    with pytest.raises(ValueError):
        RelaySpec(hops=5)


def test_demonstrations_are_the_exact_fifty_fifty_mixture():
    spec = RelaySpec(hops=3, seed=3)
    demos = relay.demonstrations(spec)
    assert len(demos) == 3 * SIZE * 2
    by_prompt = {}
    for messages, reply in demos:
        by_prompt.setdefault((messages[0]["content"], messages[1]["content"]), []).append(reply)
    assert len(by_prompt) == 3 * SIZE and all(len(set(r)) == 2 for r in by_prompt.values())
    assert sorted(by_prompt[("decoder", "A")]) == sorted(spec.targets(2, 0))


# -- exact J ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    from marft_bridge.trainers.config import MarftConfig
    from marft_bridge.trainers.marft import MarftTrainer

    spec = RelaySpec(hops=3, seed=0)
    return spec, MarftTrainer(MarftConfig(seed=0, device="cpu"), tiny_model_dir, agents=spec.agents)


def test_hop_matrix_equals_a_direct_forward_pass(trainer, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from marft_bridge.benchmarks.exact import hop_matrix

    spec, tr = trainer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = tr.policy.tokenizer
    for hop, (x, y) in [(0, (2, 5)), (2, (7, 1))]:
        prompt = list(tok.apply_chat_template(spec.messages(hop, spec.alphabet(hop)[x]), add_generation_prompt=True,
                                              tokenize=True)["input_ids"])
        reply = list(tok(spec.alphabet(hop + 1)[y], add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + reply])).logits[0] / 0.7
        logp = torch.log_softmax(logits.double(), -1)
        direct = sum(logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(reply))
        m = hop_matrix(tr, spec, hop, temperature=0.7)
        assert m.shape == (SIZE, SIZE)
        assert m[x, y].item() == pytest.approx(math.exp(direct), rel=1e-4)
        assert float(m.sum()) < SIZE  # the rest is mass on invalid replies


def test_exact_j_is_the_enumerated_triple_sum(trainer):
    from marft_bridge.benchmarks.exact import chain_matrices, exact_j, j_from_matrices

    spec, tr = trainer
    pe, pr, pd = chain_matrices(tr, spec)
    by_hand = sum(pe[w, d] * pr[d, l] * pd[l, w] for w in range(SIZE) for d in range(SIZE) for l in range(SIZE)) / SIZE
    assert exact_j(tr, spec) == pytest.approx(float(by_hand), rel=1e-9)
    import torch

    perfect = [torch.eye(SIZE, dtype=torch.float64)[spec.code_a[h]] for h in range(3)]
    assert j_from_matrices(perfect) == 1.0
    mixture = [0.5 * (torch.eye(SIZE)[spec.code_a[h]] + torch.eye(SIZE)[spec.code_b[h]]) for h in range(3)]
    assert j_from_matrices(mixture) == pytest.approx(0.375)


# -- the instrumented graph --------------------------------------------------------------------------


def test_graph_episodes_are_captured_with_the_chain_dependencies_and_reproduce(trainer, tmp_path):
    from marft_bridge.benchmarks.graph import BatchSampler, instrumented_graph, rollout
    from marft_bridge.store import TraceStore
    from marft_bridge.trainers.rollout import RolloutPolicy

    spec, tr = trainer
    store = TraceStore.open(tmp_path / "t.db")
    sampler = BatchSampler(RolloutPolicy(tr))
    app = instrumented_graph(spec, sampler, store, "relay/test")
    secrets = ["ant", "fox", "hen", "ant", "gnu"]
    eps = rollout(app, sampler, store, "relay/test", secrets, rollout_seed=11)
    assert [e.task for e in eps] == [{"m0": s, "seed": k} for k, s in enumerate(secrets)]
    for ep, secret in zip(eps, secrets):
        assert [a.agent for a in ep.actions] == spec.agents
        enc, rel, dec = ep.actions
        assert enc.depends_on == [] and rel.depends_on == [enc.id] and dec.depends_on == [rel.id]
        assert enc.step < rel.step < dec.step
        # each agent saw only what it was handed
        assert enc.observation.messages[-1].content == secret
        assert rel.observation.messages[-1].content == enc.output.text
        assert dec.observation.messages[-1].content == rel.output.text
        for a in ep.actions:
            assert len(a.output.token_ids) == len(a.output.logprobs) >= 1 and a.observation.prompt_token_ids
        assert [r.value for r in ep.rewards] == [relay.reward(secret, dec.output.text)]
    again = rollout(app, sampler, store, "relay/test", secrets, rollout_seed=11)
    assert [[a.output.token_ids for a in e.actions] for e in again] == [[a.output.token_ids for a in e.actions] for e in eps]
    other = rollout(app, sampler, store, "relay/test", secrets, rollout_seed=12)
    assert [[a.output.token_ids for a in e.actions] for e in other] != [[a.output.token_ids for a in e.actions] for e in eps]
    assert store.count() == 15
    tr.train_on(eps)  # the trainer consumes them as stored traces
    store.close()


# -- statistics -----------------------------------------------------------------------------------------


def test_curve_summaries_by_hand():
    curve = [0.4, 0.6, 1.0, 0.85]
    assert stats.auc(curve) == pytest.approx(((0.4 + 0.6) / 2 + (0.6 + 1.0) / 2 + (1.0 + 0.85) / 2) / 3)
    assert stats.reached(curve) and not stats.reached([0.4, 0.94])
    assert stats.collapsed(curve)  # 0.85 < 1.0 - 0.1
    assert not stats.collapsed([0.4, 0.6, 0.55, 0.9])  # fell 0.05 only
    assert stats.summary([0.5]) == {"auc": 0.5, "final": 0.5, "reached": 0.0, "collapsed": 0.0}


def test_t_distribution_and_intervals_match_tables():
    assert stats.t_quantile(0.975, 10) == pytest.approx(2.228139, abs=1e-5)
    assert stats.t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-3)
    assert stats.t_cdf(0.0, 5) == pytest.approx(0.5)
    assert stats.t_cdf(2.015048, 5) == pytest.approx(0.95, abs=1e-6)
    ci = stats.mean_interval([1.0, 2.0, 3.0, 4.0])
    half = 3.182446 * statistics_stdev([1.0, 2.0, 3.0, 4.0]) / 2
    assert (ci["mean"], ci["lo"], ci["hi"]) == pytest.approx((2.5, 2.5 - half, 2.5 + half), abs=1e-5)
    w = stats.wilson(8, 10)
    assert (w["lo"], w["hi"]) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    # far tails: P(T > t) for df 1 (Cauchy) is atan(1/t)/pi; 1 - cdf would round it to 0
    for t in (3.0, 1e10, 1e20):
        assert stats.t_tail(t, 1) == pytest.approx(math.atan(1 / t) / math.pi, rel=1e-12)
    assert 0 < stats.mean_interval([0.125 + 1e-4 * (k % 3) for k in range(40)])["p"] < 1e-40


def statistics_stdev(xs):
    import statistics

    return statistics.stdev(xs)


def test_holm_steps_down_and_stops_at_the_first_failure():
    out = stats.holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert out["a"] == {"p_holm": pytest.approx(0.03), "level": pytest.approx(1 - 0.05 / 3), "significant": True}
    assert out["c"]["p_holm"] == pytest.approx(0.06) and out["c"]["significant"] is False  # 0.03 > 0.05/2
    assert out["b"]["p_holm"] == pytest.approx(0.06) and out["b"]["significant"] is False
    comps = stats.paired_comparisons({"x": [1.0, 2.0, 3.0], "y": [0.5, 1.0, 2.0]}, [("x", "y")])
    assert comps["x - y"]["mean"] == pytest.approx(2.5 / 3) and comps["x - y"]["n"] == 3
