"""The hot-swap scenario against a running vLLM multi-LoRA server (``marft_bridge.serving.vllm.hotswap``;
``tests/vllm/test_hotswap.py`` runs the same scenario in ``make test-vllm``).

vLLM runs in its own environment (``make vllm`` builds ``.venv-vllm``); start it on a base model with
runtime LoRA loading, here on CPU with the tiny test model shape (hidden 256, 4 heads):

    .venv/bin/marft vllm serve --base-model BASE --port 8001 --api-key KEY      # ≈ 1-3 min to ready

or on a GPU machine with vLLM installed the usual way:

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve BASE --host 127.0.0.1 --port 8001 --api-key KEY \\
        --enable-lora --max-loras 4 --max-lora-rank 16 --logprobs-mode processed_logprobs

Then, in this project's environment (registry versions must be LoRA adapters for the same base):

    .venv/bin/python benchmarks/vllm_hotswap.py --url http://127.0.0.1:8001 --api-key KEY \\
        --registry /tmp/swap-registry --agent planner --make-adapters BASE --requests 40

``--make-adapters BASE`` publishes 6 random rank-8 adapters for BASE (a local path) and makes a
rank-32 one to check that an over-rank adapter is refused (the server's ``--max-lora-rank`` must be
below 32). Every version loads from its own registry directory (vLLM does not notice changed weights
under a path it already loaded); the registry must be readable by the vLLM process. Prints the
swap latencies and what was refused; exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from marft_bridge.errors import MarftError
from marft_bridge.serving import AdapterRegistry
from marft_bridge.serving.vllm.hotswap import SWAPS, run_hotswap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="vLLM server, e.g. http://127.0.0.1:8001")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--registry", required=True)
    ap.add_argument("--agent", default="planner")
    ap.add_argument("--make-adapters", metavar="BASE", help=f"publish {SWAPS + 1} random adapters for this base first")
    ap.add_argument("--adapter-scale", type=float, default=1.0,
                    help="std of the random LoRA B weights for --make-adapters (large enough to change outputs)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--clients", type=int, default=4, help="client threads")
    ap.add_argument("--requests", type=int, default=100,
                    help="per client thread: the run sends about clients x requests, each version answering "
                    "its 1/6 share of them after its swap")
    args = ap.parse_args()

    reg = AdapterRegistry(args.registry)
    over_rank = None
    if args.make_adapters:
        from marft_bridge.serving.fixtures import make_random_adapter

        tmp = Path(tempfile.mkdtemp())
        for i in range(SWAPS + 1):
            reg.publish(args.agent, make_random_adapter(args.make_adapters, tmp / f"a{i}", seed=i, rank=8,
                                                         scale=args.adapter_scale))
        over_rank = make_random_adapter(args.make_adapters, tmp / "rank32", seed=99, rank=32, scale=args.adapter_scale)
    try:
        report = run_hotswap(args.url, reg, args.agent, api_key=args.api_key, over_rank_adapter=over_rank,
                             clients=args.clients, requests=args.requests, max_tokens=args.max_tokens)
    except MarftError as e:
        print(f"vllm_hotswap: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    for kind, message in report.refused.items():
        print(f"refused {kind} adapter: {message[:200]}")
    for f in report.failures[:20]:
        print("FAIL:", f)
    print("OK" if not report.failures else f"{len(report.failures)} failures")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
