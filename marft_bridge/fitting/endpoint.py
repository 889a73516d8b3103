"""What ``FACTORY(endpoint)`` receives: where the app's agents send their model calls.

``endpoint.base_url`` is the OpenAI-compatible root (ends ``/v1``), ``endpoint.api_key`` its key and
``endpoint.model(agent)`` the model name an agent's calls must send (its adapter: the server routes each
name to that agent's live LoRA version). ``endpoint.seed`` is the sampling seed of the rollout running in
the caller's context (None outside one): an app that passes it on (``llm.invoke(msgs, seed=endpoint.seed)``)
samples reproducibly, and the validation set is replayed with the same seeds every iteration. An app that
does not still gets distinct samples per rollout (the server draws fresh randomness for unseeded requests).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

# The seed of the rollout running in this context: asyncio tasks and LangChain's executor threads copy it.
_ROLLOUT_SEED: contextvars.ContextVar[int | None] = contextvars.ContextVar("marft_fit_rollout_seed", default=None)


@contextmanager
def rollout_seed(seed: int | None) -> Iterator[None]:
    token = _ROLLOUT_SEED.set(seed)
    try:
        yield
    finally:
        _ROLLOUT_SEED.reset(token)


def current_seed() -> int | None:
    return _ROLLOUT_SEED.get()


class Endpoint:
    """The serving endpoint the app under ``fit`` talks to (see the module docstring)."""

    def __init__(self, base_url: str, api_key: str, agents: dict[str, str]):
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.api_key = api_key
        self._agents = dict(agents)  # agent -> adapter name served

    def model(self, agent: str) -> str:
        """The model name ``agent``'s calls must send: its adapter's name on the server."""
        from ..errors import MarftError

        try:
            return self._agents[agent]
        except KeyError:
            raise MarftError(f"endpoint.model({agent!r}): not one of the trained agents {sorted(self._agents)} "
                             "(--agents)") from None

    @property
    def agents(self) -> list[str]:
        return list(self._agents)

    @property
    def seed(self) -> int | None:
        """The sampling seed of the rollout running here (None outside a rollout)."""
        return current_seed()

    def __repr__(self) -> str:
        return f"Endpoint(base_url={self.base_url!r}, agents={self.agents})"
