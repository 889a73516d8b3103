"""``marft ui``: the read-only local web viewer."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from ..serving.http import limits as http_limits
from ..errors import MarftError


def add_commands(sub) -> None:
    p = sub.add_parser(
        "ui",
        help="read-only local web viewer: episodes, their dependency graph, tokens, rewards, runs, adapters",
        description="Serve a read-only page on which to browse the trace store's episodes (filters, counts, "
        "search; new ones appear live), one episode's dependency graph D with each action's observation, "
        "output, tokens and rewards, training runs' metrics.jsonl as plots, and the adapter registry's "
        "versions with the service's decisions. Binds 127.0.0.1; another address needs --api-key.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--store", metavar="URL", default=None,
                   help="store URL or SQLite path (default: $MARFT_STORE or ./.marft/traces.db)")
    p.add_argument("--registry", metavar="DIR", default=os.environ.get("MARFT_REGISTRY", ".marft/adapters"),
                   help="adapter registry root (env MARFT_REGISTRY); a missing one shows no adapters")
    p.add_argument("--runs", metavar="DIR", nargs="+", default=[],
                   help="directories searched for training runs (any folder holding metrics.jsonl)")
    p.add_argument("--service-state", metavar="DIR", default=None,
                   help="marft service state_dir (its decisions.jsonl is shown)")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="local tokenizer directory (e.g. the base model's) to show sampled token ids as text")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=None,
                   help="key every request must carry (also env MARFT_API_KEY); required off loopback")
    http_limits.add_flags(p, limit_concurrency=128)
    p.set_defaults(func=_ui)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _open_store(url: str | None):
    from ..store import TraceStore
    from ..store.tracestore import normalize_url

    full = normalize_url(url)
    if full.startswith("sqlite:///"):
        # A viewer must not create an empty database where the user mistyped a path.
        path = Path(full[len("sqlite:///"):])
        if not path.is_file():
            raise MarftError(f"no trace store at {path}; give --store (a SQLite path or postgresql://...)")
    return TraceStore.open(full)


def _ui(args) -> int:
    from .app import create_app

    api_key = args.api_key or os.environ.get("MARFT_API_KEY") or None
    if not is_loopback(args.host) and not api_key:
        raise MarftError(f"refusing to bind {args.host} without --api-key: the viewer shows every stored trace; "
                         "give --api-key KEY (or MARFT_API_KEY) or bind 127.0.0.1")
    for d in args.runs:
        if not os.path.isdir(d):
            raise MarftError(f"--runs {d} is not a directory")
    store = _open_store(args.store)
    registry = args.registry if os.path.isdir(args.registry) else None
    if registry is None:
        print(f"marft ui: no adapter registry at {args.registry}; the adapters view will be empty", file=sys.stderr)
    app = create_app(store, registry=registry, runs=args.runs, service_state=args.service_state, api_key=api_key,
                     tokenizer=args.tokenizer)
    print(f"marft ui: {store.url} on http://{args.host}:{args.port}/", file=sys.stderr, flush=True)
    try:
        http_limits.run(app, args)
    finally:
        store.close()
    return 0
