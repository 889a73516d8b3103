"""Per-call time of MCP tool calls and A2A messages with and without capture, side by side.

    OMP_NUM_THREADS=1 python benchmarks/protocol_overhead.py [--calls 100] [--rounds 5] [--delay-ms 10]

Each case runs the same calls on an uncaptured pair (plain client, server without capture) and
on a captured pair (instrumented client inside episodes of ``--per-episode`` calls, captured
server writing its halves to the same SQLite store), alternating the order every round.
Printed per case, as medians over rounds: the mean wall time per call, captured / plain (and
the ratio of the fastest rounds), and captured / plain CPU seconds of this process and the servers counted until
every captured record is stored. Background writes (the store's writer, the servers' join
writers) may overlap the captured calls, as in a deployment, but the run waits for them to
finish before the next measurement starts, so they never slow a plain one; the CPU ratio counts
them in full. The run fails unless the store holds exactly the captured actions (the warm-up
call of each captured pair runs in an episode and counts too). ``--delay-ms``: each
call waits that long in the tool / echo agent (a realistic call instead of the no-work worst case).
Cases:

- mcp in-process: ``mcp.Client(MCPServer)`` in one process (the smallest call, worst case; 10x
  ``--calls`` per measurement without ``--delay-ms``, as its calls are that much shorter);
- mcp http: the MCP server in its own process over streamable HTTP on 127.0.0.1;
- a2a echo: an A2A agent (its own process) that echoes the text: the protocol capture alone;
- a2a writer: the example writer agent (a LangGraph app inside) with its model calls captured.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "mcp_tools"))
sys.path.insert(0, str(ROOT / "examples" / "a2a_team"))

import logging  # noqa: E402

import marft_bridge as mb  # noqa: E402
from marft_bridge.integrations import a2a as a2a_cap  # noqa: E402
from marft_bridge.integrations import mcp as mcp_cap  # noqa: E402
from marft_bridge.integrations.crossprocess.propagation import flush_joins  # noqa: E402


async def timed_calls(call, n: int, per_episode: int, store) -> float:
    """Mean seconds per call; with ``store``, calls run inside episodes of ``per_episode`` calls."""
    t0 = time.perf_counter()
    done = 0
    while done < n:
        k = min(per_episode, n - done)
        if store is None:
            for _ in range(k):
                await call()
        else:
            with mb.episode(store=store, source="benchmark"):
                for _ in range(k):
                    await call()
        done += k
    return (time.perf_counter() - t0) / n


class Ledger:
    """What the captured runs must have stored, and the CPU seconds of this process and the servers."""

    def __init__(self, store, path: str):
        self.store, self.path, self.expected = store, path, 0

    def stored_actions(self) -> int:
        with sqlite3.connect(f"file:{self.path}?mode=ro", uri=True) as db:  # cheaper than store.stats()
            return db.execute("select count(*) from marft_actions").fetchone()[0]

    async def settle(self, timeout: float = 60.0) -> None:
        """Wait until every action captured so far is stored (this process's writer, the servers'
        join writers): background writes of one measurement never run into the next."""
        self.store.flush()
        flush_joins(self.store, timeout)
        end = time.monotonic() + timeout
        while (got := self.stored_actions()) < self.expected:
            if time.monotonic() > end:
                raise RuntimeError(f"only {got} of {self.expected} captured actions were stored")
            await asyncio.sleep(0.01)

    @staticmethod
    def cpu(pids: list[int]) -> float:
        total = time.process_time()
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        return total


async def compare(make_plain, make_captured, n: int, rounds: int, per_episode: int, ledger: Ledger,
                  actions_per_call: int, pids: list[int]) -> dict:
    """make_*() -> async context manager yielding an async ``call()``.

    Wall time: the calls alone (background writes may overlap them, as in a deployment). CPU: this
    process and the servers, from the first call until the captured records are all stored."""
    ratios, cpu_ratios, plain_t, cap_t = [], [], [], []
    async with make_plain() as plain_call, make_captured() as cap_call:
        # Warm both (connections, imports); the captured warm-up runs in an episode like the
        # measured calls, so it adds a known number of actions to what the store must hold.
        await plain_call()
        await timed_calls(cap_call, 1, 1, ledger.store)
        ledger.expected += actions_per_call
        for r in range(rounds):
            order = ["plain", "cap"] if r % 2 == 0 else ["cap", "plain"]
            got, cpu = {}, {}
            for name in order:
                await ledger.settle()
                c0 = ledger.cpu(pids)
                if name == "cap":
                    got[name] = await timed_calls(cap_call, n, per_episode, ledger.store)
                    ledger.expected += n * actions_per_call
                else:
                    got[name] = await timed_calls(plain_call, n, per_episode, None)
                await ledger.settle()
                cpu[name] = ledger.cpu(pids) - c0
            plain_t.append(got["plain"])
            cap_t.append(got["cap"])
            ratios.append(got["cap"] / got["plain"])
            cpu_ratios.append(cpu["cap"] / cpu["plain"])
    return {"plain_ms": 1e3 * statistics.median(plain_t), "captured_ms": 1e3 * statistics.median(cap_t),
            "ratio": statistics.median(ratios), "min_ratio": min(cap_t) / min(plain_t),
            "cpu_ratio": statistics.median(cpu_ratios)}


class _Ctx:
    def __init__(self, enter, exit_=None):
        self.enter, self.exit = enter, exit_

    async def __aenter__(self):
        return await self.enter()

    async def __aexit__(self, *exc):
        if self.exit is not None:
            await self.exit()


def mcp_pair(target_plain, target_cap):
    from mcp import Client

    def make(target, capture):
        client = Client(target)

        async def enter():
            await client.__aenter__()
            if capture:
                mcp_cap.instrument_client(client, agent="bench")

            async def call():
                await client.call_tool("add", {"a": 2, "b": 3})
            return call

        async def exit_():
            await client.__aexit__(None, None, None)
        return _Ctx(enter, exit_)

    return (lambda: make(target_plain, False)), (lambda: make(target_cap, True))


def a2a_pair(url_plain, url_cap):
    from a2a.client import ClientConfig, create_client
    from a2a.types import Message, Part, Role, SendMessageRequest

    def make(url, capture):
        holder = {}

        async def enter():
            cfg = ClientConfig(streaming=False)
            holder["c"] = await (a2a_cap.connect(url, agent="bench", client_config=cfg) if capture
                                 else create_client(url, cfg))

            async def call():
                msg = Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[Part(text="hello there")])
                async for _ in holder["c"].send_message(SendMessageRequest(message=msg)):
                    pass
            return call

        async def exit_():
            await holder["c"].close()
        return _Ctx(enter, exit_)

    return (lambda: make(url_plain, False)), (lambda: make(url_cap, True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=100, help="calls per measurement (default 100)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--per-episode", type=int, default=5, help="calls per captured episode (default 5)")
    ap.add_argument("--delay-ms", type=float, default=0.0,
                    help="the tool / echo agent waits this long per call (a realistic call; default 0: worst case)")
    ap.add_argument("--only", choices=["mcp", "a2a"], help="run one protocol only")
    args = ap.parse_args()
    logging.disable(logging.INFO)  # the SDKs log one INFO line per request

    import run as a2a_run  # examples/a2a_team/run.py: process helpers
    from server import build_server  # examples/mcp_tools/server.py

    tmp = Path(tempfile.mkdtemp())
    store_path = str(tmp / "bench.db")
    store = mb.TraceStore.open(store_path)
    ledger = Ledger(store, store_path)
    results: dict[str, dict] = {}
    procs = []
    delay = args.delay_ms
    run = (args.calls, args.rounds, args.per_episode, ledger)
    try:
        if args.only in (None, "mcp"):
            plain_srv = build_server(delay_ms=delay)
            cap_srv = mcp_cap.instrument_server(build_server(delay_ms=delay), store=store)
            # client tool step + server tool action per call; 10x the calls: they are ~10x shorter
            # than over HTTP, and a scheduler hiccup would swamp a 30 ms measurement.
            in_proc = (args.calls * (10 if not delay else 1), *run[1:])
            results["mcp in-process"] = asyncio.run(compare(*mcp_pair(plain_srv, cap_srv), *in_proc, 2, []))
            mcp_run = _load_mcp_run()
            p1, p2 = a2a_run.free_port(), a2a_run.free_port()
            pair = [mcp_run.start_server(p1, store_path, capture=False, delay_ms=delay),
                    mcp_run.start_server(p2, store_path, delay_ms=delay)]
            procs += pair
            mcp_run.wait_listening(p1, pair[0])
            mcp_run.wait_listening(p2, pair[1])
            mk = mcp_pair(f"http://127.0.0.1:{p1}/mcp", f"http://127.0.0.1:{p2}/mcp")
            results["mcp http"] = asyncio.run(compare(*mk, *run, 2, [p.pid for p in pair]))
        if args.only in (None, "a2a"):
            # client message + the agent's env and reply (+ the writer's two model calls)
            for name, per_call in (("echo", 3), ("writer", 5)):
                if name == "writer" and delay:
                    continue  # its LangGraph app is the work; --delay-ms applies to echo
                p1, p2 = a2a_run.free_port(), a2a_run.free_port()
                pair = [a2a_run.start_agent(name, p1, store_path, capture=False, delay_ms=delay),
                        a2a_run.start_agent(name, p2, store_path, delay_ms=delay)]
                procs += pair
                u1, u2 = f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}"
                a2a_run.wait_ready(u1, pair[0])
                a2a_run.wait_ready(u2, pair[1])
                results[f"a2a {name}"] = asyncio.run(compare(*a2a_pair(u1, u2), *run, per_call,
                                                             [p.pid for p in pair]))
    finally:
        for p in procs:
            a2a_run.stop(p)
    print(f"{'case':<16} {'plain ms/call':>14} {'captured ms/call':>17} {'captured/plain':>15} {'of minima':>10} "
          f"{'cpu captured/plain':>19}")
    for case, r in results.items():
        print(f"{case:<16} {r['plain_ms']:>14.3f} {r['captured_ms']:>17.3f} {r['ratio']:>15.3f} "
              f"{r['min_ratio']:>10.3f} {r['cpu_ratio']:>19.3f}")
    st = store.stats()
    print(f"stored: {st['episodes']} episodes, {st['actions']} actions (expected {ledger.expected}, warm-up calls "
          f"included), {st['dead_letters']} dead letters ({store_path}); {args.calls} calls x {args.rounds} rounds "
          "per case" + ("" if delay else f" ({10 * args.calls} in-process)")
          + (f"; each call waits {delay:g} ms" if delay else ""))
    store.close()
    if st["actions"] != ledger.expected:
        sys.exit(f"the store holds {st['actions']} actions, not the {ledger.expected} captured")


def _load_mcp_run():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mcp_tools_run", ROOT / "examples" / "mcp_tools" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    main()
