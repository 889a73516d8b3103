"""What the record limits cost and what they bound, measured side by side in one run.

1. What the store does to each episode before its transaction (validate it, serialize its rows),
   without the limits, with them checked field by field by the record model (what validation
   without a store does), and with them judged as the store judges them (on the rows' JSON, which
   it writes anyway; field by field only for what that does not clear), in one process, fastest of
   many interleaved rounds, CPU time: the 3-action episode ``capture_profile.py`` captures, an
   8-action tool-calling one (metadata and tool calls on every action), and the same offered six
   tools on every call (``Observation.tools``, as a tool-calling agent's calls record them).
2. Peak resident memory of ``marft traces import`` (its own process) on a JSONL file holding one
   huge line between two small episodes, with the default record limit and with a 1 MiB one,
   beside the same import without the huge line.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/record_limits.py [--line-mb 300]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path


def tool_episode() -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "cats"}'}}
    msgs = [{"role": "system", "content": "You plan." * 20}, {"role": "user", "content": "What are cats?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "cats are mammals", "tool_call_id": "c1"}]
    acts = [{"id": f"a{k}", "agent": "planner" if k % 2 else "coder", "step": k, "observation": {"messages": msgs},
             "output": {"text": "x" * 200, "token_ids": list(range(64)), "logprobs": [-0.5] * 64, "tool_calls": [call]},
             "depends_on": [f"a{k - 1}"] if k else [], "metadata": {"langgraph_node": "plan", "langgraph_step": k}}
            for k in range(8)]
    return {"id": "e", "task": {"messages": [{"role": "user", "content": "hi"}]}, "actions": acts,
            "metadata": {"thread_id": "t"}}


def with_tools(data: dict, n: int = 6) -> dict:
    """``data`` with ``n`` function tools (JSON-schema parameters) offered to every action."""
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Looks something up. " * 4,
              "parameters": {"type": "object", "required": ["q"], "properties": {
                  "q": {"type": "string", "description": "what to look for"}, "n": {"type": "integer"},
                  "tags": {"type": "array", "items": {"type": "string"}}}}}} for i in range(n)]
    for a in data["actions"]:
        a.setdefault("observation", {})["tools"] = tools
    return data


def validation() -> None:
    import marft_bridge as mb
    from capture_profile import Keep, build_app
    from marft_bridge.limits import RecordLimits
    from marft_bridge.schema import parse_episode
    from marft_bridge.store.rows import episode_rows

    kept = Keep()
    app = mb.instrument(build_app(), store=kept)
    app.invoke({"question": "what is 2 + 2?"})
    mb.uninstrument(app)
    limits = RecordLimits()
    ways = {  # one episode as the store prepares it: validated, then its rows serialized
        "off": lambda d: episode_rows(parse_episode(d, check_fields=False)),
        "field by field": lambda d: episode_rows(parse_episode(d, limits=limits)),  # the record model's check
        "on the rows": lambda d: episode_rows(parse_episode(d, limits=limits, check_fields=False), limits=limits),
    }
    episodes = (("captured 3-action episode", kept.last), ("8-action tool-calling episode", tool_episode()),
                ("the same, six tools offered", with_tools(tool_episode())))
    for name, data in episodes:
        assert ways["on the rows"](data).fields_within  # the store takes it without a second validation
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(30):  # interleaved: load on the shared machine falls on every way alike
            for way, fn in ways.items():
                t = timeit.timeit(lambda: fn(data), number=100, timer=time.thread_time) / 100
                best[way] = min(best[way], t)
        off = best["off"]
        print(f"{name}: without limits {off * 1e6:.1f} us; field by field {best['field by field'] * 1e6:.1f} us "
              f"(+{(best['field by field'] - off) * 1e6:.1f}); on the rows {best['on the rows'] * 1e6:.1f} us "
              f"(+{(best['on the rows'] - off) * 1e6:.1f}, x{best['on the rows'] / off:.3f})")


def peak_import_kb(src: Path, env: dict) -> tuple[int, str]:
    """Peak resident KB of ``marft traces import src`` in a process of its own, and its summary line."""
    with tempfile.TemporaryDirectory() as d:
        code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); print(r.stdout.splitlines()[0])")
        out = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "marft_bridge", "traces", "import",
                              str(src), "--store", str(Path(d) / "t.db")], capture_output=True, text=True, env=env,
                             check=True).stdout.splitlines()
    return int(out[0]), out[1]


def import_memory(line_mb: int) -> None:
    small = json.dumps({"id": "ok1", "actions": [{"agent": "a"}]}), json.dumps({"id": "ok2", "actions": [{"agent": "a"}]})
    with tempfile.TemporaryDirectory() as d:
        plain, huge = Path(d) / "plain.jsonl", Path(d) / "huge.jsonl"
        plain.write_text("\n".join(small) + "\n")
        with open(huge, "w") as f:
            f.write(small[0] + "\n" + '{"id": "huge", "task": "')
            for _ in range(line_mb):
                f.write("x" * 2**20)
            f.write('"}\n' + small[1] + "\n")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        base, _ = peak_import_kb(plain, env)
        print(f"import of 2 small episodes: peak {base / 1024:.0f} MiB")
        for label, extra in (("default record limit (64 MiB)", {}), ("1 MiB record limit", {"MARFT_MAX_RECORD_BYTES": "1048576"})):
            kb, summary = peak_import_kb(huge, {**env, **extra})
            print(f"import with a {line_mb} MB line, {label}: peak {kb / 1024:.0f} MiB = {kb / base:.2f} x the small "
                  f"import; {summary.split(': ', 1)[1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--line-mb", type=int, default=300, help="size of the huge JSONL line in MB (default 300)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    validation()
    import_memory(args.line_mb)


if __name__ == "__main__":
    main()
