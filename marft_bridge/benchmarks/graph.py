"""The relay's agents as a real LangGraph graph, instrumented: every run is captured into the store.

Node h reads only channel ``m{h}`` (the symbol it is handed; ``m0`` is the secret word) and the
episode's ``seed``, and writes ``m{h+1}``; the last node writes ``answer``. Each node asks a
:class:`BatchSampler` for its reply and records the action through the capture's framework-task
API (``episode_context.record_in_framework_task``), so step, dependency edges (from LangGraph's channel
provenance), episode and reward come from the same capture path a deployed app goes through.

The sampler is the trainer's in-process ``RolloutPolicy`` (token ids and behaviour log-probs
exactly as sampled), batched: :func:`rollout` runs all episodes of an iteration concurrently
(``ainvoke``), and the requests of one hop are sampled as one batch, rows ordered by episode seed,
from a generator seeded by the iteration's seed and the hop. Batch composition and row order do not
depend on scheduling, so a seed reproduces its episodes, and arms that share a seed draw their
secrets and their sampler's uniforms from common random numbers.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypedDict

from ..capture.episode_context import record_in_framework_task
from .relay import RelaySpec, reward

SEED_STRIDE = 16  # generator seed of hop h in a rollout: rollout_seed * SEED_STRIDE + h
FLUSH_AFTER_S = 2.0  # a hop's batch is sampled when every live run has asked, or after this long


def channel(hop: int) -> str:
    return f"m{hop}"


class BatchSampler:
    """Collects the concurrent requests of one hop and samples them as one batch.

    ``policy``: a ``RolloutPolicy`` (``act_many(agent, batch, generator=..., temperature=...)``).
    """

    def __init__(self, policy, *, temperature: float = 1.0, max_new_tokens: int = 6,
                 allowed: dict[int, list[int]] | None = None):
        self.policy, self.temperature, self.max_new_tokens = policy, temperature, max_new_tokens
        self.allowed = allowed or {}  # hop -> allowed_token_ids (its alphabet's tokens and EOS), or unmasked
        self.rollout_seed = 0
        self.live = 0  # runs in flight; a hop's batch is complete when all of them have asked
        self._pending: dict[int, list] = {}
        self._timers: dict[int, Any] = {}

    async def act(self, hop: int, agent: str, messages: list[dict], key: int):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        queue = self._pending.setdefault(hop, [])
        queue.append((key, agent, messages, fut))
        if len(queue) >= self.live:
            self._flush(hop)
        elif hop not in self._timers:  # a run that failed upstream never asks: do not wait for it forever
            self._timers[hop] = loop.call_later(FLUSH_AFTER_S, self._flush, hop)
        return await fut

    def _flush(self, hop: int) -> None:
        import torch

        timer = self._timers.pop(hop, None)
        if timer is not None:
            timer.cancel()
        queue = sorted(self._pending.pop(hop, []), key=lambda r: r[0])
        if not queue:
            return
        gen = torch.Generator().manual_seed(self.rollout_seed * SEED_STRIDE + hop)
        try:
            actions = self.policy.act_many(queue[0][1], [r[2] for r in queue], generator=gen,
                                           temperature=self.temperature, max_new_tokens=self.max_new_tokens,
                                           allowed_token_ids=self.allowed.get(hop))
        except Exception as e:  # every waiting node gets the error, none hangs
            for *_, fut in queue:
                fut.set_exception(e)
            return
        for (*_, fut), action in zip(queue, actions):
            fut.set_result(action)

    def finished_one(self) -> None:
        """A run ended: hops still waiting may now be complete."""
        self.live -= 1
        for hop, queue in list(self._pending.items()):
            if queue and len(queue) >= self.live:
                self._flush(hop)


def build_graph(spec: RelaySpec, sampler: BatchSampler):
    """The compiled chain encoder → relay(s) → decoder; ``await app.ainvoke({"m0": word, "seed": k})``
    (``seed``: the episode's index, which orders its row in every hop's batch)."""
    from langgraph.graph import END, START, StateGraph

    state_keys: dict[str, Any] = {channel(h): str for h in range(spec.hops)}
    state_keys.update(answer=str, seed=int)
    State = TypedDict("RelayState", state_keys)  # noqa: UP013 - keys are computed

    def node(hop: int):
        agent = spec.agents[hop]
        out_key = "answer" if hop == spec.hops - 1 else channel(hop + 1)

        async def act(state: dict) -> dict:
            a = await sampler.act(hop, agent, spec.messages(hop, state[channel(hop)]), int(state["seed"]))
            record_in_framework_task({"observation": a.observation, "output": a.output,
                                                "sampling": a.sampling, "policy": a.policy})
            return {out_key: a.output.text}

        return act, TypedDict(f"Hop{hop}Input", {channel(hop): str, "seed": int})

    graph = StateGraph(State)
    previous = START
    for hop, name in enumerate(spec.agents):
        fn, schema = node(hop)
        graph.add_node(name, fn, input_schema=schema)
        graph.add_edge(previous, name)
        previous = name
    graph.add_edge(previous, END)
    return graph.compile(name=f"codebook_relay_{spec.hops}")


def instrumented_graph(spec: RelaySpec, sampler: BatchSampler, store, source: str):
    """:func:`build_graph` captured into ``store`` under ``source``, with the team reward per run."""
    from ..integrations.langgraph import instrument

    return instrument(build_graph(spec, sampler), store=store, source=source,
                      reward_fn=lambda inputs, outputs: reward(inputs["m0"], (outputs or {}).get("answer")))


def rollout(app, sampler: BatchSampler, store, source: str, secrets: list[str], rollout_seed: int) -> list:
    """Run one episode per secret concurrently through the instrumented graph (episode k has
    ``seed`` k); return the captured episodes as the store holds them, in input order."""

    async def one(k: int, secret: str):
        try:
            return await app.ainvoke({"m0": secret, "seed": k})
        finally:
            sampler.finished_one()

    async def all_runs():
        sampler.live = len(secrets)
        return await asyncio.gather(*(one(k, s) for k, s in enumerate(secrets)))

    sampler.rollout_seed = rollout_seed
    cursor = store.cursor()
    asyncio.run(all_runs())
    store.flush()
    _, changed = store.changed_since(cursor)
    by_index = {}
    for ep in store.get_episodes(changed):  # chunked reads, not one query per episode
        if ep.source == source:
            by_index[int(ep.task["seed"])] = ep
    if len(by_index) != len(secrets):
        raise RuntimeError(f"{len(secrets) - len(by_index)} episodes of {source} did not reach the store")
    return [by_index[k] for k in range(len(secrets))]
