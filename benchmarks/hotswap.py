"""Hot-swap benchmark for the embedded server, measured side by side in one run (the machine is noisy):

1. swap latency: registry publish + promote -> first response served by the new version;
2. throughput while swapping every --swap-every seconds vs steady state (target >= 0.9);
3. cross-adapter batching vs one request at a time (--max-batch-size 1) at --concurrency 8
   (target >= 2x). Requests alternate between two adapters and the base model;
4. in-process engine swaps: a new version of the same LoRA shape (copied into the agent's spare
   slot) vs a shape change on every swap (a fresh peft load), interleaved.

    .venv/bin/python benchmarks/hotswap.py [--concurrency 8 --duration 3 --rounds 3 --max-tokens 16]

Builds a tiny model and random adapters in a temporary directory; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from marft_bridge.serving import AdapterRegistry, EmbeddedServerPublisher, ServerProcess
from marft_bridge.serving.fixtures import make_random_adapter
from marft_bridge.demo.tinymodel import build_tiny_model

KEY = "bench"
MODELS = ["planner", "coder", "base"]


def cpu_seconds(pid: int) -> float:
    """CPU time used so far by a process (Linux): ratios per server CPU-second are robust to other
    load on a shared machine, which wall-clock rates are not."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(server: ServerProcess, concurrency: int, duration: float, max_tokens: int) -> dict:
    """Closed-loop clients for ``duration`` seconds against ``server``."""
    url = server.url
    done, tokens, errors, versions = [0], [0], [0], set()
    lock = threading.Lock()
    end = time.monotonic() + duration

    def worker(i: int):
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            n = i
            while time.monotonic() < end:
                model = MODELS[n % len(MODELS)]
                n += 1
                r = c.post("/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": f"task {n}"}],
                    "max_tokens": max_tokens, "temperature": 1.0, "seed": n})
                with lock:
                    if r.status_code != 200:
                        errors[0] += 1
                        continue
                    body = r.json()
                    done[0] += 1
                    tokens[0] += body["usage"]["completion_tokens"]
                    if model == "planner":
                        versions.add(body["adapter"]["version"])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    t0, cpu0 = time.monotonic(), cpu_seconds(server.proc.pid)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed, cpu = time.monotonic() - t0, cpu_seconds(server.proc.pid) - cpu0
    return {"rps": done[0] / elapsed, "tps": tokens[0] / elapsed, "req_per_cpu": done[0] / cpu,
            "tok_per_cpu": tokens[0] / cpu, "errors": errors[0], "versions": versions}


def engine_swaps(base: Path, tmp: Path, rounds: int, per_round: int = 10) -> tuple[float, float]:
    """Median seconds of ``AdapterEngine.load_adapter``: same-shape swaps (two rank-8 adapters in
    turn: each copied into the spare slot) vs ranks 8, 4, 2 in turn (the spare never fits: a fresh
    peft load every time), in interleaved rounds."""
    from marft_bridge.serving.engine import AdapterEngine

    same = [make_random_adapter(base, tmp / f"same{i}", seed=10 + i, rank=8) for i in range(2)]
    shapes = [make_random_adapter(base, tmp / f"rank{r}", seed=20 + r, rank=r) for r in (8, 4, 2)]
    engine = AdapterEngine(base)
    copied, fresh = [], []
    try:
        for _ in range(rounds):
            for sources, times in ((same, copied), (shapes, fresh)):
                for i in range(per_round + 2):  # the first two set up the spare for this pattern
                    t0 = time.perf_counter()
                    engine.load_adapter("planner", sources[i % len(sources)], load_inplace=True)
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
    finally:
        engine.close()
    return statistics.median(copied), statistics.median(fresh)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per throughput phase")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved phase pairs (medians are reported)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--swap-every", type=float, default=0.5, help="seconds between swaps in the swap phase")
    ap.add_argument("--latency-swaps", type=int, default=10)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per server")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="marft-bench-"))
    base = build_tiny_model(tmp / "base", hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size)
    reg = AdapterRegistry(tmp / "registry")
    sources = [make_random_adapter(base, tmp / f"src{i}", seed=i, rank=8) for i in range(4)]
    reg.publish("planner", sources[0], promote=True)
    reg.publish("coder", sources[1], promote=True)
    common = ["--threads", str(args.threads), "--max-tokens-limit", "512"]
    batched = ServerProcess(base, reg.root, api_key=KEY, extra_args=common).start()
    single = ServerProcess(base, reg.root, api_key=KEY, extra_args=common + ["--max-batch-size", "1"]).start()
    try:
        publisher = EmbeddedServerPublisher(batched.url, KEY)

        # 1. swap latency: publish -> first response from the new version (requests issued back to back).
        latencies, load_times = [], []
        with httpx.Client(base_url=batched.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            for i in range(args.latency_swaps):
                t0 = time.monotonic()
                version = reg.publish("planner", sources[2 + i % 2])
                t1 = time.monotonic()
                reg.promote("planner", version, publisher=publisher)
                load_times.append(time.monotonic() - t1)
                while True:
                    r = c.post("/v1/chat/completions", json={"model": "planner", "max_tokens": 1,
                                                             "messages": [{"role": "user", "content": "hi"}]}).json()
                    if r["adapter"]["version"] == version:
                        break
                latencies.append(time.monotonic() - t0)

        # 2. throughput with swaps vs steady, phases interleaved steady/swap/steady/swap.
        # Versions are published beforehand (a trainer does that elsewhere); the phase measures swaps.
        ready = [reg.publish("planner", sources[2 + i % 2]) for i in range(int(args.rounds * args.duration / args.swap_every) + 4)]

        def swapper(stop: threading.Event, count: list):
            while not stop.wait(args.swap_every) and ready:
                reg.promote("planner", ready.pop(0), publisher=publisher)
                count[0] += 1

        steady, swapping, n_swaps = [], [], [0]
        for _ in range(args.rounds):
            steady.append(load(batched, args.concurrency, args.duration, args.max_tokens))
            stop = threading.Event()
            t = threading.Thread(target=swapper, args=(stop, n_swaps))
            t.start()
            swapping.append(load(batched, args.concurrency, args.duration, args.max_tokens))
            stop.set()
            t.join()

        # 3. batched vs one at a time, same load, alternating servers.
        b_runs, s_runs = [], []
        for _ in range(args.rounds):
            b_runs.append(load(batched, args.concurrency, args.duration, args.max_tokens))
            s_runs.append(load(single, args.concurrency, args.duration, args.max_tokens))
    finally:
        batched.stop()
        single.stop()

    # 4. in-process swaps, this process only (the servers are stopped).
    import torch

    torch.set_num_threads(args.threads)
    copied, fresh = engine_swaps(base, tmp, args.rounds)

    def med(runs, key):
        return statistics.median(r[key] for r in runs)

    swap_errors = sum(r["errors"] for r in swapping)
    versions = set().union(*(r["versions"] for r in swapping))
    print(f"model: tiny Llama hidden={args.hidden_size}, adapters rank 8, concurrency {args.concurrency}, "
          f"max_tokens {args.max_tokens}, torch threads {args.threads}, {args.rounds} interleaved rounds x {args.duration:g}s")
    print(f"swap latency (publish -> first new-version response): median {statistics.median(latencies) * 1000:.0f} ms, "
          f"max {max(latencies) * 1000:.0f} ms; load_lora_adapter call median {statistics.median(load_times) * 1000:.0f} ms "
          f"({len(latencies)} swaps)")
    print(f"throughput steady {med(steady, 'rps'):.1f} req/s, during swaps {med(swapping, 'rps'):.1f} req/s "
          f"({n_swaps[0]} swaps, {swap_errors} errors, {len(versions)} planner versions served): "
          f"ratio {med(swapping, 'rps') / med(steady, 'rps'):.2f} wall-clock, "
          f"{med(swapping, 'req_per_cpu') / med(steady, 'req_per_cpu'):.2f} per server CPU-second (target >= 0.9)")
    print(f"generation at concurrency {args.concurrency}: batched {med(b_runs, 'tps'):.0f} tok/s, one at a time "
          f"{med(s_runs, 'tps'):.0f} tok/s: speed-up {med(b_runs, 'tps') / med(s_runs, 'tps'):.2f}x wall-clock, "
          f"{med(b_runs, 'tok_per_cpu') / med(s_runs, 'tok_per_cpu'):.2f}x per server CPU-second (target >= 2x)")
    print(f"engine swap (in-process load_adapter): same LoRA shape, copied into the spare slot {copied * 1000:.1f} ms; "
          f"shape change, fresh peft load {fresh * 1000:.1f} ms: {fresh / copied:.1f}x faster")

if __name__ == "__main__":
    main()
