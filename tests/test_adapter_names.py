"""Agent -> adapter for path-named agents (supervisor / swarm subgraphs): the adapter an action trains is
the model name that served it, else a registry-safe form of the agent path; ``marft train`` and
``marft adapters`` accept the same names and mapping."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_trainer_tools_batch import supervisor_episode

from marft_bridge.cli import main as marft
from marft_bridge.errors import MarftError
from marft_bridge.schema import (ADAPTER_NAME, Action, Policy, adapter_name, adapters_by_agent, agent_adapter_name,
                                 resolve_adapters)
from marft_bridge.serving import registry
from marft_bridge.serving.fixtures import make_random_adapter


def test_the_registry_and_the_records_agree_on_adapter_names():
    assert ADAPTER_NAME.pattern == registry.AGENT_NAME.pattern


@pytest.mark.parametrize("agent, name", [
    ("supervisor/agent", "supervisor.agent"), ("math_expert/agent", "math_expert.agent"), ("planner", "planner"),
    ("team a/sub:graph/agent", "team_a.sub_graph.agent"), ("a//b", "a.b"), ("_tools/x", "tools.x"), ("/", "agent"),
    ("a/../b", "a.b"),
])
def test_agent_paths_map_to_registry_safe_names(agent, name):
    assert agent_adapter_name(agent) == name
    assert registry.check_agent_name(name) == name


@given(st.text(min_size=1, max_size=200))
def test_every_agent_name_maps_to_a_name_the_registry_accepts(agent):
    registry.check_agent_name(agent_adapter_name(agent))


def test_long_paths_stay_distinct():
    a, b = "x" * 80 + "/one", "x" * 80 + "/two"
    assert agent_adapter_name(a) != agent_adapter_name(b) and len(agent_adapter_name(a)) <= 64


def test_the_adapter_is_the_model_name_that_served_the_call():
    # Our server reported the adapter's version: the model name is the adapter.
    assert adapter_name(Action(agent="supervisor/agent", policy=Policy(name="supervisor", version=2))) == "supervisor"
    # No mark of our stack: the agent's own adapter, unless the caller knows the name as one of its adapters.
    assert adapter_name(Action(agent="supervisor/agent", policy=Policy(name="supervisor"))) == "supervisor.agent"
    assert adapter_name(Action(agent="supervisor/agent", policy=Policy(name="supervisor")), {"supervisor"}) == "supervisor"
    assert adapter_name(Action(agent="supervisor/agent")) == "supervisor.agent"
    # A base model id is not an adapter: the agent's own name is used.
    assert adapter_name(Action(agent="math_expert/agent", policy=Policy(name="Qwen/Qwen2.5-0.5B"))) == "math_expert.agent"


def test_agents_and_adapters_resolve_to_the_adapters_calls_used():
    known = adapters_by_agent([supervisor_episode()])
    assert known == {"supervisor/agent": ["supervisor"], "math_expert/agent": ["math_expert"],
                     "checker/agent": ["checker.agent"]}
    assert resolve_adapters(["supervisor/agent", "math_expert", "checker/agent"], known) == [
        "supervisor", "math_expert", "checker.agent"]
    assert resolve_adapters(["checker.agent", "supervisor"], known) == ["checker.agent", "supervisor"]
    with pytest.raises(MarftError) as e:
        resolve_adapters(["researcher"], known)
    assert str(e.value) == ("unknown agent or adapter 'researcher'; the episodes have adapters supervisor, math_expert, "
                            "checker.agent (agent (adapters): supervisor/agent (supervisor), math_expert/agent "
                            "(math_expert), checker/agent (checker.agent))")


def test_marft_train_trains_the_adapters_a_supervisor_used(tiny_model_dir, tmp_path, capsys):
    eps = tmp_path / "eps.jsonl"
    eps.write_text(supervisor_episode().to_json() + "\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("ppo_epochs: 1\nnum_minibatches: 1\nbatch_episodes: 1\n")
    out = tmp_path / "run"
    assert marft(["train", "--episodes", str(eps), "--base-model", str(tiny_model_dir), "--config", str(cfg),
                  "--out", str(out), "--iterations", "1", "--no-progress"]) == 0
    assert sorted(p.name for p in (out / "adapters").iterdir()) == ["checker.agent", "math_expert", "supervisor"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert (rows[-1]["samples"], rows[-1]["skipped"]) == (5, {})  # every model call of the episode
    # Agents given as paths are mapped; an unknown one is a clear error listing the adapters.
    assert marft(["train", "--episodes", str(eps), "--base-model", str(tiny_model_dir), "--config", str(cfg),
                  "--out", str(tmp_path / "run2"), "--iterations", "1", "--no-progress",
                  "--agents", "math_expert/agent"]) == 0
    assert sorted(p.name for p in (tmp_path / "run2" / "adapters").iterdir()) == ["math_expert"]
    assert "math_expert/agent -> math_expert" in capsys.readouterr().err
    assert marft(["train", "--episodes", str(eps), "--base-model", str(tiny_model_dir), "--out", str(tmp_path / "r3"),
                  "--agents", "researcher"]) == 1
    assert "unknown agent or adapter 'researcher'; the episodes have adapters supervisor" in capsys.readouterr().err


def test_marft_adapters_accepts_agent_paths(tiny_model_dir, tmp_path, capsys):
    src = make_random_adapter(tiny_model_dir, tmp_path / "ad" / "x", seed=1, rank=4)
    reg = str(tmp_path / "reg")
    assert marft(["adapters", "publish", "--registry", reg, "math_expert/agent", str(src), "--promote"]) == 0
    out = capsys.readouterr()
    assert "agent math_expert/agent -> adapter math_expert.agent" in out.err
    assert out.out.startswith("math_expert.agent v1 (current)")
    assert marft(["adapters", "list", "--registry", reg, "math_expert/agent", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["agent"] == "math_expert.agent"
    assert marft(["adapters", "promote", "--registry", reg, "supervisor/agent", "1"]) == 1
    assert ("unknown adapter 'supervisor/agent' (as an agent path: 'supervisor.agent'); "
            f"{tmp_path / 'reg'} has: math_expert.agent") in capsys.readouterr().err
    eps = tmp_path / "eps.jsonl"
    eps.write_text(supervisor_episode().to_json() + "\n")
    assert marft(["adapters", "map", "--registry", reg, "--episodes", str(eps)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "supervisor/agent -> supervisor (not in the registry)", "math_expert/agent -> math_expert (not in the registry)",
        "checker/agent -> checker.agent (not in the registry)"]


def test_marft_adapters_map_puts_a_hosted_models_calls_on_their_agents_adapters(tmp_path, capsys):
    from test_sft import team

    eps = tmp_path / "eps.jsonl"
    eps.write_text("".join(team(k, 1.0).to_json() + "\n" for k in range(3)))
    assert marft(["adapters", "map", "--registry", str(tmp_path / "reg"), "--episodes", str(eps)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "planner -> planner (not in the registry); 3 calls to gpt-4.1-mini, not one of our adapters: "
        "distil them with `marft sft`",
        "solver -> solver (not in the registry); 3 calls to gpt-4.1-mini, not one of our adapters: "
        "distil them with `marft sft`"]
