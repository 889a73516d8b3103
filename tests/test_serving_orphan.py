"""A server started by ``ServerProcess`` does not outlive the process that started it: kill -9 of that
process (``marft fit``, the demo, a test runner), whose ``stop()`` then never runs, and the server
stops itself; with ``exit_with_parent=False`` it serves on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

PARENT = """
import sys, time
from marft_bridge.serving.process import ServerProcess
srv = ServerProcess(sys.argv[1], sys.argv[2], api_key="k", extra_args=["--threads", "1"],
                    exit_with_parent=sys.argv[3] == "1").start()
print(srv.proc.pid, srv.url, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # an exited child of the killed parent is reaped by init; a zombie counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:  # gone between the two looks
        return False


def started_then_parent_killed(tiny_model_dir, tmp_path, exit_with_parent: bool) -> tuple[int, str]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tiny_model_dir), str(tmp_path / "registry"),
                               "1" if exit_with_parent else "0"], stdout=subprocess.PIPE, text=True)
    line = parent.stdout.readline().split()
    assert line, "the parent did not start the server"
    pid, url = int(line[0]), line[1]
    assert httpx.get(url + "/health").status_code == 200
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    return pid, url


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_the_server_stops_when_the_process_that_started_it_is_killed(tiny_model_dir, tmp_path):
    pid, _ = started_then_parent_killed(tiny_model_dir, tmp_path, exit_with_parent=True)
    deadline = time.monotonic() + 60  # a bound on the wait, not a timing claim: it polls its parent every second
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pid)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_without_exit_with_parent_it_serves_on(tiny_model_dir, tmp_path):
    pid, url = started_then_parent_killed(tiny_model_dir, tmp_path, exit_with_parent=False)
    try:
        time.sleep(3)  # three of the watcher's polls, had it one
        assert alive(pid) and httpx.get(url + "/health").status_code == 200
    finally:
        os.kill(pid, signal.SIGTERM)  # the one process this test left running, by its id
