"""An agent using tools from an MCP server, captured; prints the episode.

    python examples/mcp_tools/run.py              # MCP server in-process
    python examples/mcp_tools/run.py --http       # MCP server in its own process (streamable HTTP)

The agent is a LangGraph app: ``assistant`` (a deterministic fake chat model that asks for the
``add`` tool, then answers) and ``tools`` (calls the MCP server through an instrumented
``mcp.Client``; the ``summarize`` tool makes the server ask the client's model by sampling).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # examples/_common.py

from _common import print_episode, stop  # noqa: E402

from marft_bridge.serving.process import free_port  # noqa: E402


def agent_graph(client, tool_calls: list[dict], answer: str):
    """``assistant`` asks for ``tool_calls`` (one batch), ``tools`` runs them over MCP, ``assistant`` answers."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, ToolMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    from marft_bridge.integrations.mcp import result_text

    model = GenericFakeChatModel(messages=iter([AIMessage("", tool_calls=tool_calls), AIMessage(answer)]))

    async def assistant(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    async def tools(state: MessagesState) -> dict:
        out = []
        for call in state["messages"][-1].tool_calls:
            result = await client.call_tool(call["name"], call["args"])
            out.append(ToolMessage(result_text(result)[0], tool_call_id=call["id"]))
        return {"messages": out}

    g = StateGraph(MessagesState)
    g.add_node("assistant", assistant)
    g.add_node("tools", tools)
    g.add_edge(START, "assistant")
    g.add_conditional_edges("assistant", lambda s: "tools" if s["messages"][-1].tool_calls else END)
    g.add_edge("tools", "assistant")
    return g.compile()


async def sampler(context, params):
    """The client's model for MCP sampling requests (a deterministic stand-in)."""
    from mcp_types import CreateMessageResult, TextContent

    text = params.messages[-1].content.text
    return CreateMessageResult(role="assistant", content=TextContent(type="text", text=text[-20:]), model="assistant")


async def run(server_target, store, question: str) -> str:
    from langchain_core.messages import HumanMessage
    from mcp import Client

    import marft_bridge as mb
    from marft_bridge.integrations.mcp import instrument_client

    calls = [{"name": "add", "args": {"a": 2, "b": 3}, "id": "c1"},
             {"name": "summarize", "args": {"text": question}, "id": "c2"}]
    async with Client(server_target, sampling_callback=sampler) as client:
        instrument_client(client, agent="assistant")
        app = mb.instrument(agent_graph(client, calls, "2 + 3 = 5"), store=store)
        await app.ainvoke({"messages": [HumanMessage(question)]})
        return app.last_episode_id


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--http", action="store_true", help="run the MCP server in its own process")
    ap.add_argument("--store", help="SQLite file for the traces (default: a temporary one)")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import marft_bridge as mb
    from marft_bridge.integrations.mcp import instrument_server
    from marft_bridge.integrations.crossprocess.propagation import flush_joins
    from server import build_server

    store_path = args.store or str(Path(tempfile.mkdtemp()) / "tools.db")
    store = mb.TraceStore.open(store_path)
    if args.http:
        port = free_port()
        proc = start_server(port, store_path)
        try:
            wait_listening(port, proc)
            eid = asyncio.run(run(f"http://127.0.0.1:{port}/mcp", store, "why is the sky blue?"))
            store.flush()
        finally:
            stop(proc)
    else:
        server = instrument_server(build_server(), store=store)
        eid = asyncio.run(run(server, store, "why is the sky blue?"))
        store.flush()
        flush_joins(store)
    print_episode(store.get_episode(eid))
    print(json.dumps({"store": store_path}))


def start_server(port: int, store: str, capture: bool = True, delay_ms: float = 0.0) -> subprocess.Popen:
    cmd = [sys.executable, str(HERE / "server.py"), "--port", str(port), "--store", store, "--delay-ms", str(delay_ms)]
    return subprocess.Popen(cmd + ([] if capture else ["--no-capture"]), env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"MCP server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"MCP server on port {port} did not start within {timeout}s")


if __name__ == "__main__":
    main()
