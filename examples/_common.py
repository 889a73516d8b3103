"""Helpers the example scripts share: stopping a process they started, printing an episode."""

from __future__ import annotations

import signal
import subprocess


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Stop a process we started (by its pid); a captured server writes its pending halves before exiting."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def print_episode(ep) -> None:
    """One line per action in dependency order: step, id, agent, kind, what it depends on, output."""
    print(f"episode {ep.id}  agents: {', '.join(ep.agents)}")
    width = max((len(a.agent) for a in ep.actions), default=0)
    for a in ep.topological_order():
        deps = ", ".join(d[:8] for d in a.depends_on) or "-"
        text = a.output.text.replace("\n", " ")[:60]
        err = f"  ERROR {a.error}" if a.error else ""
        print(f"  step {a.step}  {a.id[:8]}  {a.agent:<{width}} {a.kind:<8} <- [{deps}]  {text!r}{err}")
