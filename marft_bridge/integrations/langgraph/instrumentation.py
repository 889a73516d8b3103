"""``instrument(app)`` / ``uninstrument(app)`` / ``capture()``: what the user calls.

Instrumenting wraps the app's ``invoke``/``ainvoke``/``stream``/``astream`` in the instance (the
class is not touched) and marks each run's config; without the precision tier it also adds the
callback handler there (with it, ``manager_events`` hands the handler its events). The capture's state
(``state.LangGraphState``: its registries, the precision tier's hooks when the installed LangGraph
is supported) is created by the first instrumented app or open ``capture()`` block and dropped,
every hook removed, with the last (``LANGGRAPH``, whose holders they are; an app garbage-collected
without ``uninstrument`` stops counting). Both are idempotent.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from ...capture_errors import capture_error
from ...seams import EpisodeSink, RegistryRef
from ...capture.episode_context import Instrumentor
from ...capture.recording import EpisodeRecorder
from . import callbacks, precision
from .runs import RUN, CaptureHandler, _Run
from .state import LangGraphState

_METHODS = ("invoke", "ainvoke", "stream", "astream")
LANGGRAPH = Instrumentor(LangGraphState, weak=True)


class _Instrumentation:
    def __init__(self, app: Any, store: EpisodeSink, reward_fn: Any, source: str, registry: RegistryRef | None = None):
        self.app = app
        self.store = store
        self.reward_fn = reward_fn
        self.source = source
        self.registry = registry
        self.originals = {m: getattr(app, m) for m in _METHODS}

    def start(self, inputs: Any) -> _Run | None:
        state = LANGGRAPH.state
        if state is None:  # uninstrumented in another thread meanwhile
            return None
        try:
            h = CaptureHandler(state, self.store, self.reward_fn, self.source, on_finish=self._done,
                               registry=self.registry)
            h.run = h.new_run(inputs)
            return h.run
        except Exception as e:  # noqa: BLE001
            capture_error("langgraph.start", e)
            return None

    def _done(self, rec: EpisodeRecorder) -> None:
        self.app.__dict__["last_episode_id"] = rec.id

    def finish(self, run: _Run, output: Any = None, error: BaseException | None = None, early: bool = False) -> None:
        try:
            run.finish(output, error, early)
        except Exception as e:  # noqa: BLE001 - capture must not break the app
            capture_error("langgraph.finish", e, run.recorder)

    def install(self) -> None:
        app, orig = self.app, self.originals

        def config_for(config: Any, run: _Run) -> dict:
            cfg = precision.mark(config, run.handler)
            # With the precision tier's hooks the handler's events come from LangChain's managers (manager_events).
            return cfg if run.handler.state.hooks.installed else callbacks.with_handler(cfg)

        def invoke(input: Any, config: Any = None, **kw: Any) -> Any:
            if precision.marked(config) or (run := self.start(input)) is None:
                return orig["invoke"](input, config, **kw)
            token = RUN.set(run)
            try:
                out = orig["invoke"](input, config_for(config, run), **kw)
            except BaseException as e:
                self.finish(run, error=e)
                raise
            finally:
                RUN.reset(token)
            self.finish(run, out)
            return out

        async def ainvoke(input: Any, config: Any = None, **kw: Any) -> Any:
            if precision.marked(config) or (run := self.start(input)) is None:
                return await orig["ainvoke"](input, config, **kw)
            token = RUN.set(run)
            try:
                out = await orig["ainvoke"](input, config_for(config, run), **kw)
            except BaseException as e:
                self.finish(run, error=e)
                raise
            finally:
                RUN.reset(token)
            self.finish(run, out)
            return out

        def stream(input: Any, config: Any = None, **kw: Any) -> Any:
            if precision.marked(config) or (run := self.start(input)) is None:
                return orig["stream"](input, config, **kw)
            return self._stream(run, orig["stream"](input, config_for(config, run), **kw))

        def astream(input: Any, config: Any = None, **kw: Any) -> Any:
            if precision.marked(config) or (run := self.start(input)) is None:
                return orig["astream"](input, config, **kw)
            return self._astream(run, orig["astream"](input, config_for(config, run), **kw))

        for name, fn in (("invoke", invoke), ("ainvoke", ainvoke), ("stream", stream), ("astream", astream)):
            fn.__wrapped__ = orig[name]  # type: ignore[attr-defined]
            fn.__doc__ = getattr(orig[name], "__doc__", None)
            app.__dict__[name] = fn

    def _stream(self, run: _Run, it: Any) -> Any:
        chunks: list[Any] = []
        keep = self.reward_fn is not None
        try:
            while True:
                token = RUN.set(run)  # the generator runs in its consumer's context, step by step
                try:
                    chunk = next(it)
                except StopIteration:
                    break
                finally:
                    RUN.reset(token)
                if keep:
                    chunks.append(chunk)
                yield chunk
        except GeneratorExit:
            self.finish(run, chunks, early=True)
            it.close()  # LangGraph's own generator closes now, as it would without capture
            raise
        except BaseException as e:
            self.finish(run, error=e)
            raise
        self.finish(run, chunks)

    async def _astream(self, run: _Run, it: Any) -> Any:
        chunks: list[Any] = []
        keep = self.reward_fn is not None
        try:
            while True:
                token = RUN.set(run)
                try:
                    chunk = await it.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    RUN.reset(token)
                if keep:
                    chunks.append(chunk)
                try:
                    yield chunk
                except BaseException:
                    # Thrown in at the yield: the consumer left (``aclose``, a ``break`` closed at
                    # the loop's shutdown, its task cancelled). Not the run's failure; LangGraph's
                    # generator is closed here, as it would be without capture.
                    self.finish(run, chunks, early=True)
                    await it.aclose()
                    raise
        except BaseException as e:
            self.finish(run, error=e)  # no-op after an early close (the run is finished)
            raise
        self.finish(run, chunks)


def instrument(app: Any, store: EpisodeSink | None = None, reward_fn: Callable[[Any, Any], float] | None = None,
               source: str = "langgraph", registry: RegistryRef | None = None) -> Any:
    """Capture every run of a compiled LangGraph graph as an Episode; returns the same object.

    ``store``: a ``TraceStore`` (default ``TraceStore.open()``). ``reward_fn(inputs, outputs)``
    returns a team reward per run. ``registry``: the adapter registry (root or ``AdapterRegistry``)
    the deployment publishes from; responses that name no adapter version (vLLM's) record the
    registry's live one. It is this app's setting: the episodes its runs open carry it
    (``recorder.registry``). Calling it again on an instrumented app updates the settings.
    """
    if not all(callable(getattr(app, m, None)) for m in _METHODS):
        raise TypeError(f"instrument() needs a compiled LangGraph graph, got {type(app).__name__}")
    LANGGRAPH.instrument(app)
    cur = app.__dict__.get("_marft_instrumentation")
    if cur is not None:
        cur.store, cur.reward_fn, cur.source, cur.registry = store, reward_fn, source, registry
        return app
    inst = _Instrumentation(app, store, reward_fn, source, registry)
    inst.install()
    app.__dict__["_marft_instrumentation"] = inst
    app.__dict__.setdefault("last_episode_id", None)
    return app


def uninstrument(app: Any = None) -> Any:
    """Remove what ``instrument`` added; the app behaves as before it was instrumented. After the
    last instrumented app (and with no ``capture()`` block open) LangGraph's callables are the
    originals. ``uninstrument()`` without an app uninstruments every instrumented app."""
    if app is None:
        for a in LANGGRAPH.holders():
            if not isinstance(a, capture):
                uninstrument(a)
        LANGGRAPH.uninstrument()  # apps collected without uninstrument() held it too: none is left now
        return None
    inst = app.__dict__.pop("_marft_instrumentation", None)
    if inst is not None:
        for m in _METHODS:
            app.__dict__.pop(m, None)
        app.__dict__.pop("last_episode_id", None)
    LANGGRAPH.uninstrument(app)
    return app


class capture:
    """``with capture(store=...) as c:`` records every LangGraph run started in the block.

    Runs inside ``marft_bridge.episode(...)`` join it; otherwise each root graph run is one
    Episode. ``c.episode_ids`` lists the episodes this block recorded, in finishing order.
    ``registry`` as in ``instrument()``.
    """

    def __init__(self, store: EpisodeSink | None = None, reward_fn: Callable[[Any, Any], float] | None = None,
                 source: str = "langgraph", registry: RegistryRef | None = None):
        self.store, self.reward_fn, self.source, self.registry = store, reward_fn, source, registry
        self.handler: CaptureHandler | None = None
        self.episode_ids: list[str] = []
        self._tokens: Any = None
        self._state: LangGraphState | None = None
        self._roots = False

    def _done(self, rec: EpisodeRecorder) -> None:
        self.episode_ids.append(rec.id)

    def __enter__(self) -> capture:
        state = self._state = LANGGRAPH.instrument(self)
        self.handler = CaptureHandler(state, self.store, self.reward_fn, self.source, on_finish=self._done,
                                      registry=self.registry)
        with LANGGRAPH.lock:
            self._roots = not state.hooks.installed  # public tier alone: runs found from root chain events
            state.roots_tracked += self._roots
        self._tokens = (callbacks.CAPTURE_HANDLER.set(self.handler), callbacks.ACTIVE.set(callbacks.HANDLER))
        return self

    def __exit__(self, *exc: Any) -> None:
        h, c = self._tokens
        callbacks.CAPTURE_HANDLER.reset(h)
        callbacks.ACTIVE.reset(c)
        with LANGGRAPH.lock:
            self._state.roots_tracked -= self._roots
        LANGGRAPH.uninstrument(self)

    async def __aenter__(self) -> capture:
        return self.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        self.__exit__(*exc)


# -- what other integrations see --------------------------------------------------------------------


def in_captured_task() -> bool:
    """Whether a captured LangGraph node is running in this context."""
    state = LANGGRAPH.state
    return state is not None and state.in_task()


def record_in_current_task(fields: dict[str, Any], started: datetime | None = None, kind: str = "llm") -> bool:
    """Record an action made inside a captured node as that node's agent (False when not in one).

    For other integrations: a direct ``openai`` call (``kind="llm"``), an MCP tool call
    (``kind="tool"``), ... ``fields`` are ``record_action`` keyword arguments (observation,
    output, sampling, policy, token_source, error, metadata, action_id). The action gets the
    node's step and depends on the node's inputs and on its earlier actions.
    """
    state = LANGGRAPH.state
    return state is not None and state.record_call(fields, started, kind)
