"""``fit`` expects failed rollouts: an app run that raises, one that passes --rollout-timeout and a reward
function that raises are each stored, excluded from the update and counted; the run goes on."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("langgraph")


def build_app(endpoint):
    """planner (a model call) -> gate: raises, hangs or passes depending on the task's ``mode``."""
    from typing import TypedDict

    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    class State(TypedDict, total=False):
        question: str
        mode: str
        plan: str

    planner = ChatOpenAI(model=endpoint.model("planner"), base_url=endpoint.base_url, api_key=endpoint.api_key,
                         max_tokens=8, temperature=0.7)

    async def plan(state: State) -> State:
        return {"plan": (await planner.ainvoke([("user", state["question"])], seed=endpoint.seed)).content}

    async def gate(state: State) -> State:
        if state["mode"] == "raise":
            raise RuntimeError("the tool is down")
        if state["mode"] == "hang":
            await asyncio.Event().wait()  # never set: only the timeout ends this run
        return {}

    g = StateGraph(State)
    g.add_node("planner", plan)
    g.add_node("gate", gate)
    g.add_edge(START, "planner")
    g.add_edge("planner", "gate")
    g.add_edge("gate", END)
    return g.compile()


async def reward(task, output):
    if task["mode"] == "bad_reward":
        raise ValueError("cannot score this one")
    return {"planner": 0.5}  # per agent


def test_failed_timed_out_and_unrewardable_rollouts_are_stored_excluded_and_counted(tmp_path, tiny_model_dir):
    from marft_bridge.fitting import fit
    from marft_bridge.store import TraceStore

    modes = ["ok", "raise", "hang", "bad_reward"]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"id": m, "question": "1+2*3", "mode": m}) + "\n"
                                                  for m in modes))
    (tmp_path / "val.jsonl").write_text(json.dumps({"id": "v", "question": "2*2+1", "mode": "ok"}) + "\n")
    out = tmp_path / "out"
    results = fit(build_app, tmp_path / "tasks.jsonl", reward, tiny_model_dir, ["planner"], out,
                  val=tmp_path / "val.jsonl", iterations=1, tasks_per_iteration=4, group_size=1, concurrency=4,
                  rollout_timeout=10, progress=False, config={"ppo_epochs": 1, "num_minibatches": 1})
    row = results["iterations"][1]
    assert row["counts"] == {"ok": 1, "failed": 1, "timeout": 1, "reward_error": 1, "invalid": 0}
    assert row["metrics"]["samples"] == 1  # the update saw the one good episode's planner action
    assert row["train_reward"] == 0.5 and row["versions"] == {"planner": 2}
    assert results["excluded"] == {"failed": 1, "timeout": 1, "reward_error": 1, "invalid": 0}

    store = TraceStore.open(out / "traces.db")
    by_task = {e.group.task_id: e for e in store.episodes() if e.metadata["fit"]["split"] == "train"}
    assert set(by_task) == set(modes)
    ok, raised, hung, unscored = (by_task[m] for m in modes)
    assert ok.status == "completed" and [(r.agent, r.value) for r in ok.rewards] == [("planner", 0.5)]
    assert raised.status == "failed" and "RuntimeError: the tool is down" in raised.metadata["fit"]["error"]
    assert hung.status == "failed" and hung.metadata["fit"]["outcome"] == "timeout"
    assert unscored.rewards == [] and "ValueError: cannot score this one" in unscored.metadata["fit"]["error"]
    for ep in (raised, hung, unscored):  # the capture kept what ran before the failure
        assert [a.agent for a in ep.actions if a.kind == "llm"] == ["planner"]


def test_an_embedded_server_too_slow_to_start_is_a_clear_error_and_leaves_nothing_running(tmp_path, tiny_model_dir):
    """--server-start-timeout: past it, the server is stopped and fit ends with MarftError naming the
    option (a tiny model cannot load in 10 ms)."""
    from marft_bridge.errors import MarftError
    from marft_bridge.fitting import fit

    for name in ("tasks", "val"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"id": name, "question": "1+2", "mode": "ok"}) + "\n")
    with pytest.raises(MarftError, match=r"did not become ready within 0 s.*--server-start-timeout") as e:
        fit(build_app, tmp_path / "tasks.jsonl", reward, tiny_model_dir, ["planner"], tmp_path / "out",
            val=tmp_path / "val.jsonl", iterations=1, tasks_per_iteration=1, group_size=1,
            server_start_timeout=0.01, progress=False)
    assert "loading the base model" in str(e.value)
    registry = str(tmp_path / "out" / "registry")  # in the server's command line: this test's server only
    assert [pid for pid in os.listdir("/proc") if pid.isdigit() and registry in _cmdline(pid)] == []


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""
