"""No policy-gradient step on another model's actions (admission.py): foreign actions are excluded
and counted in `marft train`, which says so in one line; ``allow_foreign`` keeps them. And
``--init-adapters`` / ``init_adapters`` start every agent from a directory of peft adapters."""

from __future__ import annotations

import json

import pytest

from marft_bridge.errors import MarftError
from marft_bridge.schema import Action, Observation, Output, Policy
from marft_bridge.trainers.admission import Admission, base_names, foreign_line
from marft_bridge.trainers.config import MarftConfig
from marft_bridge.trainers.marft import MarftTrainer
from marft_bridge.trainers.rollout import RolloutPolicy
from test_trainer import FAST, make_env, model_dir, same, weights  # noqa: F401 - model_dir is a fixture


def _hosted(action: Action, model: str = "gpt-4.1-mini") -> Action:
    """The same decision as a hosted API records it: text only, the model it named, no version."""
    return action.model_copy(update={"policy": Policy(name=model), "token_source": "retokenize",
                                     "observation": Observation(messages=action.observation.messages),
                                     "output": Output(text=action.output.text, finish_reason="stop")})


def test_what_counts_as_foreign():
    adm = Admission(frozenset({"planner"}), base_names("/models/qwen-0.5b", "Qwen/Qwen2.5-0.5B"), allow_foreign=False)
    text = Output(text="hi")
    assert adm.foreign(Action(agent="planner", policy=Policy(name="gpt-4.1-mini"), output=text))
    assert not adm.foreign(Action(agent="planner", policy=Policy(name="planner"), output=text))  # its adapter
    assert not adm.foreign(Action(agent="planner", output=text))  # nothing recorded says otherwise
    assert not adm.foreign(Action(agent="planner", policy=Policy(name="qwen-0.5b"), output=text))  # the base
    assert not adm.foreign(Action(agent="planner", policy=Policy(name="Qwen/Qwen2.5-0.5B"), output=text))
    # Token ids alone are no mark of ours (a teacher behind vLLM returns its own); a version our stack reported is.
    assert adm.foreign(Action(agent="planner", policy=Policy(name="teacher-70b"), output=Output(token_ids=[1])))
    assert not adm.foreign(Action(agent="planner", policy=Policy(name="planner-v", version=3), output=text))
    assert not Admission(adm.agents, adm.base_names).foreign(  # allow_foreign (the default of the bare rules)
        Action(agent="planner", policy=Policy(name="gpt-4.1-mini"), output=text))
    assert foreign_line({"gpt-4.1-mini": 412, "claude-x": 3}) == (
        "412 actions came from gpt-4.1-mini, 3 from claude-x; distil them with `marft sft` "
        "(allow_foreign: true trains on them anyway, biased)")
    assert foreign_line({}) is None


def test_marft_train_excludes_and_counts_foreign_actions(model_dir, tmp_path, capsys):  # noqa: F811
    from marft_bridge.cli import main
    from marft_bridge.trainers.plot import read_metrics

    tr = MarftTrainer(MarftConfig(**FAST), model_dir, agents=["a", "b"])
    ours = make_env()(RolloutPolicy(tr), 12, 3)
    mixed = [e.model_copy(update={"actions": [_hosted(e.actions[0]), e.actions[1]]}) for e in ours[8:]]
    jsonl = tmp_path / "eps.jsonl"
    jsonl.write_text("".join(e.model_dump_json() + "\n" for e in ours[:8] + mixed))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("ppo_epochs: 1\nnum_minibatches: 1\nbatch_episodes: 12\n")
    out = tmp_path / "run"
    assert main(["train", "--episodes", str(jsonl), "--base-model", str(model_dir), "--config", str(cfg),
                 "--out", str(out), "--iterations", "1", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "4 actions came from gpt-4.1-mini; distil them with `marft sft`" in " ".join(err.split())
    assert sorted(p.name for p in (out / "adapters").iterdir()) == ["a", "b"]  # no adapter named after it
    (row,) = read_metrics(out / "metrics.jsonl")
    assert row["skipped"] == {"foreign_policy": 4} and row["foreign_policy"] == {"gpt-4.1-mini": 4}
    assert row["samples"] == 12 * 2 - 4

    # allow_foreign: today's behaviour, every action trained (a's hosted calls by a's adapter).
    cfg.write_text(cfg.read_text() + "allow_foreign: true\n")
    assert main(["train", "--episodes", str(jsonl), "--base-model", str(model_dir), "--config", str(cfg),
                 "--out", str(tmp_path / "run2"), "--iterations", "1", "--no-progress"]) == 0
    assert "came from" not in capsys.readouterr().err
    (row,) = read_metrics(tmp_path / "run2" / "metrics.jsonl")
    assert row["skipped"] == {} and row["samples"] == 24 and "foreign_policy" not in row


def test_init_adapters_start_every_agent_from_a_directory(model_dir, tmp_path, capsys):  # noqa: F811
    from marft_bridge.cli import main

    small = dict(ppo_epochs=1, num_minibatches=1, lr=1e-2)  # the CLI's default LoRA targets below
    src = MarftTrainer(MarftConfig(**small), model_dir, agents=["a", "b"])
    src.train_on(make_env()(RolloutPolicy(src), 8, 1))
    src.save_adapters(tmp_path / "sft")
    fresh = MarftTrainer(MarftConfig(**small, seed=5), model_dir, agents=["a", "b"])
    assert not same(weights(fresh, "agent_a"), weights(src, "agent_a"))
    tr = MarftTrainer(MarftConfig(**small, seed=5, init_adapters=str(tmp_path / "sft")), model_dir, agents=["a", "b"])
    assert same(weights(tr, "agent_a"), weights(src, "agent_a")) and same(weights(tr, "b"), weights(src, "b"))

    eps = tmp_path / "eps.jsonl"
    eps.write_text("".join(e.model_dump_json() + "\n" for e in make_env()(RolloutPolicy(src), 4, 2)))
    args = ["train", "--episodes", str(eps), "--base-model", str(model_dir), "--iterations", "1", "--no-progress"]
    assert main(args + ["--out", str(tmp_path / "run"), "--init-adapters", str(tmp_path / "sft")]) == 0
    assert f"started from {tmp_path / 'sft'}" in " ".join(capsys.readouterr().err.split())
    state = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())
    assert state["config"]["init_adapters"] == str(tmp_path / "sft")
    # A directory without one of the agents is refused, naming what is missing.
    (tmp_path / "sft" / "b" / "adapter_model.safetensors").unlink()
    assert main(args + ["--out", str(tmp_path / "run2"), "--init-adapters", str(tmp_path / "sft")]) == 1
    assert "lacks b/adapter_model.safetensors (safetensors only" in capsys.readouterr().err
    with pytest.raises(MarftError, match="lacks b/adapter_model.safetensors"):
        MarftTrainer(MarftConfig(init_adapters=str(tmp_path / "sft")), model_dir, agents=["a", "b"])
