"""The MARFT trainer on a real tiny Llama with real peft adapters: learning, isolation, exact resume,
guards, off-policy weights, checkpoints, CLI."""

from __future__ import annotations

import logging
import math
import string
from pathlib import Path

import pytest
import torch

from marft_bridge.errors import MarftError
from marft_bridge.schema import Episode, Reward
from marft_bridge.trainers import losses
from marft_bridge.trainers.config import MarftConfig
from marft_bridge.trainers.marft import MarftTrainer
from marft_bridge.trainers.rollout import RolloutPolicy

torch.set_num_threads(1)

FAST = dict(ppo_epochs=2, num_minibatches=2, lr=1e-2, entropy_coef=0.0, kl_coef=0.0,
            target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with its final norm scaled x4: a random 64-wide model's logits are otherwise so
    small that its next-token distribution is nearly uniform and no adapter can sharpen it quickly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("task") / "base"
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        m.model.norm.weight.mul_(4.0)
    m.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def make_env(b_tokens: int = 1):
    """Two agents: "a" must say a lowercase letter; "b" sees a's output and must answer with a digit
    when a said a letter, else with a letter. Team reward: 0.5 per agent that got it right."""

    def env(policy: RolloutPolicy, n: int, seed: int) -> list[Episode]:
        g = torch.Generator().manual_seed(seed)
        acts_a = policy.act_many("a", [[{"role": "user", "content": "letter?"}]] * n, max_new_tokens=1, generator=g)
        acts_b = policy.act_many("b", [[{"role": "user", "content": "after " + a.output.text}] for a in acts_a],
                                 max_new_tokens=b_tokens, generator=g, depends_on=[[a.id] for a in acts_a], step=1)
        eps = []
        for a, b in zip(acts_a, acts_b):
            x, y = a.output.text[:1], b.output.text[:1]
            ok_a = x != "" and x in string.ascii_lowercase
            ok_b = y != "" and (y in string.digits if ok_a else y in string.ascii_lowercase)
            eps.append(Episode(actions=[a, b], rewards=[Reward(value=0.5 * ok_a + 0.5 * ok_b, source="checker")]))
        return eps

    return env


def weights(trainer, adapter):
    return [p.detach().clone() for p in trainer.policy.adapter_params(adapter)]


def same(xs, ys):
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


@pytest.mark.parametrize("mode,b_tokens", [("marft_a", 1), ("marft_t", 2), ("single_agent", 1)])
def test_held_out_reward_rises(model_dir, mode, b_tokens):
    env = make_env(b_tokens)
    tr = MarftTrainer(MarftConfig(mode=mode, seed=0, **FAST), model_dir, agents=["a", "b"])
    before = tr.evaluate(env, 256, seed=12345)
    assert tr.evaluate(env, 256, seed=12345, untrained=True) == before  # fresh LoRA (B = 0) is the base model
    history = tr.train(env, iterations=8, episodes_per_iteration=64)
    after = tr.evaluate(env, 256, seed=12345)
    assert after >= before + 0.15, (before, after, [round(m["reward_mean"], 3) for m in history])
    assert tr.evaluate(env, 256, seed=12345, untrained=True) == before  # the baseline is untouched
    if mode == "single_agent":
        assert tr.policy.adapters == ["single"] and all(m["agent_order"] == ["single"] for m in history)


def test_training_a_leaves_b_bit_identical(model_dir, tmp_path):
    env = make_env()
    tr = MarftTrainer(MarftConfig(frozen_agents=["b"], **FAST), model_dir, agents=["a", "b"])
    tr.save_adapters(tmp_path / "before")
    wa, wb = weights(tr, "agent_a"), weights(tr, "b")
    for _ in range(2):
        m = tr.train_on(env(RolloutPolicy(tr), 32, 7))
    assert m["agent_order"] == ["a"]
    assert same(weights(tr, "b"), wb)
    assert not same(weights(tr, "agent_a"), wa)
    tr.save_adapters(tmp_path / "after")
    f = "adapter_model.safetensors"
    assert (tmp_path / "after/b" / f).read_bytes() == (tmp_path / "before/b" / f).read_bytes()
    assert (tmp_path / "after/a" / f).read_bytes() != (tmp_path / "before/a" / f).read_bytes()


def _all_state(tr):
    w = {n: p.detach().clone() for n, p in tr.named_weights().items()}
    opt = {k: o.state_dict() for k, o in tr.optimizers().items()}
    return w, opt


@pytest.mark.parametrize("mode", ["marft_a", "marft_t"])
def test_resume_is_exact(model_dir, tmp_path, mode):
    env = make_env(2)
    # MARFT-T also runs the critic with its own LoRA backbone (its adapter and optimiser resume too).
    cfg = MarftConfig(mode=mode, agent_order="random", seed=3, lora_dropout=0.1,
                      critic_backbone="lora" if mode == "marft_t" else "frozen",
                      **{**FAST, "kl_coef": 0.05, "entropy_coef": 0.01})
    full = MarftTrainer(cfg, model_dir, agents=["a", "b"])
    full_hist = full.train(env, iterations=3, episodes_per_iteration=16)

    part = MarftTrainer(cfg, model_dir, agents=["a", "b"])
    part.train(env, iterations=1, episodes_per_iteration=16)
    part.save_checkpoint(tmp_path / "ckpt")
    del part
    resumed = MarftTrainer(cfg, model_dir, agents=["a", "b"])
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.update_count == 1
    hist = resumed.train(env, iterations=2, episodes_per_iteration=16)

    assert hist[-1] == full_hist[-1]
    (w1, o1), (w2, o2) = _all_state(full), _all_state(resumed)
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    for k in o1:
        for pid, st in o1[k]["state"].items():
            assert all(torch.equal(st[x], o2[k]["state"][pid][x]) for x in st)


def test_checkpoint_refuses_other_agents(model_dir, tmp_path):
    tr = MarftTrainer(MarftConfig(**FAST), model_dir, agents=["a", "b"])
    tr.save_checkpoint(tmp_path / "ckpt")
    other = MarftTrainer(MarftConfig(**FAST), model_dir, agents=["a", "c"])
    with pytest.raises(MarftError, match="is for agents"):
        other.load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(MarftError, match="cannot read checkpoint"):
        other.load_checkpoint(tmp_path / "missing")


def test_injected_nan_is_skipped_and_logged(model_dir, monkeypatch, caplog):
    env = make_env()
    tr = MarftTrainer(MarftConfig(**{**FAST, "ppo_epochs": 1, "num_minibatches": 1}), model_dir, agents=["a", "b"])
    eps = env(RolloutPolicy(tr), 16, 5)
    real = losses.clipped_surrogate
    calls = []

    def nan_once(*args, **kw):
        calls.append(1)
        out = real(*args, **kw)
        return out * float("nan") if len(calls) == 1 else out

    monkeypatch.setattr(losses, "clipped_surrogate", nan_once)
    before = {a: weights(tr, a) for a in tr.policy.adapters}
    with caplog.at_level(logging.WARNING, logger="marft_bridge.trainers"):
        m = tr.train_on(eps)
    first, second = (tr.policy.adapter_of[a] for a in m["agent_order"])
    assert m["skipped_nonfinite"] == 1 and not m["rolled_back"]
    assert same(weights(tr, first), before[first])  # its only step was skipped
    assert not same(weights(tr, second), before[second])
    assert all(torch.isfinite(p).all() for p in tr.trainable())
    assert "non-finite policy" in caplog.text


def test_collapse_rolls_back_to_last_stable(model_dir, caplog):
    env = make_env()
    tr = MarftTrainer(MarftConfig(**FAST), model_dir, agents=["a", "b"])
    tr.train_on(env(RolloutPolicy(tr), 16, 1))  # a healthy update: becomes the stable state
    stable, _ = _all_state(tr)
    tr.config = tr.config.model_copy(update={"collapse_entropy_min": 50.0})  # entropy can never reach 50 nats
    assert tr.passes.config is tr.config  # the micro-batched passes follow a replaced config
    with caplog.at_level(logging.WARNING, logger="marft_bridge.trainers"):
        m = tr.train_on(env(RolloutPolicy(tr), 16, 2))
    assert m["rolled_back"] and m["update"] == 2
    now, opt = _all_state(tr)
    assert all(torch.equal(stable[k], now[k]) for k in stable)
    assert "collapse (entropy" in caplog.text


def test_approx_kl_early_stop_is_logged(model_dir, caplog):
    env = make_env()
    tr = MarftTrainer(MarftConfig(**{**FAST, "ppo_epochs": 4, "target_kl": 1e-12}), model_dir, agents=["a", "b"])
    with caplog.at_level(logging.WARNING, logger="marft_bridge.trainers"):
        m = tr.train_on(env(RolloutPolicy(tr), 16, 3))
    assert sorted(s["agent"] for s in m["early_stops"]) == ["a", "b"]
    assert all(s["epoch"] == 1 for s in m["early_stops"])
    assert caplog.text.count("stopping its epochs") == 2


def test_decoupled_weights_off_policy_traces(model_dir):
    env = make_env()

    def fresh():  # same seed: proximal log-probs equal the sampled ones in every case below
        return MarftTrainer(MarftConfig(**{**FAST, "ppo_epochs": 1}), model_dir, agents=["a", "b"])

    eps = env(RolloutPolicy(fresh()), 16, 4)
    on = fresh().train_on(eps)
    assert on["behaviour_weight"] == pytest.approx(1.0, abs=1e-4)  # own samples: behaviour == proximal
    # An older adapter version made the same tokens much less likely: weight exp(3) is capped at 5.
    old = [e.model_copy(deep=True) for e in eps]
    for e in old:
        for a in e.actions:
            a.output.logprobs = [x - 3.0 for x in a.output.logprobs]
    assert fresh().train_on(old)["behaviour_weight"] == 5.0
    # ... and made them more likely: exp(-1) each, uncapped.
    for e in old:
        for a in e.actions:
            a.output.logprobs = [min(x + 4.0, 0.0) for x in a.output.logprobs]
    assert fresh().train_on(old)["behaviour_weight"] < 0.5
    for e in old:
        for a in e.actions:
            a.output.logprobs = None
    m = fresh().train_on(old)
    assert m["behaviour_weight"] == 1.0 and m["flagged"] == {"no_behaviour_logprobs": 32}


def test_logprobs_recomputed_under_sampling_temperature(model_dir):
    tr = MarftTrainer(MarftConfig(**FAST), model_dir, agents=["a", "b"])
    act = RolloutPolicy(tr).act("a", [{"role": "user", "content": "hi"}], max_new_tokens=4, temperature=0.5,
                                generator=torch.Generator().manual_seed(0))
    ids = act.observation.prompt_token_ids + act.output.token_ids
    n = len(act.observation.prompt_token_ids)
    with torch.no_grad():
        logits = tr.policy.model(torch.tensor([ids])).logits[0].float()
    manual = torch.log_softmax(logits / 0.5, -1)[torch.arange(n - 1, len(ids) - 1), torch.tensor(ids[n:])]
    assert act.output.logprobs == pytest.approx(manual.tolist(), abs=1e-5)
    at_t1 = torch.log_softmax(logits, -1)[torch.arange(n - 1, len(ids) - 1), torch.tensor(ids[n:])]
    assert not torch.allclose(manual, at_t1, atol=1e-3)  # temperature matters: T=1 would be the wrong policy


def test_saved_adapters_reload_with_peft(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    env = make_env()
    tr = MarftTrainer(MarftConfig(**FAST), model_dir, agents=["a", "b"])
    tr.train_on(env(RolloutPolicy(tr), 16, 9))
    out = tr.save_adapters(tmp_path / "adapters")
    assert sorted(p.name for p in out.iterdir()) == ["a", "b"]
    for agent in ("a", "b"):
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (out / agent).iterdir()}
        assert not list((out / agent).glob("*.bin"))  # safetensors only
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    loaded = PeftModel.from_pretrained(base, out / "b", adapter_name="b")
    with torch.no_grad():
        tr.policy.model.set_adapter("b")
        expect = tr.policy.model(ids).logits
        got = loaded(ids).logits
    assert torch.allclose(expect, got, atol=1e-5)


def test_dependency_order_and_bad_input(model_dir):
    env = make_env()
    tr = MarftTrainer(MarftConfig(**{**FAST, "agent_order": "dependency", "ppo_epochs": 1}), model_dir,
                      agents=["b", "a"])
    eps = env(RolloutPolicy(tr), 8, 6)
    eps.append(Episode(actions=[eps[0].actions[0].model_copy(update={"id": "x"})]))  # no reward
    ghost = eps[1].actions[0].model_copy(update={"id": "g", "agent": "ghost", "policy": None})  # no served adapter
    eps.append(Episode(actions=[ghost], rewards=[Reward(value=1.0)]))
    m = tr.train_on(eps)
    assert m["agent_order"] == ["a", "b"]  # a acts first in D
    assert m["skipped"] == {"episode_without_reward": 1, "agent_without_adapter": 1,
                            "episode_without_trainable_action": 1}
    assert m["episodes"] == 8
    with pytest.raises(MarftError, match="nothing trainable"):
        tr.train_on(eps[-2:])


def test_config_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("mode: marft_t\nlr: 1.0e-4\nppo_epochs: 2\n")
    c = MarftConfig.from_yaml(p)
    assert (c.mode, c.lr, c.ppo_epochs, c.clip, c.gamma) == ("marft_t", 1e-4, 2, 0.2, 0.99)
    assert MarftConfig.model_validate(__import__("yaml").safe_load(c.to_yaml())) == c
    p.write_text("mode: marft_x\n")
    with pytest.raises(MarftError, match="mode"):
        MarftConfig.from_yaml(p)
    p.write_text("lrr: 1\n")
    with pytest.raises(MarftError, match="lrr"):
        MarftConfig.from_yaml(p)


def test_cli_train_and_plot(model_dir, tmp_path):
    from marft_bridge.cli import main
    from marft_bridge.store import TraceStore
    from marft_bridge.trainers.plot import read_metrics

    tr = MarftTrainer(MarftConfig(**FAST), model_dir, agents=["a", "b"])
    eps = make_env()(RolloutPolicy(tr), 24, 11)
    jsonl = tmp_path / "eps.jsonl"
    jsonl.write_text("".join(e.model_dump_json() + "\n" for e in eps[:12]) + "{not json\n")
    with TraceStore.open(tmp_path / "traces.db") as store:
        for e in eps[12:]:
            store.add_episode(e)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("ppo_epochs: 1\nnum_minibatches: 2\nlr: 1.0e-3\nbatch_episodes: 8\n")
    out = tmp_path / "run"
    rc = main(["train", "--store", str(tmp_path / "traces.db"), "--episodes", str(jsonl), "--base-model",
               str(model_dir), "--config", str(cfg), "--out", str(out), "--no-progress"])
    assert rc == 0
    assert (out / "adapters/a/adapter_model.safetensors").exists()
    assert (out / "adapters/b/adapter_config.json").exists()
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["update"] for r in rows] == [1, 2, 3]  # 24 episodes / 8 per update
    assert (out / "checkpoint/state.json").exists()
    saved = MarftConfig.from_yaml(out / "config.yaml")  # the effective config, beside metrics.jsonl
    assert (saved.ppo_epochs, saved.batch_episodes, saved.factor_scope, saved.agent_order) == (1, 8, "ancestors",
                                                                                              "dependency")
    rc = main(["train", "--episodes", str(jsonl), "--base-model", str(model_dir), "--config", str(cfg),
               "--out", str(out), "--iterations", "1", "--resume", "--no-progress"])
    assert rc == 0 and [r["update"] for r in read_metrics(out / "metrics.jsonl")][-1] == 4
    assert main(["plot", str(out / "metrics.jsonl"), "--out", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["train", "--episodes", str(tmp_path / "none.jsonl"), "--base-model", str(model_dir),
                 "--out", str(out)]) == 1


@pytest.mark.parametrize("scope", ["ancestors", "episode", "step", "none"])
def test_factor_m_in_the_update(model_dir, scope):
    """b's M = exp(new - proximal) of a's action in its episode (ancestors, episode); 1 under step
    (a at step 0, b at step 1 never share a step) and none; a, updated first, always has M = 1."""
    env = make_env()
    cfg = MarftConfig(**{**FAST, "factor_scope": scope, "factor_clip": None})
    tr = MarftTrainer(cfg, model_dir, agents=["b", "a"])
    eps = env(RolloutPolicy(tr), 8, 13)
    prox = [a.output.logprobs[0] for e in eps for a in e.actions if a.agent == "a"]  # sampled = proximal
    m = tr.train_on(eps)
    assert m["agent_order"] == ["a", "b"]  # dependency order (the default), whatever the agents' order
    # a's updated log-prob of its one token, straight from the peft model's logits (T = 1).
    tr.policy.model.set_adapter("agent_a")
    new = []
    with torch.no_grad():
        for e in eps:
            obs, tok = e.actions[0].observation.prompt_token_ids, e.actions[0].output.token_ids[0]
            logits = tr.policy.model(torch.tensor([obs + [tok]])).logits[0, len(obs) - 1].float()
            new.append(float(torch.log_softmax(logits, -1)[tok]))
    got_a, got_b = tr.last_factor[0::2], tr.last_factor[1::2]  # samples: (a, b) per episode
    assert got_a == [1.0] * 8
    if scope in ("ancestors", "episode"):
        assert got_b == pytest.approx([math.exp(n - p) for n, p in zip(new, prox)], rel=1e-4)
        assert any(abs(v - 1) > 1e-3 for v in got_b)
        assert m["factor_samples"] == 8 and m["factor_clipfrac"] == 0.0
        assert m["factor_min"] == pytest.approx(min(got_b)) and m["factor_max"] == pytest.approx(max(got_b))
    else:
        assert got_b == [1.0] * 8 and m["factor_samples"] == 0


def test_shared_adapter_parameter_sharing(model_dir, tmp_path):
    tr = MarftTrainer(MarftConfig(**{**FAST, "shared_adapter": True}), model_dir, agents=["a", "b"])
    assert tr.policy.adapters == ["shared"]
    m = tr.train_on(make_env()(RolloutPolicy(tr), 16, 17))
    assert m["agent_order"] == ["shared"]  # one group, M = 1: no re-update against stale proximal log-probs
    assert m["factor_samples"] == 0 and tr.last_factor == [1.0] * m["samples"]
    out = tr.save_adapters(tmp_path / "ad")
    f = "adapter_model.safetensors"
    assert (out / "a" / f).read_bytes() == (out / "b" / f).read_bytes()


def test_load_adapters_warm_start(model_dir, tmp_path):
    tr = MarftTrainer(MarftConfig(**FAST), model_dir, agents=["a", "b"])
    tr.train_on(make_env()(RolloutPolicy(tr), 16, 19))
    tr.save_adapters(tmp_path / "pub")
    fresh = MarftTrainer(MarftConfig(**FAST), model_dir, agents=["a", "b"])
    fresh.load_adapters(tmp_path / "pub")
    for adapter in ("agent_a", "b"):
        assert same(weights(fresh, adapter), weights(tr, adapter))
    wide = MarftTrainer(MarftConfig(**{**FAST, "lora_r": 4}), model_dir, agents=["a", "b"])
    with pytest.raises(MarftError, match="does not fit"):
        wide.load_adapters(tmp_path / "pub")
    with pytest.raises(MarftError, match="cannot load adapter"):
        fresh.load_adapters(tmp_path / "missing")
