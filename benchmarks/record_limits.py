"""What the record limits cost and what they bound, measured side by side in one run.

1. Validation with the limits checked against validation without them (``{"limits": None}``, what
   store reads use), in one process, fastest of many rounds: the 3-action episode
   ``capture_profile.py`` captures, and an 8-action tool-calling one (metadata and tool calls on
   every action).
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


def validation() -> None:
    import marft_bridge as mb
    from capture_profile import Keep, build_app
    from marft_bridge.limits import RecordLimits
    from marft_bridge.schema import Episode

    kept = Keep()
    app = mb.instrument(build_app(), store=kept)
    app.invoke({"question": "what is 2 + 2?"})
    mb.uninstrument(app)
    limits = RecordLimits()
    for name, data in (("captured 3-action episode", kept.last), ("8-action tool-calling episode", tool_episode())):
        times = {}
        for key, ctx in (("off", {"limits": None}), ("on", {"limits": limits})):
            times[key] = min(timeit.repeat(lambda: Episode.model_validate(data, context=ctx), number=200, repeat=30)) / 200
        print(f"validate {name}: limits off {times['off'] * 1e6:.1f} us, on {times['on'] * 1e6:.1f} us "
              f"(+{(times['on'] - times['off']) * 1e6:.1f} us, x{times['on'] / times['off']:.2f})")


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
