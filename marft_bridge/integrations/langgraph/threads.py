"""Checkpointed threads: what a Pregel loop's channels held when a thread's run stopped, kept per
thread and checkpoint so a later run of the thread (a resume, time travel to an older checkpoint, a
fork made with ``update_state``) starts from the provenance that checkpoint held."""

from __future__ import annotations

from typing import Any

from . import provenance as pv


class ThreadHistory:
    """What a run leaves on a checkpointed thread for the next run of the same episode there: the
    provenance of its channels, their versions then, and the tasks of the step it stopped in
    (interrupted or failed): id -> (deps, actions). Those run again on resume, with the same
    inputs, or hand back the writes they saved. For a run that starts from an older checkpoint
    (time travel), the provenance at every checkpoint the episode's runs made there (``at``)."""

    __slots__ = ("prov", "versions", "stopped", "last", "at")

    def __init__(self, st: Any):
        self.prov = st.prov
        self.versions = dict(st.loop.checkpoint["channel_versions"])
        tasks = st.run.state.tasks
        self.stopped = {tid: (t.deps, list(t.actions)) for tid in st.loop.tasks if (t := tasks.get(tid)) is not None}
        self.last = st.loop.checkpoint.get("id")
        self.at = st.snapshots or {}


def thread_key(st: Any) -> tuple[str, str] | None:
    """Where the loop's channels and the run's episode both outlive the run: (thread_id, checkpoint_ns)."""
    loop = st.loop
    conf = loop.config.get("configurable") or {}
    if st.run.scope is None or loop.checkpointer is None or conf.get("thread_id") is None:
        return None
    return str(conf["thread_id"]), conf.get("checkpoint_ns") or ""


def restore_history(st: Any) -> None:
    key = thread_key(st)
    if key is None:
        return
    # Taken, not read: the loop leaves its own history when it exits (a finished subgraph none).
    hist = st.run.scope.threads.pop(key, None)
    st.snapshots = dict(hist.at) if hist is not None else {}
    if hist is not None:
        now = st.loop.checkpoint["channel_versions"]
        older = time_travel(st, hist, key)
        if older is None:
            st.prov = pv.restore(hist.prov, hist.versions, now, st.accumulates)
            st.resumed = hist.stopped
        else:  # what the older checkpoint held then; a fork's own update moved versions as a new write does
            st.prov = pv.restore(*older, now, st.accumulates)
    snapshot(st)


def time_travel(st: Any, hist: ThreadHistory, key: tuple[str, str]) -> tuple[dict, dict] | None:
    """(provenance, versions) at the older checkpoint a root run starts from: the one its config
    names (a replay), or the nearest one the episode made among its parents (a fork ``update_state``
    wrote); nothing when none is (made before the episode). None: it goes on from the last run's."""
    asked = (st.loop.config.get("configurable") or {}).get("checkpoint_id")
    if st.parent is not None or asked is None or asked == hist.last:
        return None
    thread, ns = key
    for _ in range(64):  # a chain of forks, bounded
        if asked in hist.at:
            return hist.at[asked]
        try:  # the checkpointer's public read; an async-only saver has none here: no provenance
            saved = st.loop.checkpointer.get_tuple(
                {"configurable": {"thread_id": thread, "checkpoint_ns": ns, "checkpoint_id": asked}})
        except Exception:  # noqa: BLE001 - capture must not break the app
            saved = None
        parent = saved.parent_config if saved is not None else None
        asked = (parent or {}).get("configurable", {}).get("checkpoint_id")
        if asked is None:
            break
    return {}, {}


def snapshot(st: Any) -> None:
    """Note the provenance at the loop's current checkpoint (a later run may start from it)."""
    if st.snapshots is not None:
        ck = st.loop.checkpoint
        st.snapshots[ck.get("id")] = (dict(st.prov), dict(ck["channel_versions"]))


def save_history(st: Any, exc: BaseException | None) -> None:
    key = thread_key(st)
    if key is None or st.run.recorder.closed:
        return
    from langgraph.errors import GraphInterrupt

    # A subgraph's namespace names its parent task: only resuming that interrupted task reruns it.
    if st.parent is None or isinstance(exc, GraphInterrupt):
        st.run.scope.threads[key] = ThreadHistory(st)
