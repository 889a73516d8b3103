"""The continuous fine-tuning service: train when enough rewarded episodes arrived, gate on an
evaluation, publish to the registry, resume after a restart, roll back on a live regression."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from marft_bridge.errors import MarftError  # noqa: E402
from marft_bridge.schema import Action, Episode, Message, Observation, Output, Policy, Reward  # noqa: E402
from marft_bridge.service import ContinuousService, ServiceConfig  # noqa: E402
from marft_bridge.store import TraceStore  # noqa: E402

PROMPT = [{"role": "user", "content": "pick"}]


def _episode(text: str, reward: float, version: int | None = None) -> Episode:
    act = Action(
        agent="picker",
        kind="llm",
        observation=Observation(messages=[Message(**m) for m in PROMPT]),
        output=Output(text=text, finish_reason="stop"),
        policy=Policy(name="picker", version=version),
    )
    return Episode(source="test", actions=[act], rewards=[Reward(value=reward, source="checker")])


def _logp_of(text: str, base_dir, adapter_dir) -> float:
    """log P(text | PROMPT) under the base model with the given adapter (None: the base itself)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)["input_ids"]
    target = tok(text)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([prompt + target])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(target)[:, None]).sum().item()


def _config(tmp_path, base, **kw) -> ServiceConfig:
    trainer = {"lr": 3e-3, "ppo_epochs": 2, "num_minibatches": 1, "kl_coef": 0.0, "entropy_coef": 0.0,
               "lora_r": 4, "lora_alpha": 8, "seed": 0}
    return ServiceConfig(store=str(tmp_path / "traces.db"), base_model=str(base), agents=["picker"],
                         registry=str(tmp_path / "registry"), state_dir=str(tmp_path / "svc"),
                         min_new_episodes=12, heldout_fraction=0.0, rollback_window=4, rollback_margin=0.1,
                         trainer=trainer, **kw)


def _fill(store: TraceStore, n: int, version: int | None = 1, good: float = 1.0, bad: float = 0.0) -> None:
    for i in range(n):
        store.add_episode(_episode("a" if i % 2 == 0 else "b", good if i % 2 == 0 else bad, version))


def _served_version(server, key) -> int | None:
    """The adapter version the live server answers "picker" requests with."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key=key)
    reply = client.chat.completions.create(model="picker", messages=PROMPT, max_tokens=1)
    return reply.model_extra["adapter"]["version"]


@pytest.fixture
def server(tmp_path, tiny_model_dir):
    from marft_bridge.serving import ServerProcess

    with ServerProcess(tiny_model_dir, tmp_path / "registry", api_key="k") as srv:
        yield srv


def test_service_trains_promotes_resumes_and_rolls_back(tmp_path, tiny_model_dir, server):
    from marft_bridge.serving import EmbeddedServerPublisher

    cfg = _config(tmp_path, tiny_model_dir)
    store = TraceStore.open(cfg.store)
    eval_calls = []

    def prefers_a(adapters):  # held-out evaluation: how likely the system now answers "a"
        eval_calls.append(adapters)
        return _logp_of("a", tiny_model_dir, adapters["picker"])

    publishers = [EmbeddedServerPublisher(server.url, "k")]
    svc = ContinuousService(cfg, eval_fn=prefers_a, publishers=publishers)
    _fill(store, 6)
    assert svc.step() == {"decision": "wait", "pending": 6}
    assert svc.registry.current("picker") is None

    # Restart before enough data arrived: the cursor and the pending episodes survive.
    svc = ContinuousService(cfg, eval_fn=prefers_a, publishers=publishers)
    assert len(svc.state.pending) == 6 and svc.state.cursor == store.cursor()
    _fill(store, 6)
    row = svc.step()
    assert row["decision"] == "promote", row
    assert row["candidate_score"] > row["live_score"]
    # v1 is the untrained baseline (LoRA B = 0, the base model); v2 the trained candidate.
    assert svc.registry.current("picker") == 2
    assert svc.registry.manifest("picker", 2).parent == 1
    assert _served_version(server, "k") == 2  # hot-swapped into the running server
    assert eval_calls[-1] == {"picker": svc.registry.path("picker", 1)}
    assert eval_calls[-1] != eval_calls[-2]
    base_logp = _logp_of("a", tiny_model_dir, None)
    assert abs(row["live_score"] - base_logp) < 1e-4
    decisions = [json.loads(x) for x in (tmp_path / "svc" / "decisions.jsonl").read_text().splitlines()]
    assert [d["decision"] for d in decisions] == ["baseline", "promote"] and "margin" in decisions[1]["reason"]

    # Restart after the promotion: the trainer resumes from the accepted checkpoint, whose adapter
    # is bit-identical to the published version.
    svc = ContinuousService(cfg, eval_fn=prefers_a, publishers=publishers)
    svc.trainer.save_adapters(tmp_path / "resumed")
    from safetensors.torch import load_file

    resumed = load_file(str(tmp_path / "resumed" / "picker" / "adapter_model.safetensors"))
    published = load_file(str(svc.registry.path("picker", 2) / "adapter_model.safetensors"))
    assert resumed.keys() == published.keys()
    assert all(torch.equal(resumed[k], published[k]) for k in resumed)

    # Live episodes served by v2 earn far less than the training episodes of v1 did: roll back.
    for _ in range(4):
        store.add_episode(_episode("a", 0.0, version=2))
    row = svc.step()
    assert row["decision"] == "rollback", row
    assert row["versions"] == {"picker": 1}
    assert svc.registry.current("picker") == 1
    assert _served_version(server, "k") == 1
    assert svc.state.watch is None


def test_gate_refuses_a_worse_candidate(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, tiny_model_dir, gate_margin=0.0)
    store = TraceStore.open(cfg.store)
    # The recorded rewards favour "a", but the held-out evaluation penalises it: the trained
    # candidate is deliberately worse on what the gate measures.
    svc = ContinuousService(cfg, eval_fn=lambda adapters: -_logp_of("a", tiny_model_dir, adapters["picker"]))
    _fill(store, 12)
    row = svc.step()
    assert row["decision"] == "refuse", row
    assert row["candidate_score"] < row["live_score"]
    assert svc.registry.versions("picker") == [1]  # only the untrained baseline
    assert svc.registry.current("picker") == 1
    assert svc.state.pending == []


def test_service_cli_status_and_config_errors(tmp_path, tiny_model_dir):
    import subprocess
    import sys

    import yaml

    cfg = _config(tmp_path, tiny_model_dir)
    good = tmp_path / "service.yaml"
    good.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    TraceStore.open(cfg.store).add_episode(_episode("a", 1.0))

    def marft(*args):
        return subprocess.run([sys.executable, "-m", "marft_bridge", "service", *args], capture_output=True,
                              text=True, timeout=300)

    r = marft("--config", str(good), "--max-rounds", "1")  # one poll: below min_new_episodes, so it waits
    assert r.returncode == 0, r.stderr
    r = marft("status", "--config", str(good))
    assert r.returncode == 0, r.stderr
    status = json.loads(r.stdout)
    assert status["state"]["pending"] and status["versions"] == {"picker": None}

    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text() + "min_new_episodes: 0\n")
    r = marft("status", "--config", str(bad))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"marft: error: config {bad}: min_new_episodes: "
                                             "Input should be greater than or equal to 1"]


def _behaviour_episode(eid: str, text: str, reward: float, base_dir) -> Episode:
    """An episode whose action carries the base model's (= the v1 adapters') token ids and log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)["input_ids"]
    target = tok(text)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + target])).logits[0, len(prompt) - 1 : -1].float()
    logps = logits.log_softmax(-1).gather(-1, torch.tensor(target)[:, None])[:, 0].tolist()
    act = Action(agent="picker", observation=Observation(messages=[Message(**m) for m in PROMPT], prompt_token_ids=prompt),
                 output=Output(text=text, token_ids=target, logprobs=logps, finish_reason="stop"),
                 policy=Policy(name="picker", version=1))
    return Episode(id=eid, source="test", actions=[act], rewards=[Reward(value=reward, source="checker")])


@pytest.mark.parametrize("heldout_agrees", [True, False])
def test_recorded_heldout_episodes_gate_the_candidate(tmp_path, tiny_model_dir, heldout_agrees):
    """Without an evaluation function the gate replays held-out recorded episodes under the candidate
    (weighted importance sampling): it promotes when they reward what training rewarded, and refuses
    when they reward the opposite."""
    from marft_bridge.service import heldout

    cfg = _config(tmp_path, tiny_model_dir).model_copy(update={"heldout_fraction": 0.5})
    store = TraceStore.open(cfg.store)
    counts = {True: 0, False: 0}
    for i in range(200):
        eid = f"ep{i}"
        held = heldout(eid, 0.5)
        if counts[held] >= 12:
            continue
        text = "a" if counts[held] % 2 == 0 else "b"
        counts[held] += 1
        good = text == "a" if (not held or heldout_agrees) else text == "b"
        store.add_episode(_behaviour_episode(eid, text, float(good), tiny_model_dir))
    assert counts == {True: 12, False: 12}
    svc = ContinuousService(cfg)
    row = svc.step()
    assert row["live_score"] == 0.5  # half the held-out episodes earned 1
    if heldout_agrees:
        assert row["decision"] == "promote" and row["candidate_score"] > 0.5
    else:
        assert row["decision"] == "refuse" and row["candidate_score"] < 0.5


def _pair_episode(first: str, reward: float, versions: dict[str, int | None]) -> Episode:
    """``first`` answers the prompt; ``second`` reads its answer and repeats it."""
    a = Action(agent="first", observation=Observation(messages=[Message(**m) for m in PROMPT]),
               output=Output(text=first, finish_reason="stop"), policy=Policy(name="first", version=versions["first"]))
    msgs = PROMPT + [{"role": "user", "content": f"repeat {first}"}]
    b = Action(agent="second", step=1, observation=Observation(messages=[Message(**m) for m in msgs]),
               output=Output(text=first, finish_reason="stop"), depends_on=[a.id],
               policy=Policy(name="second", version=versions["second"]))
    return Episode(source="test", actions=[a, b], rewards=[Reward(value=reward, source="checker")])


def _fill_pairs(store, n: int, versions: dict[str, int | None]) -> None:
    for i in range(n):
        store.add_episode(_pair_episode("a" if i % 2 == 0 else "b", float(i % 2 == 0), versions))


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rerollout_config(tmp_path, base) -> ServiceConfig:
    cfg = _config(tmp_path, base).model_copy(update={"agents": ["first", "second"]})
    cfg.trainer = cfg.trainer.model_copy(update={"update_scheme": "rerollout"})
    return cfg


def _prefers_candidate(adapters) -> float:  # every candidate passes the gate
    return float("candidate" in str(adapters["first"]))


def test_rerollout_service_trains_one_agent_per_round_on_episodes_its_predecessor_played(tmp_path, tiny_model_dir):
    """``update_scheme: rerollout`` in the service: each round updates the next agent in the update order
    alone, on episodes every live version played (the previous agent's new adapter included), and
    publishes only that agent; episodes played by a replaced version are dropped, not trained on."""
    cfg = _rerollout_config(tmp_path, tiny_model_dir)
    store = TraceStore.open(cfg.store)
    svc = ContinuousService(cfg, eval_fn=_prefers_candidate)
    _fill_pairs(store, 12, {"first": None, "second": None})  # before the service: no version recorded
    row = svc.step()
    assert row["decision"] == "promote", row
    assert row["rerollout"] == {"agent": "first", "stage": 0, "order": ["first", "second"], "stale_dropped": 0}
    assert row["versions"] == {"first": 2}
    assert svc.registry.versions("first") == [1, 2] and svc.registry.versions("second") == [1]
    reg = svc.registry
    trained = tmp_path / "after1"
    svc.trainer.save_adapters(trained)
    assert _same(_weights(trained / "second"), _weights(reg.path("second", 1)))  # not updated
    assert not _same(_weights(trained / "first"), _weights(reg.path("first", 1)))

    # Traffic during the swap: 8 episodes still played by first v1 (stale), 8 by first v2: too few fresh.
    _fill_pairs(store, 8, {"first": 1, "second": 1})
    _fill_pairs(store, 8, {"first": 2, "second": 1})
    assert svc.step() == {"decision": "wait", "pending": 8, "stale": 8}
    _fill_pairs(store, 4, {"first": 2, "second": 1})
    row = svc.step()
    assert row["decision"] == "promote", row
    assert row["rerollout"]["agent"] == "second" and row["rerollout"]["stage"] == 1 and row["episodes"] == 12
    assert row["versions"] == {"second": 2}
    assert reg.versions("first") == [1, 2] and reg.current("second") == 2
    svc.trainer.save_adapters(tmp_path / "after2")
    assert _same(_weights(tmp_path / "after2" / "first"), _weights(reg.path("first", 2)))  # not updated again
    assert _same(_weights(tmp_path / "after2" / "second"), _weights(reg.path("second", 2)))
    assert svc.state.stage == 0  # the next round starts a new cycle


class _Killed(BaseException):
    """Stands for a kill -9 at that point: nothing after it runs."""


def test_rerollout_round_killed_while_publishing_resumes_once(tmp_path, tiny_model_dir, monkeypatch):
    """A rerollout round killed while publishing: the restart finishes it (only its agent published)
    and the cycle moves on to the next agent exactly once."""
    cfg = _rerollout_config(tmp_path, tiny_model_dir)
    _fill_pairs(TraceStore.open(cfg.store), 12, {"first": None, "second": None})
    real = ContinuousService.promote

    def killed_in_the_round(self, adapters_dir, metrics, agents=None, **kw):
        if metrics:  # the round's promotion (the baseline's has no metrics)
            raise _Killed
        return real(self, adapters_dir, metrics, agents, **kw)

    monkeypatch.setattr(ContinuousService, "promote", killed_in_the_round)
    with pytest.raises(_Killed):
        ContinuousService(cfg, eval_fn=_prefers_candidate).step()
    monkeypatch.setattr(ContinuousService, "promote", real)
    svc = ContinuousService(cfg, eval_fn=_prefers_candidate)
    row = svc.step()
    assert row["decision"] == "promote" and row["versions"] == {"first": 2}, row
    assert (svc.state.order, svc.state.stage) == (["first", "second"], 1)
    assert svc.registry.versions("second") == [1]
    decisions = [json.loads(x)["decision"] for x in (tmp_path / "svc" / "decisions.jsonl").read_text().splitlines()]
    assert decisions == ["baseline", "resume", "promote"]


def test_a_bad_trainer_option_in_the_service_yaml_fails_at_load_naming_the_field(tmp_path):
    # ServiceConfig.trainer is a MarftConfig: a typo is refused when the file is read, not rounds later.
    path = tmp_path / "service.yaml"
    path.write_text("base_model: /models/base\nagents: [planner]\ntrainer:\n  advantage: gpro\n  lr: 1.0e-5\n")
    with pytest.raises(MarftError, match=r"trainer\.advantage: Input should be 'gae', 'grpo', 'rloo' or 'reward'"):
        ServiceConfig.from_yaml(path)
    path.write_text("base_model: /models/base\nagents: [planner]\ntrainer:\n  lr: 1.0e-5\n  ppo_epoch: 2\n")
    with pytest.raises(MarftError, match=r"trainer\.ppo_epoch: Extra inputs are not permitted"):
        ServiceConfig.from_yaml(path)
    path.write_text("base_model: /models/base\nagents: [planner]\ntrainer:\n  lr: 1.0e-5\n")
    assert ServiceConfig.from_yaml(path).trainer.lr == 1.0e-5
