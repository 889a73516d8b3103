"""examples/tool_agents/run.py end to end at toy size: a langgraph-supervisor app with real tools is
captured (tool steps, handoffs, D), warm-started from its own captured demonstrations, served by
``marft serve``, trained by one MARFT update from the store and hot-swapped (the next run records v2)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("langgraph_supervisor")

from marft_bridge.schema import adapter_name  # noqa: E402
from marft_bridge.serving import AdapterRegistry  # noqa: E402
from marft_bridge.store import TraceStore  # noqa: E402

RUN = Path(__file__).resolve().parents[1] / "examples" / "tool_agents" / "run.py"


def test_tool_agents_example_runs_the_whole_loop(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("tool_agents_run", RUN)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    assert run.main(["--out", str(tmp_path), "--warm-steps", "2", "--episodes", "2"]) == 0
    printed = capsys.readouterr().out

    # The scripted demonstrations: every model call, tool call and handoff, with exact edges.
    demo = list(TraceStore.open(tmp_path / "demos.db").episodes())[-1]
    acts = demo.actions
    assert [(a.agent, a.kind) for a in acts] == [
        ("supervisor/agent", "llm"), ("supervisor/agent", "tool"),   # the handoff transfer_to_math_expert
        ("math_expert/agent", "llm"), ("math_expert/agent", "tool"),  # add / multiply
        ("math_expert/agent", "llm"), ("supervisor/agent", "llm")]
    idx = {a.id: i for i, a in enumerate(acts)}
    assert [sorted(idx[d] for d in a.depends_on) for a in acts] == [[], [0], [0, 1], [2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
    handoff, call = acts[1], acts[3]
    assert (handoff.metadata["tool.name"], handoff.metadata["handoff.goto"]) == ("transfer_to_math_expert", "math_expert")
    assert handoff.output.text == "Successfully transferred to math_expert"
    assert handoff.metadata["tool_call_id"] == acts[0].output.tool_calls[0]["id"]
    op, a, b = demo.task["messages"][0]["content"][1], *map(int, demo.task["messages"][0]["content"][::2][:2])
    assert call.metadata["tool.name"] == {"+": "add", "*": "multiply"}[op] and call.metadata["tool.arguments"] == {"a": a, "b": b}
    assert call.output.text == str(a + b if op == "+" else a * b)
    # the demonstrations carry no adapter version: the names count as adapters where they are ours
    assert [adapter_name(a, {"supervisor", "math_expert"}) for a in acts if a.kind == "llm"] == [
        "supervisor", "math_expert", "math_expert", "supervisor"]
    assert "warm start: 96 (observation, action) pairs from 24 captured demonstrations; skipped none" in printed

    # Served, trained from the store (every model call a sample), swapped: the next run is v2.
    reg = AdapterRegistry(tmp_path / "registry")
    assert {a: reg.versions(a) for a in ("supervisor", "math_expert")} == {"supervisor": [1, 2], "math_expert": [1, 2]}
    assert {a: reg.current(a) for a in ("supervisor", "math_expert")} == {"supervisor": 2, "math_expert": 2}
    served = list(TraceStore.open(tmp_path / "traces.db").episodes())
    calls = sum(a.kind == "llm" for ep in served[:-1] for a in ep.actions)
    assert f"{calls} model calls" in printed and f"{calls} training samples (skipped none)" in printed
    assert {a.policy.version for a in served[-1].actions if a.kind == "llm"} == {2}
