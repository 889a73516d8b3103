"""``marft traces``: list, show, export, import, stats, doctor, dead letters and late rewards of a TraceStore."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from datetime import datetime, timedelta, timezone
from typing import Any

from ..errors import MarftError

_STORE_HELP = "store URL or SQLite path (default: $MARFT_STORE or ./.marft/traces.db; postgresql://... for PostgreSQL)"


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    store = argparse.ArgumentParser(add_help=False)
    store.add_argument("--store", metavar="URL", default=None, help=_STORE_HELP)

    filters = _filter_flags()
    p = subparsers.add_parser(
        "traces",
        help="inspect, export and import stored episodes",
        description="Inspect the Flex-POMDP episodes in a trace store, move them to and from JSONL/Parquet files, "
        "and attach late rewards.",
    )
    sub = p.add_subparsers(dest="traces_command", metavar="ACTION", required=True)

    c = sub.add_parser("list", parents=[store, filters], help="list episodes (newest first)",
                       description="List stored episodes, newest first, as a table (or JSON lines with --json).")
    c.add_argument("--limit", type=int, default=50, help="at most this many rows (default 50; 0 = all)")
    c.add_argument("--oldest-first", action="store_true", help="oldest episodes first")
    c.add_argument("--json", action="store_true", help="one JSON object per episode instead of a table")
    c.set_defaults(func=_list)

    c = sub.add_parser("show", parents=[store], help="one episode: actions, rewards and dependency graph",
                       description="Show one episode: its actions, rewards, and the dependency graph D per step "
                       "(which actions' outputs flowed into each action).")
    c.add_argument("episode_id", metavar="ID", help="the episode's id, or any unique prefix of it (4+ characters)")
    c.add_argument("--json", action="store_true", help="print the episode as JSON instead")
    c.set_defaults(func=_show)

    c = sub.add_parser("export", parents=[store, filters], help="write episodes to a JSONL or Parquet file",
                       description="Write the (filtered) episodes to PATH: JSONL (one episode a line; '-' = stdout) "
                       "or Parquet (one row an action, loadable with pandas). Lossless: import reads it back exactly.")
    c.add_argument("path", metavar="PATH")
    c.add_argument("--format", choices=["jsonl", "parquet"], help="default: from the suffix (.jsonl, .parquet)")
    c.add_argument("--limit", type=int, default=None, help="at most this many episodes")
    c.add_argument("--id", dest="ids", metavar="ID", action="append",
                   help="only this episode (its id or a unique prefix of it, 4+ characters); repeat for more")
    c.set_defaults(func=_export)

    c = sub.add_parser("import", parents=[store], help="validate and add episodes from a JSONL or Parquet file",
                       description="Validate every episode of PATH and add the valid ones (an id already stored is "
                       "merged). Refused records are kept as dead letters with the reason. Exit status 1 when any "
                       "record was refused.")
    c.add_argument("path", metavar="PATH", help="a .jsonl or .parquet file ('-' = JSONL on stdin)")
    c.add_argument("--format", choices=["jsonl", "parquet"], help="default: from the suffix")
    c.set_defaults(func=_import)

    c = sub.add_parser("stats", parents=[store], help="counts per agent and source, rewards, dead letters",
                       description="Counts of episodes, actions, rewards and dead letters, per agent and per source.")
    c.add_argument("--json", action="store_true", help="print JSON instead of tables")
    c.set_defaults(func=_stats)

    c = sub.add_parser("doctor", parents=[store], help="find stored episodes that cannot be read back; move them aside",
                       description="Read every stored episode. One that cannot be read back (a row written by hand "
                       "or damaged) is moved to the dead letters, whole, with the reason, each in one transaction, so "
                       "reads, export, training and marft ui go on without it (they also skip and move such a row "
                       "when they meet it). Readable episodes past the current record limits are listed and kept. "
                       "Exit status 1 when --dry-run found unreadable episodes.")
    c.add_argument("--dry-run", action="store_true", help="only list what is wrong; move nothing")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=_doctor)

    c = sub.add_parser("dead-letters", parents=[store], help="refused records and why",
                       description="Records the store refused, newest first, with the reason.")
    c.add_argument("--limit", type=int, default=20, help="at most this many (default 20; 0 = all)")
    c.add_argument("--raw", action="store_true", help="also print each raw record")
    c.set_defaults(func=_dead_letters)

    c = sub.add_parser("reward", parents=[store], help="attach a (late) reward to a stored episode",
                       description="Attach a reward to an episode: the whole team by default, or one agent or action.")
    c.add_argument("episode_id", metavar="ID", help="the episode's id, or any unique prefix of it (4+ characters)")
    c.add_argument("value", type=float)
    c.add_argument("--agent", help="reward this agent only")
    c.add_argument("--action", dest="action_id", help="reward this action only")
    c.add_argument("--source", default="user", help="who gave it (default: user)")
    c.set_defaults(func=_reward)


def _filter_flags() -> argparse.ArgumentParser:
    """The filter flags of list and export (an EpisodeFilter's fields), as a parent parser."""
    filters = argparse.ArgumentParser(add_help=False)
    g = filters.add_argument_group("filters")
    g.add_argument("--source", help="only episodes from this source (langgraph, mcp, a2a, manual, ...)")
    g.add_argument("--agent", help="only episodes in which this agent took part")
    g.add_argument("--since", metavar="TIME", help="started at or after TIME: ISO date/time (UTC if no zone) or an age like 30m, 6h, 7d")
    g.add_argument("--until", metavar="TIME", help="started before TIME (same forms as --since)")
    r = g.add_mutually_exclusive_group()
    r.add_argument("--rewarded", dest="has_reward", action="store_const", const=True, default=None,
                   help="only episodes with at least one reward")
    r.add_argument("--unrewarded", dest="has_reward", action="store_const", const=False, help="only episodes without rewards")
    return filters


# -- handlers ----------------------------------------------------------------------------------


def _open(args, create: bool = False):
    import sqlalchemy as sa

    from .tracestore import TraceStore, normalize_url

    url = normalize_url(args.store)
    u = sa.make_url(url)
    # Reading commands must not leave an empty database behind a typo'd path.
    if not create and u.get_backend_name() == "sqlite" and u.database and not os.path.exists(u.database):
        raise MarftError(f"no trace store at {u.database} (nothing captured yet? pass --store or set MARFT_STORE)")
    return TraceStore.open(url)


def _console():
    from rich.console import Console

    # Full episode ids must stay copyable when the output is piped.
    return Console(width=None if sys.stdout.isatty() else max(160, int(os.environ.get("COLUMNS", 0) or 0)),
                   highlight=False)


def _filter(args, **more: Any):
    """The EpisodeFilter of the filter flags, with ``more`` of its fields (limit, order, ids)."""
    from .filters import EpisodeFilter

    return EpisodeFilter(source=args.source, agent=args.agent, since=parse_time(args.since, "--since"),
                         until=parse_time(args.until, "--until"), has_reward=args.has_reward, **more)


def parse_time(text: str | None, flag: str = "--since") -> datetime | None:
    """An ISO date/time (UTC when it names no zone) or an age (30m, 6h, 7d) as an aware datetime."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}[m.group(2)]
        return datetime.now(timezone.utc) - timedelta(**{unit: float(m.group(1))})
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise MarftError(f"{flag} {text!r}: expected an ISO date/time (2025-01-31, 2025-01-31T12:00+02:00) or an age (30m, 6h, 7d)") from None
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def _when(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, (int, float)):
        x = datetime.fromtimestamp(x, timezone.utc)
    return x.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _list(args) -> int:
    with _open(args) as store:
        rows = store.episode_rows(_filter(args, limit=args.limit or None, newest_first=not args.oldest_first))
        total = store.count(_filter(args))
    if args.json:
        for r in rows:
            r["started_at"] = _when(r["started_at"])
            r["ended_at"] = _when(r["ended_at"]) if r["ended_at"] is not None else None
            print(json.dumps(r))
        return 0
    from rich.table import Table

    table = Table(title=f"{len(rows)} of {total} episode(s) in {store.url}", title_justify="left")
    table.add_column("id", no_wrap=True)
    table.add_column("started (UTC)", no_wrap=True)
    table.add_column("source")
    table.add_column("status")
    table.add_column("agents")
    table.add_column("actions", justify="right")
    table.add_column("rewards", justify="right")
    for r in rows:
        table.add_row(r["id"], _when(r["started_at"]), r["source"], r["status"], ", ".join(r["agents"]),
                      str(r["n_actions"]), str(r["n_rewards"]))
    _console().print(table)
    return 0


def _show(args) -> int:
    with _open(args) as store:
        ep = store.get_episode(args.episode_id)
    if args.json:
        print(ep.model_dump_json(indent=2))
        return 0
    from rich.table import Table
    from rich.tree import Tree

    console = _console()
    team = ep.team_reward()
    console.print(f"[bold]episode[/bold] {ep.id}")
    console.print(f"  source {ep.source}   status {ep.status}   started {_when(ep.started_at)}   ended {_when(ep.ended_at)}")
    console.print(f"  agents {', '.join(ep.agents) or '-'}   team reward {team if team is not None else '-'}")
    if ep.task is not None:
        console.print(f"  task {_preview(json.dumps(ep.task, ensure_ascii=False), 120)}", markup=False)

    short = {a.id: f"#{k}" for k, a in enumerate(ep.actions)}
    table = Table(title=f"{len(ep.actions)} action(s)", title_justify="left")
    for col in ("#", "id", "agent", "step", "kind", "depends on", "policy", "tokens", "output"):
        table.add_column(col, no_wrap=col in ("#", "id"))
    for k, a in enumerate(ep.actions):
        policy = f"{a.policy.name}" + (f" v{a.policy.version}" if a.policy and a.policy.version is not None else "") if a.policy else "-"
        ntok = len(a.output.token_ids) if a.output.token_ids is not None else "-"
        table.add_row(f"#{k}", a.id, a.agent, str(a.step), a.kind, " ".join(short[d] for d in a.depends_on) or "-",
                      policy, str(ntok), _output_text(a))
    console.print(table)

    if ep.rewards:
        rt = Table(title=f"{len(ep.rewards)} reward(s)", title_justify="left")
        for col in ("value", "for", "source", "at (UTC)"):
            rt.add_column(col)
        for r in ep.rewards:
            target = f"action {short.get(r.action_id, r.action_id)}" if r.action_id else f"agent {r.agent}" if r.agent else "team"
            rt.add_row(repr(r.value), target, r.source, _when(r.created_at))
        console.print(rt)

    by_id = {a.id: a for a in ep.actions}
    tree = Tree("[bold]dependency graph[/bold] (D: whose output flowed into each action)")
    for step in ep.steps():
        branch = tree.add(f"step {step}")
        for a in ep.topological_order():
            if a.step != step:
                continue
            node = branch.add(f"{short[a.id]} {a.agent} ({_kind_text(a)})")
            for d in a.depends_on:
                node.add(f"<- {short[d]} {by_id[d].agent} (step {by_id[d].step})")
    console.print(tree)
    return 0


def _call_text(call: dict) -> str:
    """A tool call as ``name(k=v, ...)``, arguments as JSON values."""
    from ..chat_template import template_tool_call

    fn = template_tool_call(call)["function"]
    args = fn["arguments"]
    inner = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items()) \
        if isinstance(args, dict) else str(args)
    return f"{fn['name'] or '?'}({inner})"


def _tool_call_of(a) -> dict | None:
    """The call a tool step ran (recorded as the assistant tool call in its observation), or None."""
    calls = [c for m in a.observation.messages for c in (m.tool_calls or ())]
    return calls[-1] if calls else None


def _kind_text(a) -> str:
    call = _tool_call_of(a) if a.kind == "tool" else None
    name = call and (call.get("function") or {}).get("name")
    return f"tool {name}" if name else a.kind


def _output_text(a) -> str:
    """The output column: an llm action's text and the tool calls it made (``-> add(a=2, b=3)``); a tool
    step's call and its result (``add(a=2, b=3) = 5``) or error; else the text or error."""
    if a.kind == "tool" and (tool_call := _tool_call_of(a)) is not None:
        call = _call_text(tool_call)
        goto = a.metadata.get("handoff.goto")
        handoff = f" (handoff -> {goto})" if goto else ""
        return _preview(f"{call} ! error: {a.error}" if a.error else f"{call} = {a.output.text}{handoff}", 100)
    if a.error:
        return _preview(f"error: {a.error}", 60)
    calls = ", ".join(_call_text(c) for c in a.output.tool_calls or ())
    text = _preview(a.output.text, 60)
    return _preview(" ".join(p for p in (text, calls and f"-> {calls}") if p), 100)


def _preview(text: str | None, n: int) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _export(args) -> int:
    with _open(args) as store:
        ids = None if args.ids is None else [store.resolve_id(i) for i in args.ids]
        n = store.export(args.path, format=args.format, where=_filter(args, limit=args.limit, ids=ids))
        skipped = store.unreadable_skipped
    if args.path != "-":
        print(f"exported {n} episode(s) to {args.path}")
    if skipped:
        print(f"skipped {skipped} stored episode(s) that cannot be read back; they were moved to the dead letters "
              "(marft traces dead-letters; marft traces doctor checks the whole store)", file=sys.stderr)
    return 0


def _import(args) -> int:
    with _open(args, create=True) as store:
        report = store.import_(args.path, format=args.format)
    print(f"imported {args.path}: {report.added} added, {report.refused} refused")
    for r in report.refusals[:20]:
        print(f"  refused {r.reason}")
    if report.refused > 20:
        print(f"  ... and {report.refused - 20} more (marft traces dead-letters)")
    return 1 if report.refused else 0


def _stats(args) -> int:
    with _open(args) as store:
        s = store.stats()
    if args.json:
        print(json.dumps(s, default=str, indent=2))
        return 0
    from rich.table import Table

    console = _console()
    console.print(f"[bold]{s['url']}[/bold]")
    console.print(
        f"  {s['episodes']} episode(s) ({s['episodes_with_reward']} rewarded), {s['actions']} action(s), "
        f"{s['rewards']} reward(s), {s['dead_letters']} dead letter(s)"
    )
    if s["quarantined"]:
        console.print(f"  {s['quarantined']} unreadable stored episode(s) were moved to the dead letters "
                      "(marft traces doctor)")
    console.print(f"  first started {_when(s['first_started_at'])}, last started {_when(s['last_started_at'])}")
    if s["agents"]:
        t = Table(title="per agent", title_justify="left")
        t.add_column("agent")
        t.add_column("episodes", justify="right")
        t.add_column("actions", justify="right")
        for name, c in s["agents"].items():
            t.add_row(name, str(c["episodes"]), str(c["actions"]))
        console.print(t)
    if s["sources"]:
        t = Table(title="per source", title_justify="left")
        t.add_column("source")
        t.add_column("episodes", justify="right")
        for name, c in s["sources"].items():
            t.add_row(name, str(c))
        console.print(t)
    return 0


def _doctor(args) -> int:
    import time

    last = [time.monotonic()]

    def progress(done: int, total: int) -> None:
        if done == total or time.monotonic() - last[0] > 2:
            last[0] = time.monotonic()
            print(f"  checked {done} of {total} episode(s)", file=sys.stderr, flush=True)

    with _open(args) as store:
        report = store.doctor(dry_run=args.dry_run, progress=None if args.json else progress)
        url = store.url
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        print(f"{url}: {report}")
        verb = "would move" if report.dry_run else "moved"
        for f in report.unreadable:
            print(f"  unreadable, {verb} to the dead letters: episode {f.episode_id}: {f.reason}")
        for f in report.over_limits:
            print(f"  past the record limits (readable, kept): episode {f.episode_id}: {f.reason}")
    return 1 if report.dry_run and report.unreadable else 0


def _dead_letters(args) -> int:
    with _open(args) as store:
        letters = store.dead_letters(limit=args.limit or None, raw_chars=2000 if args.raw else 0)
    if not letters:
        print("no dead letters")
        return 0
    from rich.table import Table

    t = Table(title=f"{len(letters)} dead letter(s), newest first", title_justify="left")
    for col in ("#", "at (UTC)", "record", "field", "reason"):
        t.add_column(col)
    for d in letters:
        t.add_row(str(d.seq), _when(d.created_at), d.record or "-", d.field or "-", d.reason)
    console = _console()
    console.print(t)
    if args.raw:
        for d in letters:
            console.print(f"#{d.seq}: {_preview(d.raw, 2000)}", markup=False)
    return 0


def _reward(args) -> int:
    with _open(args) as store:
        from .records import EpisodeNotFound

        try:
            eid = store.resolve_id(args.episode_id)
        except EpisodeNotFound:  # add_reward refuses it, and keeps the refused reward as a dead letter
            eid = args.episode_id
        r = store.add_reward(eid, args.value, agent=args.agent, action_id=args.action_id, source=args.source)
    print(f"reward {r.id} ({r.value!r}) added to episode {eid}")
    return 0
