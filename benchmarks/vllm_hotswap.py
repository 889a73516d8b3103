"""The hot-swap scenario against a vLLM multi-LoRA server (for a machine with a GPU).

vLLM pins its own torch/transformers, so run it in its own environment and reach it over HTTP:

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve Qwen/Qwen2.5-0.5B-Instruct \\
        --host 127.0.0.1 --port 8001 --api-key KEY \\
        --enable-lora --max-loras 8 --max-lora-rank 16 \\
        --logprobs-mode processed_logprobs

- ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` enables ``POST /v1/load_lora_adapter`` /
  ``/v1/unload_lora_adapter`` (without it they do not exist).
- ``--max-loras`` = adapters resident in one batch (agents + versions in flight), ``--max-lora-rank``
  at least the adapters' rank (vLLM accepts 1, 8, 16, 32, 64, ...).
- ``--logprobs-mode processed_logprobs`` makes vLLM report log-probs after temperature/top-k/top-p,
  as the embedded server does.
- Replacing an adapter under the same name needs ``load_inplace: true``; every version must come
  from a new directory (vLLM's prefix cache is not cleared when weights change under one path) --
  the registry's ``<agent>/v<N>/`` layout gives exactly that. The path must be readable by vLLM.

Then, in this project's environment (registry versions must be LoRA adapters for the same base):

    .venv/bin/python benchmarks/vllm_hotswap.py --url http://127.0.0.1:8001 --api-key KEY \\
        --registry .marft/adapters --agent planner [--make-adapters Qwen/Qwen2.5-0.5B-Instruct]

``--make-adapters BASE`` publishes 6 random rank-8 adapters for BASE (a local path or a cached hub
id) so the check needs no trained ones. The scenario: every version is also loaded under its own
name (``<agent>-v<N>``) to record its greedy output; then 4 client threads x 100 requests to
``model=<agent>`` run while 5 swaps happen. vLLM does not report adapter versions, so each
response is attributed by its output: it must equal the output of a version that was live while
the request was in flight. Then a corrupt and an over-rank adapter must be refused while the old
one keeps serving. Prints swap latencies and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from marft_bridge.errors import MarftError
from marft_bridge.serving import AdapterRegistry, VLLMPublisher

PROMPT = [{"role": "user", "content": "Write one short sentence about the sea."}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="vLLM server, e.g. http://127.0.0.1:8001")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--registry", required=True)
    ap.add_argument("--agent", default="planner")
    ap.add_argument("--make-adapters", metavar="BASE", help="publish 6 random adapters for this base model first")
    ap.add_argument("--adapter-scale", type=float, default=0.05,
                    help="std of the random LoRA B weights for --make-adapters (large enough to change outputs)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--requests", type=int, default=100, help="per client thread")
    args = ap.parse_args()

    reg = AdapterRegistry(args.registry)
    if args.make_adapters:
        from marft_bridge.serving.fixtures import make_random_adapter

        tmp = Path(tempfile.mkdtemp())
        for i in range(6):
            reg.publish(args.agent, make_random_adapter(args.make_adapters, tmp / f"a{i}", seed=i, rank=8,
                                                         scale=args.adapter_scale))
    versions = reg.versions(args.agent)[-6:]
    if len(versions) < 6:
        print(f"need 6 versions of {args.agent!r} in {reg.root} (use --make-adapters BASE)", file=sys.stderr)
        return 2
    pub = VLLMPublisher(args.url, args.api_key)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    http = httpx.Client(base_url=pub.url, headers=headers, timeout=120)

    def complete(model: str) -> str:
        r = http.post("/v1/chat/completions", json={"model": model, "messages": PROMPT, "max_tokens": args.max_tokens,
                                                    "temperature": 0, "return_token_ids": True})
        r.raise_for_status()
        body = r.json()
        return json.dumps(body["choices"][0].get("token_ids") or body["choices"][0]["message"]["content"])

    failures = []
    # Reference outputs: each version under its own name.
    expected = {}
    for v in versions:
        pub.load(f"{args.agent}-v{v}", reg.path(args.agent, v))
        expected[v] = complete(f"{args.agent}-v{v}")
    if len(set(expected.values())) < 3:
        print("the versions' greedy outputs are (nearly) all identical, so responses cannot be attributed to "
              "versions; use adapters that differ more (--adapter-scale)", file=sys.stderr)
        return 2

    # Swap latency: load call -> first response equal to the new version's output.
    latencies = []
    pub.load(args.agent, reg.path(args.agent, versions[0]))
    for v in versions[1:3] + versions[:1]:
        t0 = time.monotonic()
        pub.load(args.agent, reg.path(args.agent, v))
        while complete(args.agent) != expected[v]:
            if time.monotonic() - t0 > 60:
                failures.append(f"v{v} never served after its swap")
                break
        latencies.append(time.monotonic() - t0)

    # Swaps under load.
    records, errors, lock = [], [], threading.Lock()
    progress = threading.Semaphore(0)

    def client():
        for _ in range(args.requests):
            sent = time.monotonic()
            try:
                out = complete(args.agent)
                with lock:
                    records.append((sent, time.monotonic(), out))
            except Exception as e:  # noqa: BLE001 - counted
                errors.append(repr(e))
            finally:
                progress.release()

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    live = [(versions[0], float("-inf"), float("-inf"))]
    for v in versions[1:6]:
        for _ in range(4 * args.requests // 6):
            progress.acquire()
        began = time.monotonic()
        pub.load(args.agent, reg.path(args.agent, v))
        live.append((v, began, time.monotonic()))
    for t in threads:
        t.join()
    def was_live(i: int, sent: float, received: float) -> bool:
        # loaded before the response came back, not yet replaced when the request went out
        return received >= live[i][1] and (i + 1 == len(live) or sent <= live[i + 1][2])

    served = set()
    for sent, received, out in records:
        # Versions with identical outputs are indistinguishable: any one of them being live will do.
        matches = [i for i, (v, _, _) in enumerate(live) if expected[v] == out]
        if not matches:
            failures.append(f"output matches no swapped-in version: {out[:80]}")
        elif not any(was_live(i, sent, received) for i in matches):
            failures.append(f"response from v{live[matches[0]][0]} outside the time it was live")
        else:
            served.add(live[matches[0]][0])
    if errors:
        failures.append(f"{len(errors)} request errors, first: {errors[0]}")

    # Bad adapters: refused, old keeps serving.
    before = complete(args.agent)
    current = live[-1][0]
    bad_dir = Path(tempfile.mkdtemp())
    corrupt = bad_dir / "corrupt"
    shutil.copytree(reg.path(args.agent, current), corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    for name, path in (("corrupt", corrupt),):
        try:
            pub.load(args.agent, path)
            failures.append(f"vLLM accepted a {name} adapter")
        except MarftError as e:
            print(f"refused {name} adapter: {str(e)[:160]}")
    if complete(args.agent) != before:
        failures.append("output changed after a refused load")

    for v in versions:
        pub.unload(f"{args.agent}-v{v}")
    print(f"swap latency (load call -> first response from the new version): median "
          f"{statistics.median(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")
    print(f"under load: {len(records)} responses, {len(errors)} errors, 5 swaps; versions served: "
          f"{sorted(served)}")
    for f in failures[:20]:
        print("FAIL:", f)
    print("OK" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
