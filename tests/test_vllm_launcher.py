"""``VLLMServer`` and ``marft vllm serve`` without vLLM: the command line and environment it builds,
and its process handling against a stand-in ``vllm.entrypoints.openai.api_server`` module (one that
answers /health, spawns a worker child like vLLM's engine, or never gets ready, or dies). The real
vLLM runs in tests/vllm (``make test-vllm``)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from marft_bridge.cli import main
from marft_bridge.errors import MarftError
from marft_bridge.serving import VLLMServer

STANDIN = '''
import os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
mode = os.environ["STANDIN_MODE"]
print("stand-in vLLM", args, "key" if os.environ.get("VLLM_API_KEY") else "no key", flush=True)
if mode == "die":
    sys.exit("engine core failed to start")
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.environ["STANDIN_PIDS"], "w").write(f"{os.getpid()} {worker.pid}")
if mode == "hang":
    time.sleep(600)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), H).serve_forever()
'''


@pytest.fixture
def standin(tmp_path):
    pkg = tmp_path / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(STANDIN)
    return tmp_path


def server(standin, tmp_path, mode: str, **kw) -> VLLMServer:
    env = {"PYTHONPATH": str(standin), "STANDIN_MODE": mode, "STANDIN_PIDS": str(tmp_path / "pids")}
    return VLLMServer(tmp_path / "base", python=sys.executable, env=env, **kw)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split(") ", 1)[1][0] != "Z"


def test_command_and_environment(tmp_path):
    srv = VLLMServer(tmp_path / "base", python=sys.executable, lora_modules={"planner": "/r/planner/v2"},
                     api_key="secret", port=8123, extra_args=["--seed", "1"])
    cmd = srv.command()
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    for flags in (["--served-model-name", "base"], ["--host", "127.0.0.1", "--port", "8123"], ["--dtype", "float32"],
                  ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"], ["--enforce-eager"],
                  ["--logprobs-mode", "processed_logprobs"], ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                  ["--lora-modules", "planner=/r/planner/v2"], ["--seed", "1"]):
        assert any(cmd[i:i + len(flags)] == flags for i in range(len(cmd))), flags
    assert "secret" not in " ".join(cmd)  # `ps` shows the command line; the key goes in the environment
    env = srv.environment()
    assert env["VLLM_API_KEY"] == "secret" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "PYTHONPATH" not in env


def test_refusals(tmp_path, monkeypatch):
    with pytest.raises(MarftError, match="without an API key"):
        VLLMServer(tmp_path, python=sys.executable, host="0.0.0.0")
    monkeypatch.delenv("MARFT_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MarftError, match="make vllm"):
        VLLMServer(tmp_path)


def test_ready_then_stop_ends_the_whole_process_group(standin, tmp_path):
    with server(standin, tmp_path, "ok") as srv:
        server_pid, worker_pid = map(int, (tmp_path / "pids").read_text().split())
        assert srv.startup_s is not None and alive(server_pid) and alive(worker_pid)
        assert "no key" in srv.log_tail()
    deadline = time.monotonic() + 10
    while alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(server_pid) and not alive(worker_pid)  # the worker child too, through the group


def test_exit_while_starting_shows_the_log(standin, tmp_path):
    with pytest.raises(MarftError, match="(?s)exited with code 1 while starting.*engine core failed to start"):
        server(standin, tmp_path, "die").start(timeout=60)


def test_not_ready_in_time_is_stopped(standin, tmp_path):
    srv = server(standin, tmp_path, "hang")
    progress = []
    with pytest.raises(MarftError, match=r"did not become ready within 3 s"):
        srv.start(timeout=3, progress=progress.append, progress_every_s=1)
    server_pid, worker_pid = map(int, (tmp_path / "pids").read_text().split())
    assert not alive(server_pid) and not alive(worker_pid)
    assert progress[0].startswith("vLLM started from") and any(p.endswith("no key") for p in progress[1:]), progress


def test_cli_print_command(tmp_path, monkeypatch, capsys):
    from marft_bridge.serving import AdapterRegistry
    from marft_bridge.serving.fixtures import make_random_adapter
    from marft_bridge.demo.tinymodel import build_tiny_model

    base = build_tiny_model(tmp_path / "base")
    reg = AdapterRegistry(tmp_path / "registry")
    reg.publish("planner", make_random_adapter(base, tmp_path / "a", seed=0), promote=True)
    monkeypatch.setenv("MARFT_VLLM_PYTHON", sys.executable)
    assert main(["vllm", "serve", "--base-model", str(base), "--registry", str(reg.root), "--print-command",
                 "--", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert f"--lora-modules planner={reg.path('planner', 1)}" in out and out.strip().endswith("--seed 7")
    assert main(["vllm", "serve", "--base-model", str(tmp_path / "missing")]) == 1
