"""``marft fit --algorithm expert_iteration`` on the embedded server with a tiny model built in-process:
which rollouts are kept (checked by hand for a fixed reward pattern), that the update learned from
exactly those (replayed from the published versions), that an agent with nothing kept keeps its
adapter, and one version per agent per iteration."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import TypedDict

import pytest

pytest.importorskip("torch")
pytest.importorskip("langgraph")

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "fit_quickstart"
SEED, ITERATIONS, K, G = 0, 2, 2, 2
LR = 5e-3


class State(TypedDict, total=False):
    question: str
    answer: int
    plan: str
    solution: str
    seed: int  # the rollout's sampling seed: the reward reads the rollout index from it


def build_app(endpoint):
    """The quickstart's planner -> solver graph, that also reports its rollout's seed."""
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    def model(agent):
        return ChatOpenAI(model=endpoint.model(agent), base_url=endpoint.base_url, api_key=endpoint.api_key,
                          temperature=0.7, max_tokens=12)

    planner, solver = model("planner"), model("solver")

    def plan(state):
        reply = planner.invoke([("user", state["question"])], seed=endpoint.seed)
        return {"plan": reply.content, "seed": endpoint.seed}

    def solve(state):
        reply = solver.invoke([("user", f"{state['question']} {state['plan']}")], seed=endpoint.seed + 1)
        return {"solution": reply.content}

    g = StateGraph(State)
    g.add_node("planner", plan)
    g.add_node("solver", solve)
    g.add_edge(START, "planner")
    g.add_edge("planner", "solver")
    g.add_edge("solver", END)
    return g.compile()


def rollout_zero_seeds() -> set[int]:
    from marft_bridge.fitting.tasks import rollout_seed

    return {rollout_seed(SEED, it, k, 0, G) for it in range(1, ITERATIONS + 1) for k in range(K)}


def reward(task, output):
    """The planner is rewarded on rollout 0 of each task only; the solver never (so it keeps nothing)."""
    return {"planner": 1.0 if output.get("seed") in rollout_zero_seeds() else 0.0, "solver": 0.0}


@pytest.fixture(scope="module")
def ei_run(tiny_model_dir, tmp_path_factory):
    from rich.console import Console

    from marft_bridge.fitting import fit

    tmp = tmp_path_factory.mktemp("fitei")
    val = tmp / "val.jsonl"
    val.write_text("".join((QUICKSTART / "val.jsonl").read_text().splitlines(keepends=True)[:2]))
    buf = io.StringIO()
    results = fit(build_app, QUICKSTART / "tasks.jsonl", reward, tiny_model_dir, ["planner", "solver"], tmp / "out",
                  val=val, iterations=ITERATIONS, tasks_per_iteration=K, group_size=G, concurrency=4, seed=SEED,
                  algorithm="expert_iteration", top_k_per_group=1, min_reward=0.5, sft_lr=LR, progress=False,
                  console=Console(file=buf, width=400))
    return results, tmp / "out", buf.getvalue()


def test_one_version_per_agent_per_iteration_and_the_kept_count(ei_run):
    from marft_bridge.serving import AdapterRegistry

    results, out, printed = ei_run
    rows = results["iterations"]
    assert [r["versions"] for r in rows] == [{"planner": v, "solver": v} for v in (1, 2, 3)]
    reg = AdapterRegistry(out / "registry")
    for agent in ("planner", "solver"):
        assert reg.versions(agent) == [1, 2, 3]
        assert len({reg.manifest(agent, v).round_id for v in (1, 2, 3)}) == 3
    for r in rows[1:]:
        m = r["metrics"]
        # by hand: 2 tasks x 2 rollouts; the planner keeps rollout 0 of each task, the solver nothing
        assert (m["algorithm"], m["rollouts"], m["kept_rollouts"]) == ("expert_iteration", 4, 2)
        assert m["kept_actions"] == {"planner": 2, "solver": 0}
        assert set(m["sft_loss"]) == {"planner"}
        assert f"iter {r['iteration']}/{ITERATIONS}: " in printed
    assert printed.count("kept 2/4 rollouts") == ITERATIONS
    # the solver had no kept action: its adapter is the untrained one at every version; the planner's moved
    assert len({reg.manifest("solver", v).sha256 for v in (1, 2, 3)}) == 1
    assert len({reg.manifest("planner", v).sha256 for v in (1, 2, 3)}) == 3


def _replay(tiny_model_dir, out: Path, tmp: Path, iteration: int, keep_rollouts: set[int]) -> dict:
    """Iteration ``iteration``'s SFT step redone by hand from the version it started from, on the
    planner actions of the rollouts in ``keep_rollouts``; the planner's new weights."""
    from safetensors.torch import load_file

    from marft_bridge.fitting.settings import FitSettings, marft_config
    from marft_bridge.fitting.tasks import iteration_tasks, read_tasks
    from marft_bridge.serving import AdapterRegistry
    from marft_bridge.store import TraceStore
    from marft_bridge.trainers.batch import trained_name
    from marft_bridge.trainers.marft import MarftTrainer
    from marft_bridge.trainers.supervised import SftConfig, sft_in_place

    reg = AdapterRegistry(out / "registry")
    start = tmp / f"start{iteration}"
    for agent in ("planner", "solver"):
        shutil.copytree(reg.path(agent, iteration), start / agent, dirs_exist_ok=True)
    s = FitSettings(app="x:y", tasks=QUICKSTART / "tasks.jsonl", reward="x:y", base_model=tiny_model_dir,
                    agents=["planner", "solver"], out=tmp, seed=SEED, algorithm="expert_iteration", top_k_per_group=1)
    trainer = MarftTrainer(marft_config(s).model_copy(update={"init_adapters": str(start)}), tiny_model_dir,
                           agents=["planner", "solver"])
    # the iteration's episodes in the order fit played them: task slot, then rollout index
    slots = {t.id: k for k, t in enumerate(iteration_tasks(read_tasks(QUICKSTART / "tasks.jsonl"), iteration, K,
                                                           SEED))}
    store = TraceStore.open(out / "traces.db")
    eps = [e for e in store.episodes() if e.metadata["fit"]["split"] == "train"
           and e.metadata["fit"]["iteration"] == iteration]
    store.close()
    eps.sort(key=lambda e: (slots[e.group.task_id], e.group.rollout))
    assert len(eps) == K * G
    seed = [r for r in json.loads((out / "results.json").read_text())["iterations"]
            if r["iteration"] == iteration][0]["metrics"]["sft_seed"]
    step = sft_in_place(trainer.policy, eps, config=trainer.config,
                        options=SftConfig(epochs=1, lr=LR, val_fraction=0.0, seed=seed),
                        base_names=trainer.base_names, name_of=lambda a: trained_name(a, {"planner", "solver"}),
                        keep=lambda ep, a: ep.group.rollout in keep_rollouts and a.agent == "planner")
    assert step["actions"]["solver"] == 0
    trainer.save_adapters(tmp / f"replay{iteration}-{sorted(keep_rollouts)}")
    return load_file(tmp / f"replay{iteration}-{sorted(keep_rollouts)}" / "planner" / "adapter_model.safetensors")


def test_the_update_learned_from_the_kept_rollouts_only(ei_run, tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file

    from marft_bridge.serving import AdapterRegistry

    _, out, _ = ei_run
    reg = AdapterRegistry(out / "registry")
    for it in range(1, ITERATIONS + 1):
        published = load_file(reg.path("planner", it + 1) / "adapter_model.safetensors")
        kept = _replay(tiny_model_dir, out, tmp_path, it, {0})  # what the hand-check says was kept
        assert set(kept) == set(published)
        assert all(torch.equal(kept[n], published[n]) for n in kept)
        if it == 1:  # the same step on every rollout's planner actions lands elsewhere: the test can fail
            every = _replay(tiny_model_dir, out, tmp_path, it, {0, 1})
            assert not all(torch.equal(every[n], published[n]) for n in every)


def _outcome(task: str, rollout: int, rewards: dict, status: str = "ok"):
    ep = SimpleNamespace(id=f"{task}/{rollout}", actions=[SimpleNamespace(kind="llm", agent=a) for a in ("p", "s")],
                         rewards=[SimpleNamespace(value=v, agent=a, action_id=None) for a, v in rewards.items()])
    return SimpleNamespace(status=status, episode=ep, task=SimpleNamespace(id=task), rollout=rollout)


def test_selection_per_group_and_agent_by_hand():
    from marft_bridge.fitting.expert import select

    outs = [_outcome("t1", 0, {None: 0.2}), _outcome("t1", 1, {None: 0.9}), _outcome("t1", 2, {None: 0.9}),
            _outcome("t1", 3, {None: 1.0}, status="failed"),
            _outcome("t2", 0, {"p": 0.7, "s": 0.1}), _outcome("t2", 1, {"p": 0.3, "s": 0.6})]
    # top 1 per group and agent: t1 ties at 0.9 -> the lower rollout; t2: each agent its own best
    assert select(outs, 1, None) == {("t1/1", "p"), ("t1/1", "s"), ("t2/0", "p"), ("t2/1", "s")}
    assert select(outs, 2, 0.5) == {("t1/1", "p"), ("t1/1", "s"), ("t1/2", "p"), ("t1/2", "s"),
                                     ("t2/0", "p"), ("t2/1", "s")}
    assert select(outs, None, 0.65) == {("t1/1", "p"), ("t1/1", "s"), ("t1/2", "p"), ("t1/2", "s"), ("t2/0", "p")}
    assert select(outs, None, 2.0) == set()


def test_options_are_checked_before_anything_starts(tmp_path, tiny_model_dir):
    from marft_bridge.errors import MarftError
    from marft_bridge.fitting import fit

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"question": "1+2"}\n')
    with pytest.raises(MarftError, match="expert_iteration needs --min-reward R or --top-k-per-group K"):
        fit(build_app, tasks, reward, tiny_model_dir, ["planner"], tmp_path / "out", algorithm="expert_iteration")
    with pytest.raises(MarftError, match="pass --algorithm expert_iteration"):
        fit(build_app, tasks, reward, tiny_model_dir, ["planner"], tmp_path / "out", min_reward=1.0)
    assert not (tmp_path / "out").exists()


def test_help_documents_the_flags(capsys):
    import argparse

    from marft_bridge.fitting.cli import add_commands

    parser = argparse.ArgumentParser(prog="marft")
    add_commands(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit):
        parser.parse_args(["fit", "--help"])
    text = capsys.readouterr().out
    for flag in ("--algorithm {ppo,expert_iteration}", "--min-reward R", "--top-k-per-group K", "--sft-epochs",
                 "--sft-lr"):
        assert flag in text
