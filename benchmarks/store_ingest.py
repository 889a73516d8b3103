"""Ingest benchmark: actions/s written through TraceStore next to a bare ``sqlite3`` executemany of
the same rows, measured side by side in one run, and episodes/s read back.

    .venv/bin/python benchmarks/store_ingest.py [--episodes 400] [--actions 10] [--repeat 3]
        [--postgres postgresql://postgres@127.0.0.1:5432/test]   # also time the PostgreSQL backend

"bare sqlite3, same rows" inserts exactly the rows TraceStore writes (episode, agents, actions,
rewards, change log) into the same tables with the same statements, one transaction per episode,
WAL + synchronous=NORMAL, with every row serialized before the clock starts: the pure database
cost. TraceStore additionally re-validates every episode (DAG, lengths, limits), serializes it,
inserts the episode row with a check for an existing id (merge), and runs each transaction through
SQLAlchemy. "action rows only" is a one-table logger, for scale.
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def make_episodes(n: int, k: int, seed: int = 0):
    from marft_bridge.schema import Action, Episode, Message, Observation, Output, Policy, Reward, SamplingParams

    rng = random.Random(seed)
    agents = ["planner", "coder", "critic"]
    out = []
    for e in range(n):
        acts = []
        for j in range(k):
            toks = [rng.randrange(32000) for _ in range(48)]
            deps = [acts[-1].id] if acts else []
            acts.append(
                Action(
                    agent=agents[j % 3],
                    step=j,
                    observation=Observation(
                        messages=[Message(role="system", content="You are a helpful agent."),
                                  Message(role="user", content=f"task {e} step {j}: " + "x" * 160)],
                        prompt_token_ids=[rng.randrange(32000) for _ in range(64)],
                    ),
                    output=Output(text="y" * 200, token_ids=toks, logprobs=[-rng.random() for _ in toks],
                                  finish_reason="stop"),
                    sampling=SamplingParams(temperature=0.7, top_p=0.95, max_tokens=256),
                    policy=Policy(name=agents[j % 3], version=3),
                    depends_on=deps,
                )
            )
        out.append(Episode(source="bench", task={"q": e}, actions=acts, rewards=[Reward(value=1.0, source="checker")]))
    return out


def bare_sqlite_same_rows(path: Path, episodes) -> float:
    from marft_bridge.store import TraceStore
    from marft_bridge.store.rows import episode_rows

    TraceStore.open(path).close()  # the store's own tables and indexes, empty
    rows = [episode_rows(ep) for ep in episodes]
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    t0 = time.perf_counter()
    for r in rows:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("insert into marft_episodes values (:id, :source, :status, :started_at, :ended_at, :n_actions, "
                     ":n_rewards, :body)", r.episode)
        conn.executemany("insert into marft_episode_agents values (:episode_id, :agent)", r.agents)
        conn.executemany("insert into marft_actions values (:episode_id, :seq, :id, :agent, :step, :kind, :body)",
                         r.actions)
        conn.executemany("insert into marft_rewards values (:episode_id, :seq, :id, :agent, :action_id, :value, "
                         ":source, :body)", r.rewards)
        conn.execute("insert into marft_changes (episode_id, kind, created_at) values (?, 'add', ?)",
                     (r.episode["id"], time.time()))
        conn.execute("COMMIT")
    dt = time.perf_counter() - t0
    conn.close()
    return dt


def bare_sqlite_actions_only(path: Path, episodes) -> float:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("create table actions (episode_id text, seq integer, id text, agent text, step integer, "
                 "kind text, body text, primary key (episode_id, seq))")
    rows = [[(ep.id, s, a.id, a.agent, a.step, a.kind, a.model_dump_json()) for s, a in enumerate(ep.actions)]
            for ep in episodes]
    t0 = time.perf_counter()
    for r in rows:
        conn.execute("BEGIN")
        conn.executemany("insert into actions values (?, ?, ?, ?, ?, ?, ?)", r)
        conn.execute("COMMIT")
    dt = time.perf_counter() - t0
    conn.close()
    return dt


def store_write(path: Path, episodes) -> tuple[float, float]:
    from marft_bridge.store import TraceStore

    store = TraceStore.open(path)
    t0 = time.perf_counter()
    for ep in episodes:
        store.add_episode(ep)
    dt_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = sum(1 for _ in store.episodes())
    dt_read = time.perf_counter() - t0
    assert n == len(episodes)
    store.close()
    return dt_write, dt_read


def store_submit(path: Path, episodes, writer: str) -> float:
    """``submit`` + ``flush`` wall time through the writer process or the in-thread writer, after
    one warm-up episode (the writer process starts on the first submit: not timed)."""
    from marft_bridge.store import TraceStore

    store = TraceStore.open(path, writer=writer)
    store.submit(episodes[0].model_copy(update={"id": "warm-up"}))
    store.flush()
    t0 = time.perf_counter()
    for ep in episodes:
        store.submit(ep)
    store.flush()
    dt = time.perf_counter() - t0
    assert store.count() == len(episodes) + 1
    store.close()
    return dt


def store_write_postgres(url: str, episodes) -> float:
    """add_episode into a scratch schema of ``url`` (dropped afterwards)."""
    import uuid

    import sqlalchemy as sa

    from marft_bridge.store import TraceStore
    from marft_bridge.store.tracestore import normalize_url

    schema = f"marft_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(normalize_url(url))
    with admin.begin() as conn:
        conn.execute(sa.text(f'create schema "{schema}"'))
    try:
        u = sa.make_url(normalize_url(url)).update_query_dict({"options": f"-csearch_path={schema}"})
        store = TraceStore.open(u.render_as_string(hide_password=False))
        t0 = time.perf_counter()
        for ep in episodes:
            store.add_episode(ep)
        dt = time.perf_counter() - t0
        store.close()
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'drop schema "{schema}" cascade'))
        admin.dispose()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=400)
    ap.add_argument("--actions", type=int, default=10, help="actions per episode")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds; medians are reported")
    ap.add_argument("--postgres", metavar="URL", help="also write through TraceStore to this PostgreSQL server")
    args = ap.parse_args()
    episodes = make_episodes(args.episodes, args.actions)
    n_actions = args.episodes * args.actions
    res: dict[str, list[float]] = {k: [] for k in ("store", "submit", "submit_thread", "same", "actions", "read")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            # Interleaved so machine noise hits every contender alike.
            res["same"].append(bare_sqlite_same_rows(Path(tmp, f"same{r}.db"), episodes))
            w, rd = store_write(Path(tmp, f"store{r}.db"), episodes)
            res["store"].append(w)
            res["read"].append(rd)
            res["actions"].append(bare_sqlite_actions_only(Path(tmp, f"actions{r}.db"), episodes))
            res["submit"].append(store_submit(Path(tmp, f"submit{r}.db"), episodes, "process"))
            res["submit_thread"].append(store_submit(Path(tmp, f"submit-thread{r}.db"), episodes, "thread"))
            if args.postgres:
                res.setdefault("postgres", []).append(store_write_postgres(args.postgres, episodes))
    med = {k: statistics.median(v) for k, v in res.items()}
    rate = {k: n_actions / med[k] for k in ("store", "submit", "submit_thread", "same", "actions")}
    print(f"{args.episodes} episodes x {args.actions} actions, median of {args.repeat} interleaved rounds")
    print(f"  TraceStore.add_episode           {rate['store']:>9,.0f} actions/s  ({args.episodes / med['store']:,.0f} episodes/s)")
    print(f"  TraceStore.submit + flush        {rate['submit']:>9,.0f} actions/s  (writer process)")
    print(f"  the same, in-thread writer       {rate['submit_thread']:>9,.0f} actions/s")
    print(f"  bare sqlite3, same rows          {rate['same']:>9,.0f} actions/s")
    print(f"  bare sqlite3, action rows only   {rate['actions']:>9,.0f} actions/s")
    print(f"  ratio add_episode / same rows    {rate['store'] / rate['same']:.2f}   (target >= 0.5)")
    print(f"  ratio add_episode / actions only {rate['store'] / rate['actions']:.2f}")
    if args.postgres:
        pg = n_actions / statistics.median(res["postgres"])
        print(f"  TraceStore.add_episode, Postgres {pg:>9,.0f} actions/s")
    print(f"  read back (TraceStore.episodes)  {args.episodes / med['read']:>9,.0f} episodes/s "
          f"({n_actions / med['read']:,.0f} actions/s)")


if __name__ == "__main__":
    main()
