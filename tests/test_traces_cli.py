"""``marft traces`` through real subprocesses: every command, its output, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_store import make_episode

from marft_bridge.schema import Episode
from marft_bridge.store import TraceStore

MARFT = Path(sys.executable).parent / "marft"


def marft(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [str(MARFT)] if MARFT.exists() else [sys.executable, "-m", "marft_bridge"]
    full_env = {k: v for k, v in os.environ.items() if k != "MARFT_STORE"} | (env or {})
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120, env=full_env, cwd=cwd)


@pytest.fixture
def filled(store):
    store.add_episode(make_episode(0, source="langgraph"))
    store.add_episode(make_episode(1, source="mcp", agents=("solo",), n=1))
    store.add_reward("ep0", 1.0, source="checker")
    return store


def test_list_show_export_import_stats(filled, store_url, tmp_path):
    url = store_url
    r = marft("traces", "list", "--store", url)
    assert r.returncode == 0, r.stderr
    assert "2 of 2 episode(s)" in r.stdout
    assert r.stdout.index("ep1") < r.stdout.index("ep0")  # newest first
    assert "coder, planner" in r.stdout  # agents sorted

    r = marft("traces", "list", "--store", url, "--source", "mcp", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["id"], x["n_actions"], x["agents"]) for x in rows] == [("ep1", 1, ["solo"])]

    r = marft("traces", "show", "ep0", "--store", url)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for text in ("episode ep0", "0-a0", "0-a2", "dependency graph", "step 2", "<- #1 coder (step 1)", "team reward 1.0",
                 "checker"):
        assert text in out, text
    r = marft("traces", "show", "ep0", "--json", "--store", url)
    assert Episode.model_validate_json(r.stdout) == filled.get_episode("ep0")

    path = tmp_path / "all.parquet"
    r = marft("traces", "export", str(path), "--store", url, "--rewarded")
    assert (r.returncode, r.stdout.strip()) == (0, f"exported 1 episode(s) to {path}")
    copy_url = f"sqlite:///{tmp_path / 'copy.db'}"
    r = marft("traces", "import", str(path), "--store", copy_url)
    assert (r.returncode, r.stdout.strip()) == (0, f"imported {path}: 1 added, 0 refused")
    with TraceStore.open(copy_url) as copy:
        assert list(copy.episodes()) == [filled.get_episode("ep0")]

    r = marft("traces", "stats", "--store", url)
    assert r.returncode == 0, r.stderr
    assert "2 episode(s) (1 rewarded), 4 action(s), 1 reward(s), 0 dead letter(s)" in r.stdout
    assert "per agent" in r.stdout and "solo" in r.stdout
    r = marft("traces", "stats", "--json", "--store", url)
    s = json.loads(r.stdout)
    assert (s["episodes"], s["actions"], s["sources"]) == (2, 4, {"langgraph": 1, "mcp": 1})


def test_import_with_refusals_dead_letters_and_reward(tmp_path):
    db = tmp_path / "t.db"
    lines = [make_episode(0).model_dump_json(), "{nope", make_episode(1).model_dump_json()]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    r = marft("traces", "import", str(tmp_path / "in.jsonl"), env={"MARFT_STORE": str(db)})
    assert r.returncode == 1
    assert r.stdout.splitlines()[0] == f"imported {tmp_path / 'in.jsonl'}: 2 added, 1 refused"
    assert "refused in.jsonl line 2: malformed JSON" in r.stdout

    r = marft("traces", "dead-letters", "--store", str(db))
    assert r.returncode == 0 and "1 dead letter(s)" in r.stdout and "in.jsonl line 2" in r.stdout

    r = marft("traces", "reward", "ep1", "0.5", "--agent", "coder", "--store", str(db))
    assert r.returncode == 0, r.stderr
    with TraceStore.open(db) as s:
        (rw,) = s.get_episode("ep1").rewards
        assert (rw.value, rw.agent, rw.source) == (0.5, "coder", "user")

    r = marft("traces", "export", "-", "--store", str(db), "--agent", "coder", "--unrewarded")
    assert [json.loads(x)["id"] for x in r.stdout.splitlines()] == ["ep0"]


def test_default_store_is_dot_marft_in_the_working_directory(tmp_path):
    with TraceStore.open(tmp_path / ".marft" / "traces.db") as s:
        s.add_episode(make_episode(3))
    r = marft("traces", "list", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["id"] for x in r.stdout.splitlines()] == ["ep3"]


def test_errors_are_one_line_and_non_zero(tmp_path):
    db = tmp_path / "t.db"
    TraceStore.open(db).close()
    cases = [
        (["traces", "show", "zz", "--store", str(db)], "marft: error: episode 'zz' is not in the store"),
        (["traces", "list", "--since", "last tuesday", "--store", str(db)], "marft: error: --since 'last tuesday': "),
        (["traces", "import", str(tmp_path / "none.jsonl"), "--store", str(db)], "marft: error: no such file: "),
        (["traces", "reward", "zz", "1", "--store", str(db)],
         "marft: error: episode zz: no such episode in the store"),
        (["traces", "stats", "--store", "mysql+nodriver://x/y"], "marft: error: cannot use store URL"),
        (["traces", "list", "--store", str(tmp_path / "typo.db")], "marft: error: no trace store at "),
    ]
    for args, start in cases:
        r = marft(*args)
        assert r.returncode == 1, args
        assert r.stderr.startswith(start), (args, r.stderr)
        assert r.stderr.count("\n") == 1, r.stderr  # one line, no traceback
    assert not (tmp_path / "typo.db").exists()


def test_help_explains_every_action():
    r = marft("traces", "--help")
    assert r.returncode == 0
    for action in ("list", "show", "export", "import", "stats", "dead-letters", "reward"):
        assert action in r.stdout
    r = marft("traces", "export", "--help")
    assert "--format" in r.stdout and "--since" in r.stdout and "Lossless" in r.stdout


def test_show_prints_tool_calls_and_tool_steps(tmp_path):
    from marft_bridge.schema import Action, Message, Observation, Output, Policy

    def call(cid, name, args):
        return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}

    add, hand = call("call_1", "add", {"a": 2, "b": 3}), call("call_h", "transfer_to_math_expert", {})
    bad = call("call_2", "add", {"a": "x"})
    acts = [
        Action(id="s1", agent="supervisor/agent", policy=Policy(name="supervisor"),
               output=Output(text="", tool_calls=[hand], finish_reason="tool_calls")),
        # the shape tool steps are recorded in (LangGraph ToolNode, MCP): the call in the observation
        Action(id="h1", agent="supervisor/agent", step=1, kind="tool", depends_on=["s1"],
               observation=Observation(messages=[Message(role="assistant", tool_calls=[hand])]),
               output=Output(text="Successfully transferred to math_expert"),
               metadata={"tool.name": "transfer_to_math_expert", "handoff.goto": "math_expert"}),
        Action(id="w1", agent="math_expert/agent", step=2, depends_on=["h1"],
               output=Output(text="Adding.", tool_calls=[add, bad], finish_reason="tool_calls")),
        Action(id="t1", agent="math_expert/agent", step=3, kind="tool", depends_on=["w1"],
               observation=Observation(messages=[Message(role="assistant", tool_calls=[add])]), output=Output(text="5")),
        Action(id="t2", agent="math_expert/agent", step=3, kind="tool", depends_on=["w1"],
               observation=Observation(messages=[Message(role="assistant", tool_calls=[bad])]),
               error="ValueError: not a number"),
    ]
    db = tmp_path / "t.db"
    with TraceStore.open(db) as s:
        s.add_episode(Episode(id="sup", actions=acts))
    r = marft("traces", "show", "sup", "--store", str(db), env={"COLUMNS": "400"})
    assert r.returncode == 0, r.stderr
    rows = {line.split("│")[2].strip(): line.split("│")[-2].strip() for line in r.stdout.splitlines()
            if line.count("│") > 8 and line.split("│")[2].strip() in {"s1", "h1", "w1", "t1", "t2"}}
    assert rows == {
        "s1": "-> transfer_to_math_expert()",
        "h1": "transfer_to_math_expert() = Successfully transferred to math_expert (handoff -> math_expert)",
        "w1": 'Adding. -> add(a=2, b=3), add(a="x")',
        "t1": "add(a=2, b=3) = 5",
        "t2": 'add(a="x") ! error: ValueError: not a number',
    }
    # The dependency graph names each tool step's tool.
    assert "#1 supervisor/agent (tool transfer_to_math_expert)" in r.stdout
    assert "#3 math_expert/agent (tool add)" in r.stdout and "#2 math_expert/agent (llm)" in r.stdout
