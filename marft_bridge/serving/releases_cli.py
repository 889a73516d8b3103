"""``marft releases list|show|diff|promote|rollback|verify``: team releases (``serving.releases``)."""

from __future__ import annotations

import json
import os

from ..errors import MarftError

DEFAULT_REGISTRY = os.environ.get("MARFT_REGISTRY", ".marft/adapters")


def add_commands(sub) -> None:
    rel = sub.add_parser(
        "releases", help="team releases: versioned sets of every agent's adapter, promoted and rolled back as one",
        description="A release is an immutable set {agent: adapter version} with its round, its parent, its gate "
        "score and who promoted it (stored in <registry>/.releases). `promote` and `rollback` move the whole "
        "team in one step; with --server/--vllm the versions are loaded into that running server first.")
    rs = rel.add_subparsers(dest="releases_command", metavar="ACTION", required=True)

    def common(p, server: bool = False):
        p.add_argument("--registry", default=DEFAULT_REGISTRY, help="registry root (env MARFT_REGISTRY)")
        p.add_argument("--json", action="store_true", help="print JSON")
        if server:
            g = p.add_mutually_exclusive_group()
            g.add_argument("--server", help="URL of a running `marft serve`")
            g.add_argument("--vllm", help="URL of a vLLM server (runtime LoRA updating enabled)")
            p.add_argument("--api-key", default=os.environ.get("MARFT_API_KEY"), help="server API key (env MARFT_API_KEY)")

    common(rs.add_parser("list", help="every release, the stable and canary marked"))
    p = rs.add_parser("show", help="one release: versions, round, parent, gate score, promotions, probe")
    p.add_argument("release", nargs="?", default=None, help="release id (default: the stable one)")
    common(p)
    p = rs.add_parser("diff", help="which agents changed between two releases, with their adapters' sha256")
    p.add_argument("a")
    p.add_argument("b", nargs="?", default=None, help="default: the stable release")
    common(p)
    p = rs.add_parser("promote", help="make a release stable: every agent at once")
    p.add_argument("release")
    p.add_argument("--reason", default="promoted by hand")
    common(p, server=True)
    p = rs.add_parser("rollback", help="return the whole team to the previous stable release")
    p.add_argument("--reason", default="rolled back by hand")
    common(p, server=True)
    p = rs.add_parser("verify", help="probe a server: does each adapter of the release answer as recorded?")
    p.add_argument("release", nargs="?", default=None, help="release id (default: the stable one)")
    p.add_argument("--served-names", action="store_true", help="probe <agent>@r<N> (a canary's names)")
    p.add_argument("--tolerance", type=float, default=None, help="largest |log-prob difference| accepted")
    common(p, server=True)
    rel.set_defaults(func=_releases)


def _publishers(args) -> list:
    from .publishers import EmbeddedServerPublisher, VLLMPublisher

    if getattr(args, "server", None):
        return [EmbeddedServerPublisher(args.server, args.api_key)]
    if getattr(args, "vllm", None):
        return [VLLMPublisher(args.vllm, args.api_key)]
    return []


def _releases(args) -> int:
    from .adapter_files import AdapterError
    from .releases import ReleaseStore

    try:
        store = ReleaseStore(args.registry)
        out = _ACTIONS[args.releases_command](store, args)
    except AdapterError as e:
        raise MarftError(str(e)) from None
    if args.json or not isinstance(out, str):
        print(json.dumps(out, indent=2, default=str))
    else:
        print(out)
    return 1 if isinstance(out, dict) and out.get("ok") is False else 0


def _list(store, args):
    state = store.state()
    rows = []
    for r in store.list():
        mark = "stable" if r.id == state.stable else "canary" if state.canary and r.id == state.canary["id"] else ""
        rows.append({**r.model_dump(), "status": mark})
    if args.json:
        return rows
    lines = [f"{'id':<6} {'status':<7} {'round':>5} {'parent':<6} {'gate':>9}  versions"]
    for r in rows:
        gate = f"{r['gate_score']:.4f}" if r["gate_score"] is not None else "-"
        versions = " ".join(f"{a}=v{v}" for a, v in sorted(r["versions"].items()))
        lines.append(f"{r['id']:<6} {r['status']:<7} {r['round'] if r['round'] is not None else '-':>5} "
                     f"{r['parent'] or '-':<6} {gate:>9}  {versions}")
    return "\n".join(lines) if rows else "no releases"


def _which(store, release):
    release = release or store.state().stable
    if release is None:
        raise MarftError("no stable release yet; name one")
    return release


def _show(store, args):
    rid = _which(store, args.release)
    state = store.state()
    out = store.get(rid).model_dump()
    out["promotions"] = [p for p in state.promotions if p["release"] == rid]
    out["stable"], out["probe"] = rid == state.stable, state.probes.get(rid)
    return out


def _diff(store, args):
    b = _which(store, args.b)
    rows = store.diff(args.a, b)
    if args.json:
        return {"a": store.get(args.a).model_dump(), "b": store.get(b).model_dump(), "agents": rows}
    ra, rb = store.get(args.a), store.get(b)
    lines = [f"{args.a} (gate {ra.gate_score}) -> {b} (gate {rb.gate_score})"]
    for r in rows:
        mark = "changed" if r["changed"] else "same"
        va, vb = r[args.a], r[b]
        lines.append(f"  {r['agent']:<20} v{va} -> v{vb}  {mark}  {str(r[f'{args.a}_sha256'])[:12]} -> "
                     f"{str(r[f'{b}_sha256'])[:12]}")
    return "\n".join(lines)


def _promote(store, args):
    rel = store.promote(args.release, _publishers(args), by=f"cli:{os.environ.get('USER', 'user')}",
                        reason=args.reason)
    return f"{rel.id} is stable: " + " ".join(f"{a}=v{v}" for a, v in sorted(rel.versions.items()))


def _rollback(store, args):
    rel = store.rollback(_publishers(args), by=f"cli:{os.environ.get('USER', 'user')}", reason=args.reason)
    return f"rolled back to {rel.id}: " + " ".join(f"{a}=v{v}" for a, v in sorted(rel.versions.items()))


def _verify(store, args):
    from .probe import DEFAULT_TOLERANCE, verify_release

    pubs = _publishers(args)
    if not pubs:
        raise MarftError("verify needs --server or --vllm: the server to probe")
    rid = _which(store, args.release)
    tol = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE
    return verify_release(store, rid, pubs[0].url, api_key=args.api_key, served_names=args.served_names,
                          tolerance=tol)


_ACTIONS = {"list": _list, "show": _show, "diff": _diff, "promote": _promote, "rollback": _rollback,
            "verify": _verify}
