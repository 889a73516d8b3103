"""``marft serve`` and ``marft adapters list|show|publish|promote|rollback|map``.

An adapter is named by the model name an app's calls send (vLLM-style). Agents captured under a
subgraph path (``supervisor/agent``) may be given instead: they map to their registry-safe name
(``supervisor.agent``, see ``schema.agent_adapter_name``); ``marft adapters map`` prints the
agent -> adapter mapping of captured episodes, the one ``marft train`` and ``marft sft`` use (a hosted
model's calls map to their agent's adapter, and are counted).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import sys

from ..errors import MarftError, RecordError
from .engine.types import DEFAULT_MAX_QUEUED
from .http import limits as http_limits
from .process import exit_with_parent

DEFAULT_REGISTRY = os.environ.get("MARFT_REGISTRY", ".marft/adapters")


def add_commands(sub) -> None:
    _add_serve(sub)
    _add_adapters(sub)


def _add_serve(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible server with per-agent LoRA adapters and hot-swap",
        description="OpenAI-compatible server (chat/completions, streaming, log-probs, token ids) on a "
        "transformers base model; request `model` = agent adapter name. Serves the current version of "
        "every agent in the registry and hot-swaps new ones via POST /v1/load_lora_adapter (needs the "
        "API key). Every response names the adapter version that produced it. A request whose client "
        "disconnects stops generating at the next decode step; past --max-queued waiting requests the server "
        "answers 429 with Retry-After; bodies, headers and idle connections are bounded (see the limits below).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("--base-model", required=True, help="local transformers model directory")
    serve.add_argument("--registry", default=DEFAULT_REGISTRY, help="adapter registry root (adapters load only from here)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="key required on /v1 (also env MARFT_API_KEY); without one the admin endpoints are off")
    serve.add_argument("--max-lora-rank", type=int, default=64, help="refuse adapters of a higher rank")
    serve.add_argument("--max-batch-size", type=int, default=16, help="requests generated together")
    serve.add_argument("--batch-wait-ms", type=float, default=5.0, help="how long to gather a batch")
    serve.add_argument("--max-tokens-limit", type=int, default=1024, help="largest max_tokens a request may ask")
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20,
                       help="largest request body (413 past it, also for a chunked body: it is never read whole)")
    serve.add_argument("--max-queued", type=http_limits.positive(int), default=DEFAULT_MAX_QUEUED,
                       help="requests waiting for a batch slot at most; past it a request gets 429 with Retry-After")
    serve.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    http_limits.add_flags(serve, limit_concurrency=512)
    serve.set_defaults(func=_serve)


def _registry_flags(p, server: bool = False) -> None:
    p.add_argument("--registry", default=DEFAULT_REGISTRY, help="registry root (env MARFT_REGISTRY)")
    if server:
        g = p.add_mutually_exclusive_group()
        g.add_argument("--server", help="URL of a running `marft serve` to load the version into")
        g.add_argument("--vllm", help="URL of a vLLM server (runtime LoRA updating enabled) to load it into")
        p.add_argument("--api-key", default=os.environ.get("MARFT_API_KEY"), help="server API key (env MARFT_API_KEY)")


def _add_adapters(sub) -> None:
    ad = sub.add_parser("adapters", help="versioned per-agent adapter registry",
                        description="Publish, promote, roll back and list versioned LoRA adapters "
                        "(<registry>/<agent>/v<N>/). With --server/--vllm, promote and rollback also "
                        "hot-swap the version into that running server, and keep the old current "
                        "version if the server refuses the new one.")
    asub = ad.add_subparsers(dest="adapters_command", metavar="ACTION", required=True)
    common = _registry_flags

    agent_help = "adapter name, or an agent path (supervisor/agent -> supervisor.agent)"
    p = asub.add_parser("list", help="list versions (* marks the current one)")
    common(p)
    p.add_argument("agent", nargs="?", help="only this adapter (" + agent_help + ")")
    p.add_argument("--json", action="store_true", help="print JSON lines")
    p.set_defaults(func=_list)

    p = asub.add_parser("show", help="print one version's manifest")
    common(p)
    p.add_argument("agent", help=agent_help)
    p.add_argument("version", nargs="?", type=int, help="default: current")
    p.set_defaults(func=_show)

    p = asub.add_parser("publish", help="copy a peft adapter dir into a new version")
    common(p, server=True)
    p.add_argument("agent", help=agent_help)
    p.add_argument("source", help="peft save_pretrained dir (holding adapter_config.json, or <agent>/ inside)")
    p.add_argument("--metric", action="append", default=[], metavar="NAME=VALUE", help="metric to record (repeatable)")
    p.add_argument("--parent", type=int, default=None, help="parent version (default: current)")
    p.add_argument("--promote", action="store_true", help="make it current (and load it with --server/--vllm)")
    p.set_defaults(func=_publish)

    p = asub.add_parser("promote", help="make a version current")
    common(p, server=True)
    p.add_argument("agent", help=agent_help)
    p.add_argument("version", type=int)
    p.set_defaults(func=_promote)

    p = asub.add_parser("rollback", help="return to the previously promoted version")
    common(p, server=True)
    p.add_argument("agent", help=agent_help)
    p.set_defaults(func=_rollback)

    p = asub.add_parser("map", help="which adapter each captured agent's calls used (what marft train trains)",
                        description="For the llm actions of stored or exported episodes: agent -> the adapters "
                        "its calls trained (the model name each call sent, else the agent path with '/' as '.'), "
                        "with each adapter's current version in the registry.")
    common(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--store", help="trace store URL or SQLite path")
    src.add_argument("--episodes", metavar="FILE", help="JSONL file of episodes (marft traces export)")
    p.set_defaults(func=_map)


def _serve(args) -> int:
    exit_with_parent()  # started by ServerProcess (marft fit, the demo): not outliving it, loading included
    import torch

    from .engine import AdapterEngine
    from .http.server import create_app
    from .registry import AdapterRegistry

    api_key = args.api_key or os.environ.get("MARFT_API_KEY") or None
    if args.threads:
        torch.set_num_threads(args.threads)
    if not os.path.isdir(args.base_model):
        raise MarftError(f"--base-model {args.base_model} is not a model directory")
    if not _is_loopback(args.host) and not api_key:
        raise MarftError(f"refusing to bind {args.host} without --api-key (or MARFT_API_KEY): a non-loopback "
                         "server needs a key for its admin endpoints")
    # The server logs refused requests, 500s (with their request id) and worker faults.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    registry = AdapterRegistry(args.registry)
    engine = AdapterEngine(
        args.base_model,
        registry=registry,
        max_lora_rank=args.max_lora_rank,
        max_batch_size=args.max_batch_size,
        batch_wait_s=args.batch_wait_ms / 1000,
        max_tokens_limit=args.max_tokens_limit,
        max_queued=args.max_queued,
        dtype=args.dtype,
    )
    for agent, outcome in engine.load_current().items():
        print(f"marft serve: {agent} {outcome}", file=sys.stderr)
    app = create_app(engine, api_key=api_key, max_request_bytes=args.max_request_bytes)
    print(f"marft serve: {engine.base_name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        http_limits.run(app, args)
    finally:
        engine.close()
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _registry(args):
    from .registry import AdapterRegistry

    return AdapterRegistry(args.registry)


def _publisher(args):
    from .publishers import EmbeddedServerPublisher, VLLMPublisher

    if getattr(args, "server", None):
        return EmbeddedServerPublisher(args.server, args.api_key)
    if getattr(args, "vllm", None):
        return VLLMPublisher(args.vllm, args.api_key)
    return None


def _adapter(reg, name: str, *, new: bool = False) -> str:
    """The registry's adapter for ``name``: the adapter itself, or an agent path's registry-safe name.
    A name the registry does not hold is refused listing the ones it does, unless publishing (``new``)."""
    from ..adapter_names import agent_adapter_name
    from ..registry_state import is_agent_name

    known = reg.agents()
    if name in known or (new and is_agent_name(name)):
        return name
    mapped = agent_adapter_name(name)
    if mapped in known or new:
        print(f"marft adapters: agent {name} -> adapter {mapped}", file=sys.stderr)
        return mapped
    raise MarftError(f"unknown adapter {name!r} (as an agent path: {mapped!r}); {reg.root} has: "
                     f"{', '.join(known) or 'no adapters'}")


def _list(args) -> int:
    reg = _registry(args)
    rows = reg.list(_adapter(reg, args.agent) if args.agent else None)
    for row in rows:
        m = row.manifest
        if args.json:
            print(json.dumps({**m.model_dump(), "path": row.path, "current": row.current}))
        else:
            metrics = " ".join(f"{k}={v:g}" for k, v in m.metrics.items())
            parent = f"v{m.parent}" if m.parent else "-"
            print(f"{'*' if row.current else ' '} {m.agent:<20} v{m.version:<4} parent={parent:<5} r={m.rank:<3} "
                  f"{m.created_at[:19]}  {metrics}")
    if not rows and not args.json:
        print(f"no adapters in {_registry(args).root}", file=sys.stderr)
    return 0


def _show(args) -> int:
    reg = _registry(args)
    print(reg.manifest(_adapter(reg, args.agent), args.version).model_dump_json(indent=2))
    return 0


def _publish(args) -> int:
    metrics = {}
    for item in args.metric:
        name, sep, value = item.partition("=")
        try:
            metrics[name] = float(value)
        except ValueError:
            raise MarftError(f"--metric {item!r}: expected NAME=NUMBER") from None
        if not sep or not name:
            raise MarftError(f"--metric {item!r}: expected NAME=NUMBER")
    reg = _registry(args)
    agent = _adapter(reg, args.agent, new=True)
    version = reg.publish(agent, args.source, metrics=metrics, parent=args.parent, promote=args.promote,
                          publisher=_publisher(args))
    print(f"{agent} v{version}{' (current)' if args.promote else ''}: {reg.path(agent, version)}")
    return 0


def _promote(args) -> int:
    reg = _registry(args)
    agent = _adapter(reg, args.agent)
    reg.promote(agent, args.version, publisher=_publisher(args))
    print(f"{agent}: v{args.version} is current")
    return 0


def _rollback(args) -> int:
    reg = _registry(args)
    agent = _adapter(reg, args.agent)
    version = reg.rollback(agent, publisher=_publisher(args))
    print(f"{agent}: rolled back to v{version}")
    return 0


def _map(args) -> int:
    from ..adapter_names import adapters_by_agent, hosted_models_by_agent

    if args.store:
        from ..store import TraceStore

        with TraceStore.open(args.store) as ts:
            episodes = list(ts.episodes())
    else:
        from ..store.files import read_jsonl_episodes

        episodes = []
        try:  # as the store's import reads a file: no line is read past the record limit
            for item in read_jsonl_episodes(args.episodes, label=args.episodes):
                if isinstance(item, RecordError):
                    raise item
                episodes.append(item)
        except OSError as e:
            raise MarftError(f"cannot read episodes {args.episodes}: {e}") from None
    reg = _registry(args)
    known = set(reg.agents())
    # A model name the registry holds is ours even where the record has no version; any other name
    # with no version (gpt-4.1-mini) is a hosted model: its calls belong to their agent's adapter.
    hosted = hosted_models_by_agent(episodes, ours=known)
    for agent, adapters in adapters_by_agent(episodes, ours=known).items():
        shown = [f"{a} (v{reg.current(a)})" if a in known and reg.current(a) else f"{a} (not in the registry)"
                 for a in adapters]
        notes = [f"{n} calls to {m}, not one of our adapters: distil them with `marft sft`"
                 for m, n in hosted.get(agent, {}).items()]
        print(f"{agent} -> {', '.join(shown)}" + "".join(f"; {x}" for x in notes))
    return 0
