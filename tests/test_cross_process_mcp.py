"""Cross-process MCP capture: the MCP server runs in its own process (streamable HTTP on
127.0.0.1) and writes its half of each episode to the same store as the client, on SQLite and on
PostgreSQL; the assembled episode has the exact client/server edges."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import marft_bridge as mb
from marft_bridge.integrations.crossprocess import propagation as prop

HERE = Path(__file__).resolve().parent


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


run_mod = _load(HERE.parent / "examples" / "mcp_tools" / "run.py", "mcp_tools_run_xp")
checks = _load(HERE / "test_mcp_capture.py", "mcp_capture_checks")


def test_server_in_another_process_joins_the_clients_episode(store_url):
    store = mb.TraceStore.open(store_url)
    port = run_mod.free_port()
    proc = run_mod.start_server(port, store_url)
    try:
        run_mod.wait_listening(port, proc)
        url = f"http://127.0.0.1:{port}/mcp"
        eid = asyncio.run(run_mod.run(url, store, "why is the sky blue?"))
        store.flush()
        # The server sent its half back in each reply: the client's one write holds the whole
        # episode while the server still runs (no merge in the store, no join writer to wait for).
        ep = store.get_episode(eid)
        meta = asyncio.run(_captured_call_meta(url, store))
    finally:
        run_mod.stop(proc)  # SIGTERM to the pid we started; it writes its pending halves first
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    checks.assert_tool_episode(ep)
    assert store.get_episode(eid) == ep and store.count() == 2
    # ... and the app gets the result a server without capture sends.
    assert prop.HALF_KEY not in meta and prop.CALLER_KEY not in meta
    store.close()


async def _captured_call_meta(url, store) -> dict:
    from mcp import Client

    from marft_bridge.integrations.mcp import instrument_client

    async with Client(url) as client:
        instrument_client(client, agent="assistant")
        with mb.episode(store=store):
            result = await client.call_tool("add", {"a": 1, "b": 2})
    assert result.content[0].text == "3"
    return dict(result.meta or {})
