"""``marft_bridge.episode`` and ``marft_bridge.capture``: the entry points that compose the capture hooks.

``recording`` knows nothing of integrations (data flows integrations -> recording), so these two
install the hooks that are available and then enter the recording layer:

``episode(store=None, task=None, source="manual", metadata=None, registry=None)``
    Instruments the raw-client captures (the ``openai`` client when the package is installed; the
    OpenAI Agents SDK when ``agents`` is imported) and enters ``recording.episode``: every call of
    those clients inside the block is an action of this episode (see ``integrations.openai``), in a
    fresh process too. The captures stay instrumented for the process after the block (their hooks
    record nothing outside an episode or run; re-applying them per block would cost each block tens
    of microseconds): ``integrations.openai.uninstrument()`` / ``openai_agents.uninstrument()``
    restore the libraries.

``capture(store=None, reward_fn=None, source="langgraph", registry=None)``
    ``with capture(...) as c:`` records every top-level run started in the block, one episode per
    run (``c.episode_ids``, in finishing order). A top-level run is a root LangGraph graph run
    (``integrations.langgraph.capture``; subgraphs and nested graphs are part of it) or an OpenAI
    Agents SDK trace (one ``Runner.run*`` call, or all runs of one ``agents.trace(...)`` block;
    ``integrations.openai_agents``). Runs inside ``episode(...)`` join that episode instead. Raw
    client calls outside any run and any episode open nothing: there is no run to group them by
    (wrap them in ``episode(...)``). ``source`` names LangGraph episodes; Agents SDK episodes have
    ``source="openai_agents"``. Works as ``async with`` too.

The Agents SDK is hooked when ``agents`` has been imported before the block is entered (importing
it costs seconds, so capture never does); otherwise call ``integrations.openai_agents.instrument()``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from . import INTEGRATIONS
from ..capture import recording
from ..capture.episode_context import OPEN_CAPTURE
from ..capture_errors import guarded
from ..seams import EpisodeSink, RegistryRef

def instrument_clients() -> None:
    """Instrument, for the process, the integrations the table marks for ``episode``/``capture`` blocks
    (``integrations.INTEGRATIONS``: ``session``) whose library is present (idempotent; never raises
    into the app)."""
    for it in INTEGRATIONS:
        if it.session is None or it.import_name is None:
            continue
        with guarded(f"session.install.{it.name}"):
            present = it.import_name in sys.modules or (
                it.session == "installed" and importlib.util.find_spec(it.import_name) is not None)
            if present:
                importlib.import_module(it.module).instrument()


@contextmanager
def episode(
    store: EpisodeSink | None = None,
    task: Any = None,
    source: str = "manual",
    metadata: dict[str, Any] | None = None,
    registry: RegistryRef | None = None,
) -> Iterator[recording.EpisodeRecorder]:
    """Group everything captured in the block into one Episode (``recording.episode``), with the
    raw-client captures instrumented (see the module docstring)."""
    instrument_clients()
    with recording.episode(store=store, task=task, source=source, metadata=metadata, registry=registry) as rec:
        yield rec


def _langgraph_capture() -> Any:
    try:
        from .langgraph import capture as lg_capture
    except ImportError:  # langgraph / langchain-core not installed: no graph runs to capture
        return None
    return lg_capture


class capture:
    """``with capture(store=...) as c:`` records every top-level run started in the block (see the
    module docstring). ``c.episode_ids``: the episodes this block recorded, in finishing order."""

    def __init__(self, store: EpisodeSink | None = None, reward_fn: Callable[[Any, Any], float] | None = None,
                 source: str = "langgraph", registry: RegistryRef | None = None):
        self.store, self.reward_fn, self.source, self.registry = store, reward_fn, source, registry
        self.episode_ids: list[str] = []
        lg = _langgraph_capture()
        self.langgraph = lg(store, reward_fn, source, registry) if lg is not None else None
        if self.langgraph is not None:
            self.langgraph.episode_ids = self.episode_ids  # one list, in finishing order
        self._token: Any = None

    def __enter__(self) -> capture:
        instrument_clients()
        if self.langgraph is not None:
            self.langgraph.__enter__()
        self._token = OPEN_CAPTURE.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        OPEN_CAPTURE.reset(self._token)
        if self.langgraph is not None:
            self.langgraph.__exit__(*exc)

    async def __aenter__(self) -> capture:
        return self.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        self.__exit__(*exc)


__all__ = ["capture", "episode", "instrument_clients"]
