"""Episodes (``episode``, ``implicit_episode``) and the recorder every capture adapter writes through.

Adapters (LangGraph, OpenAI client, MCP, A2A, OpenTelemetry) never build an ``Episode`` by hand:
they find or open an ``EpisodeRecorder`` and call ``record_action``; the recorder assigns ids and
steps, checks dependencies, and at the end submits the episode record (a dict, unvalidated) to the
store's bounded background queue; the store's writer process validates it, off the app's GIL. Capture must never break the application, so adapters wrap their own
work in ``guarded(...)`` (``capture_errors``): an exception there is logged and counted, never
raised into the app.

API
---
``episode(store=None, task=None, source="manual", metadata=None, registry=None)``
    Context manager opening an explicit episode; yields its ``EpisodeRecorder``. Every capture
    inside it (LangGraph runs, MCP calls, A2A messages, OpenAI calls) joins this episode. The
    episode is current for the block's thread and for asyncio tasks and LangChain/LangGraph worker
    threads started inside it (they copy the context). A plain ``threading.Thread`` does not copy
    context: run its target with ``ep.wrap(fn)`` or inside ``with ep.activate():``. On exit the
    episode is finished (status "failed" if the block raised) and submitted. ``store=None`` uses
    the enclosing episode's store, else ``TraceStore.open()`` (./.marft/traces.db). ``registry``:
    the adapter registry (root or ``AdapterRegistry``) whose live versions label calls that name
    none (vLLM responses); ``None`` takes the enclosing episode's. Per episode, not process-wide.

``implicit_episode(store=None, source=..., task=None, metadata=None, registry=None)``
    For adapters: yields ``(recorder, owned)``. Joins the current episode when one is open
    (``owned`` False: the caller must not finish it); otherwise opens a new one for this run,
    makes it current, and finishes + submits it on exit (``owned`` True).

``EpisodeRecorder`` (thread-safe)
    ``.id``, ``.store``, ``.source``, ``.task``, ``.closed``, ``.registry`` (the adapter registry its
    calls are labelled from, or None; capture integrations read it when a request goes out)
    ``record_action(agent, *, kind="llm", step=None, observation=None, output=None,
    sampling=None, policy=None, depends_on=(), error=None, started_at=None, ended_at=None,
    metadata=None, token_source=None, action_id=None, validate=True) -> str`` records one Action
    and returns its id (invalid input raises a pydantic ``ValidationError``; ``validate=False``
    leaves validation to the store). ``observation``/``output``/``sampling``/``policy`` take
    schema objects or dicts.
    ``step=None`` means "after everything recorded so far" (max step + 1, or 0). Dependencies on
    unknown ids are dropped and counted as capture errors; a step lower than a dependency's step
    is raised to it (the schema requires deps from the same or an earlier step).
    ``new_action_id()`` reserves an id to pass as ``action_id`` later.
    ``reward(value, agent=None, action_id=None, source="unknown", metadata=None)``: before the
    episode is finished the reward travels with it; afterwards it goes to ``store.add_reward``.
    ``producers_of(texts)``: ids of actions whose output text occurs in one of ``texts`` (a
    message-flow dependency rule for protocols without a graph).
    ``set_task(task)``, ``max_step()``, ``actions()`` (a snapshot), ``action_links()`` (the
    unvalidated ``(kind, agent, step, id, depends_on)`` of each action), ``last_action_id(agent=None)``,
    ``activate()``, ``wrap(fn)``, ``integration_data`` (a dict each capture integration keeps its
    per-episode state in, under its own key), ``finish(status="completed", error=None)`` (idempotent; submits
    the episode record to the store, which validates it in its writer (a process) and dead-letters it
    with the reason if it is invalid), ``episode`` (the finished ``Episode``, validated on demand).

``jsonable(obj)``: a JSON-safe copy of an app input/output (what ``Episode.task`` holds).

Listeners
    ``add_episode_listener(fn)`` / ``remove_episode_listener(fn)``: ``fn(episode)`` is called
    with every finished episode (the OpenTelemetry span emitter uses it). The listeners are an
    ``episode_context`` capture state: it exists while one is added.

Error accounting (``guarded``, ``capture_error``, ``capture_stats``, ``reset_capture_stats``) lives
in ``capture_errors``; ``capture_stats`` and ``reset_capture_stats`` are importable from here too
(the README names them here). ``current_episode``, the framework-task lookups
(``record_in_framework_task``, ...) and the instrumented integrations' states (``Instrumentor``,
``CaptureState``) live in ``episode_context``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from ..capture_errors import capture_error
from ..capture_errors import capture_stats, reset_capture_stats  # noqa: F401 - public here too (README)
from . import episode_context
from .episode_context import CURRENT_EPISODE, current_episode
from .messages import occurs_in, output_forms
from ..schema import Action, Episode, Observation, Output, Policy, Reward, SamplingParams, utcnow
from ..seams import EpisodeSink, RegistryRef
from .values import add_episode_listener, remove_episode_listener  # noqa: F401 - public here too
from .values import dumped, fast_id, jsonable, resolve_store, unicode_repaired


# -- the recorder --------------------------------------------------------------------------------


class EpisodeRecorder:
    """Collects the actions and rewards of one episode; thread-safe; submits on ``finish``."""

    def __init__(
        self,
        store: EpisodeSink | None = None,
        *,
        task: Any = None,
        source: str = "manual",
        metadata: dict[str, Any] | None = None,
        episode_id: str | None = None,
        registry: RegistryRef | None = None,
        limits: Any = None,
    ):
        self.id = episode_id or fast_id()
        self._store = store
        # The record limits validations here use: given, else the store's (``TraceStore.limits``), else
        # the defaults; so what this store would take is never refused here first.
        self._limits = limits
        self.registry = registry
        self.task = jsonable(task) if task is not None else None
        self.source = source
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.release: str | None = None  # the team release the episode was pinned to (capture.routing)
        self.started_at = utcnow()
        self.closed = False
        self._lock = threading.Lock()
        # Actions are kept as plain dicts; the store validates the finished episode in its writer
        # process, so the app's thread pays for neither a validation nor a model dump.
        self._actions: list[dict[str, Any]] = []
        self._index: dict[str, dict[str, Any]] = {}
        self._answers: dict[str, str] = {}  # tool_call_id -> the latest tool step that ran it
        self._rewards: list[Reward] = []
        self._errors = 0
        self._data: dict[str, Any] | None = None
        self._episode: Episode | None = None
        self._invalid = False
        # What each capture integration keeps about this episode, by integration (it goes with the
        # recorder: a tool-call index, the runs' shared history).
        self.integration_data: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"EpisodeRecorder(id={self.id!r}, source={self.source!r}, actions={len(self._actions)})"

    @property
    def store(self) -> Any:
        # Resolved lazily: an episode that records nothing never opens the default database.
        self._store = resolve_store(self._store)
        return self._store

    # -- recording -------------------------------------------------------------------------------

    @staticmethod
    def new_action_id() -> str:
        return fast_id()

    def set_task(self, task: Any) -> None:
        if self.task is None and task is not None:
            self.task = jsonable(task)

    def record_action(
        self,
        agent: str,
        *,
        kind: str = "llm",
        step: int | None = None,
        observation: Observation | dict | None = None,
        output: Output | dict | None = None,
        sampling: SamplingParams | dict | None = None,
        policy: Policy | dict | None = None,
        depends_on: Any = (),
        error: str | None = None,
        started_at: datetime | None = None,
        ended_at: datetime | None = None,
        metadata: dict[str, Any] | None = None,
        token_source: str | None = None,
        action_id: str | None = None,
        validate: bool = True,
    ) -> str:
        """Record one action and return its id (see the module docstring).

        ``validate=False`` skips validation here (the store validates the finished episode); the
        LangGraph capture uses it on its hot path for data it built itself.
        """
        data: dict[str, Any] = {
            "id": action_id or fast_id(), "agent": agent, "kind": kind, "token_source": token_source,
            "error": error, "started_at": started_at, "ended_at": ended_at or utcnow(), "metadata": metadata or {},
        }
        # Plain dicts (what the capture hot path passes) are taken as they are.
        if observation is not None:
            data["observation"] = observation if type(observation) is dict else dumped(observation)
        if output is not None:
            data["output"] = output if type(output) is dict else dumped(output)
        if sampling is not None:
            data["sampling"] = sampling if type(sampling) is dict else dumped(sampling)
        if policy is not None:
            data["policy"] = policy if type(policy) is dict else dumped(policy)
        with self._lock:
            if self.closed:
                raise RuntimeError(f"episode {self.id} is already finished")
            index = self._index
            deps: list[str] = []
            dep_step = 0
            for d in dict.fromkeys(depends_on) if depends_on else ():
                a = index.get(d)
                if a is not None:
                    deps.append(d)
                    if a["step"] > dep_step:
                        dep_step = a["step"]
                else:
                    capture_error("recording.depends_on", LookupError(f"unknown action id {d!r}"), None)
                    self._errors += 1
            if step is None:
                step = (max(a["step"] for a in self._actions) + 1) if self._actions else 0
            data["step"] = step if step >= dep_step else dep_step
            data["depends_on"] = deps
            if validate:
                data = self._validated(data)
            if data["id"] in self._index:
                raise ValueError(f"duplicate action id {data['id']!r}")
            self._actions.append(data)
            self._index[data["id"]] = data
            if kind == "tool" and (call_id := data["metadata"].get("tool_call_id")):
                self._answers[str(call_id)] = data["id"]
            return data["id"]

    def _validated(self, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` once the record model takes it (one pass; raises the model's errors). Text that
        is not valid Unicode (a lone surrogate from a decoder's ``surrogateescape``) is repaired,
        not a reason to lose the action: U+FFFD in its place, said in ``metadata["text_repaired"]``."""
        try:
            Action.model_validate(data, context=self._context())
            return data
        except ValidationError as e:
            if not any(err.get("type") == "string_unicode" for err in e.errors()):
                raise
        data = unicode_repaired(data)
        data["metadata"]["text_repaired"] = "invalid Unicode (lone surrogates) replaced with U+FFFD"
        Action.model_validate(data, context=self._context())
        return data

    def reward(
        self,
        value: float,
        agent: str | None = None,
        action_id: str | None = None,
        source: str = "unknown",
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """A team reward (no agent/action), an agent's reward, or one action's reward."""
        if self.closed:
            # The episode may still sit in the write queue; the store can only reward a stored one.
            self.store.flush()
            self.store.add_reward(self.id, value, agent=agent, action_id=action_id, source=source)
            return
        r = Reward(value=value, agent=agent, action_id=action_id, source=source, metadata=metadata or {})
        with self._lock:
            known = {a["agent"] for a in self._actions}
            if agent is not None and agent not in known:
                raise ValueError(f"agent {agent!r} has no action in episode {self.id}; known agents: {sorted(known)}")
            if action_id is not None and action_id not in self._index:
                raise ValueError(f"action {action_id!r} is not part of episode {self.id}")
            self._rewards.append(r)

    # -- reading ---------------------------------------------------------------------------------

    def actions(self) -> list[Action]:
        """The recorded actions as validated ``Action`` records."""
        with self._lock:
            raw = list(self._actions)
        ctx = self._context()
        return [Action.model_validate(a, context=ctx) for a in raw]

    def action_links(self) -> list[tuple[str, str, int, str, list[str]]]:
        """``(kind, agent, step, id, depends_on)`` of each recorded action, in order: the graph
        without the payloads, unvalidated (``actions()`` validates each one: too slow for per-call
        protocol hooks)."""
        with self._lock:
            return [(a["kind"], a["agent"], a["step"], a["id"], list(a["depends_on"])) for a in self._actions]

    def get_action(self, action_id: str) -> Action | None:
        raw = self._index.get(action_id)
        return Action.model_validate(raw, context=self._context()) if raw is not None else None

    def _context(self) -> dict[str, Any] | None:
        limits = self._limits if self._limits is not None else getattr(self._store, "limits", None)
        return {"limits": limits} if limits is not None else None

    def max_step(self) -> int | None:
        with self._lock:
            return max((a["step"] for a in self._actions), default=None)

    def last_action_id(self, agent: str | None = None) -> str | None:
        with self._lock:
            for a in reversed(self._actions):
                if agent is None or a["agent"] == agent:
                    return a["id"]
        return None

    def tool_call_asker(self, name: str, arguments: Any) -> tuple[str, str, int, str | None] | None:
        """``(action id, agent, step, tool_call_id)`` of the latest model call that asked for tool
        ``name`` with these arguments and that no recorded tool step answers yet (by tool_call_id);
        None when no recorded call asked for it."""
        from .messages import canonical_arguments

        key = canonical_arguments(arguments)
        with self._lock:
            llms = [a for a in self._actions if a["kind"] == "llm"]
            answered = set(self._answers)
        for a in reversed(llms):
            for c in (a.get("output") or {}).get("tool_calls") or ():
                fn = c.get("function") or {}
                if fn.get("name") == name and c.get("id") not in answered and \
                        canonical_arguments(fn.get("arguments")) == key:
                    return a["id"], a["agent"], a["step"], c.get("id")
        return None

    def tool_step_of(self, call_id: str) -> str | None:
        """The latest recorded tool step that ran tool call ``call_id`` (its ``metadata["tool_call_id"]``)."""
        return self._answers.get(str(call_id))

    def producers_of(self, texts: Any) -> list[str]:
        """Ids of recorded actions whose non-empty output text occurs in one of ``texts`` (message flow)."""
        texts = [t for t in texts if t]
        with self._lock:
            outs = [(a["id"], str((a.get("output") or {}).get("text") or "")) for a in self._actions]
        return [aid for aid, out in outs if occurs_in(output_forms(out), texts)]

    def count_error(self, msg: str) -> None:
        """Count a capture error of this episode (``capture_error`` calls it)."""
        with self._lock:
            self._errors += 1
            self.metadata["last_capture_error"] = msg[:500]

    # -- context ---------------------------------------------------------------------------------

    @contextmanager
    def activate(self) -> Iterator[EpisodeRecorder]:
        """Make this episode current in this thread / task for the block."""
        token = CURRENT_EPISODE.set(self)
        try:
            yield self
        finally:
            CURRENT_EPISODE.reset(token)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` wrapped to run with this episode current (for plain threads)."""

        def run(*args: Any, **kwargs: Any) -> Any:
            with self.activate():
                return fn(*args, **kwargs)

        return run

    # -- finishing -------------------------------------------------------------------------------

    def finish(self, status: str = "completed", error: str | None = None) -> Episode | dict | None:
        """Submit the episode once (idempotent). Returns the submitted record.

        Validation happens in the store (a refused episode is dead-lettered there with the reason);
        ``.episode`` gives the validated ``Episode`` on demand, and listeners receive it.
        """
        with self._lock:
            if self.closed:
                return self._data
            self.closed = True
            meta = dict(self.metadata)
            if self._errors:
                meta["capture_errors"] = self._errors
            if error:
                meta["error"] = error[:2000]
            data = {
                "id": self.id, "source": self.source, "task": self.task, "actions": list(self._actions),
                "rewards": [r.model_dump() for r in self._rewards], "status": status,
                "started_at": self.started_at, "ended_at": utcnow(), "metadata": meta, "release": self.release,
            }
            self._data = data
        try:
            store = self.store
            # A TraceStore takes its capture's records without walking them for keys (submit_record).
            getattr(store, "submit_record", store.submit)(data)
        except Exception as e:  # noqa: BLE001 - the store must not break the app either
            capture_error("recording.submit", e)
        if episode_context.listening():
            ep = self.episode
            if ep is not None:
                episode_context.episode_finished(ep)
        return data

    @property
    def episode(self) -> Episode | None:
        """The finished episode, validated (None before ``finish`` or when it is invalid)."""
        if self._episode is None and self._data is not None and not self._invalid:
            try:
                self._episode = Episode.model_validate(self._data, context=self._context())
            except Exception as e:  # noqa: BLE001 - the store refuses and dead-letters it too
                self._invalid = True
                capture_error("recording.finish", e)
        return self._episode


# -- context managers ----------------------------------------------------------------------------


@contextmanager
def episode(
    store: EpisodeSink | None = None,
    task: Any = None,
    source: str = "manual",
    metadata: dict[str, Any] | None = None,
    registry: RegistryRef | None = None,
) -> Iterator[EpisodeRecorder]:
    """Group everything captured in the block into one Episode (see the module docstring)."""
    parent = current_episode()
    if parent is not None:
        store = parent._store if store is None else store
        registry = parent.registry if registry is None else registry
    meta = dict(metadata or {})
    if parent is not None:
        meta.setdefault("parent_episode", parent.id)
    with _current(EpisodeRecorder(store, task=task, source=source, metadata=meta, registry=registry)) as rec:
        yield rec


@contextmanager
def implicit_episode(
    store: EpisodeSink | None = None,
    source: str = "capture",
    task: Any = None,
    metadata: dict[str, Any] | None = None,
    registry: RegistryRef | None = None,
) -> Iterator[tuple[EpisodeRecorder, bool]]:
    """For adapters: join the current episode, or open (and finish) one for this run. A joined
    episode without a registry takes ``registry``."""
    cur = current_episode()
    if cur is not None:
        cur.set_task(task)
        if cur.registry is None and registry is not None:
            cur.registry = registry
        yield cur, False
        return
    with _current(EpisodeRecorder(store, task=task, source=source, metadata=metadata, registry=registry)) as rec:
        yield rec, True


@contextmanager
def _current(rec: EpisodeRecorder) -> Iterator[EpisodeRecorder]:
    """``rec`` is the current episode in the block, finished after it (failed if the block raised)."""
    token = CURRENT_EPISODE.set(rec)
    try:
        yield rec
    except BaseException as e:
        rec.finish("failed", f"{type(e).__name__}: {e}")
        raise
    finally:
        CURRENT_EPISODE.reset(token)
        rec.finish()
