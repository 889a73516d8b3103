"""Playing tasks through the user's app: one captured episode per run, rewarded, grouped, stored.

Each rollout runs the app under an explicit episode (the same capture as ``mb.instrument``: a LangGraph
run inside it joins it), so ``fit`` owns the record: the capture hands the finished record to a sink
here instead of the store, and ``fit`` adds the reward and the group (task id, rollout index) before one
validated ``store.add_episode``. An app run that raises or passes the timeout is stored as a failed
episode (excluded from training, counted); a reward function that raises, or names an agent the episode
does not have, leaves the episode stored without a reward (excluded, counted). Neither stops the run.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from .endpoint import rollout_seed
from .tasks import Task

log = logging.getLogger("marft_bridge.fitting")

REWARD_SOURCE = "fit"
OUTCOMES = ("ok", "failed", "timeout", "reward_error", "invalid")


class _Sink:
    """An EpisodeRecorder's store that keeps the finished record for ``fit`` to complete and write."""

    def __init__(self, limits: Any):
        self.limits = limits
        self.record: dict | None = None

    def submit_record(self, record: dict) -> None:
        self.record = record

    submit = submit_record


@dataclass
class Outcome:
    status: str  # one of OUTCOMES
    task: Task
    rollout: int
    episode: Any = None  # the stored Episode (None when the store refused it)
    reward: float | None = None  # the team reward (mean of per-agent rewards when given per agent)
    error: str | None = None


@dataclass
class Counts:
    by_status: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))

    def add(self, outcomes: list[Outcome]) -> dict[str, int]:
        for o in outcomes:
            self.by_status[o.status] += 1
        return self.by_status


def _looks_like_graph(app: Any) -> bool:
    return all(callable(getattr(app, m, None)) for m in ("invoke", "ainvoke", "stream", "astream"))


def prepare_app(app: Any, store: Any) -> Any:
    """Instrument a compiled LangGraph graph (its runs join fit's episodes); any other object with
    ``ainvoke`` or ``invoke`` is run as it is, under the raw-client captures ``mb.episode`` turns on."""
    if _looks_like_graph(app):
        from ..integrations.langgraph import instrument

        return instrument(app, store=store, source="fit")
    if not (callable(getattr(app, "ainvoke", None)) or callable(getattr(app, "invoke", None))):
        from ..errors import MarftError

        raise MarftError(f"the app factory returned a {type(app).__name__}: it needs invoke or ainvoke (a compiled "
                         "LangGraph graph, or any object with invoke/ainvoke/batch)")
    return app


async def _run_app(app: Any, inputs: dict, timeout: float | None) -> Any:
    if callable(getattr(app, "ainvoke", None)):
        call = app.ainvoke(dict(inputs))
    else:  # a sync app in a worker thread (the context, with the open episode and the seed, goes along)
        call = asyncio.to_thread(app.invoke, dict(inputs))
    return await asyncio.wait_for(call, timeout) if timeout else await call


async def _reward(fn: Callable, task: Task, output: Any) -> float | dict[str, float]:
    if inspect.iscoroutinefunction(fn):
        value = await fn(task.input, output)
    else:
        value = await asyncio.to_thread(fn, task.input, output)
        if inspect.isawaitable(value):
            value = await value
    if isinstance(value, dict):
        return {str(k): float(v) for k, v in value.items()}
    return float(value)


def _reward_records(value: float | dict[str, float], record: dict) -> tuple[list[dict], float]:
    """Reward dicts for the record and the team value (per-agent rewards: their mean). A per-agent key
    is a recorded agent (graph node) or an adapter name its calls used."""
    from ..schema import Reward

    if not isinstance(value, dict):
        return [Reward(value=value, source=REWARD_SOURCE).model_dump()], value
    by_adapter: dict[str, set[str]] = {}
    for a in record["actions"]:
        policy = a.get("policy") or {}
        name = policy.get("name") if isinstance(policy, dict) else getattr(policy, "name", None)
        by_adapter.setdefault(a["agent"], set()).add(a["agent"])
        if name:
            by_adapter.setdefault(name, set()).add(a["agent"])
    rewards = []
    for key, v in value.items():
        if key not in by_adapter:
            raise ValueError(f"the reward names agent {key!r}, which has no action in this episode "
                             f"(agents and adapters: {sorted(by_adapter)})")
        rewards += [Reward(value=v, agent=agent, source=REWARD_SOURCE).model_dump()
                    for agent in sorted(by_adapter[key])]
    if not value:
        raise ValueError("the reward function returned an empty dict")
    return rewards, sum(value.values()) / len(value)


async def play(app: Any, task: Task, rollout: int, *, seed: int | None, store: Any, source: str, meta: dict,
               reward_fn: Callable, timeout: float | None, registry: Any = None) -> Outcome:
    """One rollout of ``task``: run, reward, store (see the module docstring)."""
    from ..integrations.session import episode

    sink = _Sink(store.limits)
    output, status, error = None, "ok", None
    with rollout_seed(seed):
        try:
            with episode(store=sink, task=task.input, source=source, registry=registry):
                output = await _run_app(app, task.input, timeout)
        except asyncio.TimeoutError:
            status, error = "timeout", f"the app run passed --rollout-timeout {timeout}s"
        except Exception as e:  # noqa: BLE001 - a failing app run is an expected outcome, counted
            status, error = "failed", f"{type(e).__name__}: {e}"[:2000]
    record = dict(sink.record or {})
    reward = None
    if status == "ok":
        try:
            rewards, reward = _reward_records(await _reward(reward_fn, task, output), record)
            record["rewards"] = list(record.get("rewards") or []) + rewards
        except Exception as e:  # noqa: BLE001 - a raising reward function is counted, its episode excluded
            status, error = "reward_error", f"{type(e).__name__}: {e}"[:2000]
            log.warning("reward function failed on task %s: %s", task.id, error)
    record["metadata"] = {**(record.get("metadata") or {}), "fit": {**meta, "outcome": status, "seed": seed,
                                                                    **({"error": error} if error else {})}}
    if status == "timeout":
        record["status"] = "failed"
    record["group"] = {"task_id": task.id, "rollout": rollout}
    return await asyncio.to_thread(_store, store, record, Outcome(status, task, rollout, reward=reward, error=error))


def _store(store: Any, record: dict, outcome: Outcome) -> Outcome:
    from ..errors import RecordError

    try:
        store.add_episode(record)
        outcome.episode = store.get_episode(record["id"])
    except RecordError as e:  # dead-lettered by the store, with the reason
        outcome.status, outcome.error = "invalid", str(e)[:2000]
    return outcome


async def play_all(app: Any, jobs: list[tuple[Task, int, int | None]], *, concurrency: int,
                   on_done: Callable[[Outcome], None] | None = None, **kw: Any) -> list[Outcome]:
    """Every (task, rollout index, seed) job, at most ``concurrency`` at a time; outcomes in job order."""
    sem = asyncio.Semaphore(concurrency)

    async def one(task: Task, rollout: int, seed: int | None) -> Outcome:
        async with sem:
            out = await play(app, task, rollout, seed=seed, **kw)
        if on_done is not None:
            on_done(out)
        return out

    return list(await asyncio.gather(*(one(*j) for j in jobs)))
