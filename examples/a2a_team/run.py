"""Run the example A2A team on 127.0.0.1 and print the captured episode.

    python examples/a2a_team/run.py [--store PATH]

A coordinator (a LangGraph app in this process) asks the researcher agent (its own process),
which delegates to the writer agent (a third process). Capture writes the coordinator's half
here and each agent's half in its process, all into one SQLite store; the episode printed at
the end is assembled from the three halves, with the agent-to-agent dependencies.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # examples/_common.py

from _common import print_episode, stop  # noqa: E402

from marft_bridge.serving.process import free_port  # noqa: E402


def start_agent(name: str, port: int, store: str, delegate: str | None = None, capture: bool = True,
                delay_ms: float = 0.0) -> subprocess.Popen:
    cmd = [sys.executable, str(HERE / "agent.py"), name, "--port", str(port), "--store", store, "--delay-ms", str(delay_ms)]
    if delegate:
        cmd += ["--delegate", delegate]
    if not capture:
        cmd.append("--no-capture")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"agent at {url} exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/.well-known/agent-card.json", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"agent at {url} did not start within {timeout}s")


def coordinator_graph(researcher_url: str):
    from langchain_core.messages import AIMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    from agent import fake_model, send_text
    from marft_bridge.integrations import a2a as cap

    client = None

    async def coordinator(state: MessagesState) -> dict:
        q = state["messages"][-1].content
        return {"messages": [await fake_model(f"research {q}").ainvoke(state["messages"])]}

    async def ask(state: MessagesState) -> dict:
        nonlocal client
        if client is None:
            client = await cap.connect(researcher_url)
        return {"messages": [AIMessage(await send_text(client, state["messages"][-1].content))]}

    async def summarize(state: MessagesState) -> dict:
        return {"messages": [await fake_model("answer: " + state["messages"][-1].content).ainvoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("coordinator", coordinator)
    g.add_node("ask", ask, metadata={"agent_name": "coordinator"})
    g.add_node("summarize", summarize, metadata={"agent_name": "coordinator"})
    g.add_edge(START, "coordinator")
    g.add_edge("coordinator", "ask")
    g.add_edge("ask", "summarize")
    g.add_edge("summarize", END)
    return g.compile()


async def ask_team(store, researcher_url: str, question: str) -> tuple[str, str]:
    """Run the coordinator on ``question``; returns (episode id, answer)."""
    from langchain_core.messages import HumanMessage

    import marft_bridge as mb

    app = mb.instrument(coordinator_graph(researcher_url), store=store)
    out = await app.ainvoke({"messages": [HumanMessage(question)]})
    return app.last_episode_id, out["messages"][-1].content


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", help="SQLite file for the traces (default: a temporary one)")
    ap.add_argument("--question", default="why is the sky blue?")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import marft_bridge as mb

    store_path = args.store or str(Path(tempfile.mkdtemp()) / "team.db")
    store = mb.TraceStore.open(store_path)
    wport, rport = free_port(), free_port()
    wurl, rurl = f"http://127.0.0.1:{wport}", f"http://127.0.0.1:{rport}"
    procs = [start_agent("writer", wport, store_path)]
    procs.append(start_agent("researcher", rport, store_path, delegate=wurl))
    try:
        wait_ready(wurl, procs[0])
        wait_ready(rurl, procs[1])
        eid, answer = asyncio.run(ask_team(store, rurl, args.question))
        store.flush()
        print("answer:", answer)
    finally:
        for p in reversed(procs):
            stop(p)
    print_episode(store.get_episode(eid))
    print(f"store: {store_path}")


if __name__ == "__main__":
    main()
