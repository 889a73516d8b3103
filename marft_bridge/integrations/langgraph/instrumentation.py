"""``instrument(app)`` / ``uninstrument(app)`` / ``capture()``: what the user calls.

Instrumenting wraps the app's ``invoke``/``ainvoke``/``stream``/``astream`` in the instance (the
class is not touched), adds the callback handler to each run's config and, when the installed
LangGraph is supported, applies the precision tier's hooks. Both are idempotent; when the last
instrumented app is uninstrumented and no ``capture()`` block is open, every hook is removed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from ...capture_errors import capture_error
from ...recording import EpisodeRecorder
from .. import openai as oa
from . import callbacks, precision
from .runs import RUN, CaptureHandler, _Run

_METHODS = ("invoke", "ainvoke", "stream", "astream")
_APPS: weakref.WeakSet[Any] = weakref.WeakSet()  # instrumented apps (an app dropped ununinstrumented goes too)
_CAPTURES = [0]  # capture() blocks open
_LOCK = threading.Lock()


def _install_hooks() -> None:
    precision.install()
    callbacks.register_hook()
    oa.install()


def _maybe_uninstall() -> None:
    with _LOCK:
        idle = not _APPS and not _CAPTURES[0]
    if idle:
        precision.uninstall()


class _Instrumentation:
    def __init__(self, app: Any, store: Any, reward_fn: Any, source: str, registry: Any = None):
        self.app = app
        self.store = store
        self.reward_fn = reward_fn
        self.source = source
        self.registry = registry
        self.originals = {m: getattr(app, m) for m in _METHODS}

    def start(self, inputs: Any) -> _Run | None:
        try:
            h = CaptureHandler(self.store, self.reward_fn, self.source, on_finish=self._done, registry=self.registry)
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
            return callbacks.with_handler(precision.mark(config, run.handler))

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
                yield chunk
        except GeneratorExit:
            self.finish(run, chunks, early=True)
            raise
        except BaseException as e:
            self.finish(run, error=e)
            raise
        self.finish(run, chunks)


def instrument(app: Any, store: Any = None, reward_fn: Callable[[Any, Any], float] | None = None,
               source: str = "langgraph", registry: Any = None) -> Any:
    """Capture every run of a compiled LangGraph graph as an Episode; returns the same object.

    ``store``: a ``TraceStore`` (default ``TraceStore.open()``). ``reward_fn(inputs, outputs)``
    returns a team reward per run. ``registry``: the adapter registry (root or ``AdapterRegistry``)
    the deployment publishes from; responses that name no adapter version (vLLM's) record the
    registry's live one. It is this app's setting: the episodes its runs open carry it
    (``recorder.registry``). Calling it again on an instrumented app updates the settings.
    """
    if not all(callable(getattr(app, m, None)) for m in _METHODS):
        raise TypeError(f"instrument() needs a compiled LangGraph graph, got {type(app).__name__}")
    _install_hooks()
    cur = app.__dict__.get("_marft_instrumentation")
    if cur is not None:
        cur.store, cur.reward_fn, cur.source, cur.registry = store, reward_fn, source, registry
        return app
    inst = _Instrumentation(app, store, reward_fn, source, registry)
    inst.install()
    app.__dict__["_marft_instrumentation"] = inst
    app.__dict__.setdefault("last_episode_id", None)
    with _LOCK:
        _APPS.add(app)
    return app


def uninstrument(app: Any = None) -> Any:
    """Remove what ``instrument`` added; the app behaves as before it was instrumented. After the
    last instrumented app (and with no ``capture()`` block open) LangGraph's callables are the
    originals. ``uninstrument()`` without an app uninstruments every instrumented app."""
    if app is None:
        with _LOCK:
            apps = list(_APPS)
        for a in apps:
            uninstrument(a)
        _maybe_uninstall()
        return None
    inst = app.__dict__.pop("_marft_instrumentation", None)
    if inst is not None:
        for m in _METHODS:
            app.__dict__.pop(m, None)
        app.__dict__.pop("last_episode_id", None)
        with _LOCK:
            _APPS.discard(app)
    _maybe_uninstall()
    return app


class capture:
    """``with capture(store=...) as c:`` records every LangGraph run started in the block.

    Runs inside ``marft_bridge.episode(...)`` join it; otherwise each root graph run is one
    Episode. ``c.episode_ids`` lists the episodes this block recorded, in finishing order.
    ``registry`` as in ``instrument()``.
    """

    def __init__(self, store: Any = None, reward_fn: Callable[[Any, Any], float] | None = None,
                 source: str = "langgraph", registry: Any = None):
        self.handler = CaptureHandler(store, reward_fn, source, on_finish=self._done, registry=registry)
        self.registry = registry
        self.episode_ids: list[str] = []
        self._tokens: Any = None
        self._roots = False

    def _done(self, rec: EpisodeRecorder) -> None:
        self.episode_ids.append(rec.id)

    def __enter__(self) -> capture:
        _install_hooks()
        with _LOCK:
            _CAPTURES[0] += 1
            self._roots = not precision.installed()  # public tier alone: runs found from root chain events
            callbacks.ROOTS_TRACKED[0] += self._roots
        self._tokens = (precision.CAPTURE_HANDLER.set(self.handler), callbacks.ACTIVE.set(callbacks.HANDLER))
        return self

    def __exit__(self, *exc: Any) -> None:
        h, c = self._tokens
        precision.CAPTURE_HANDLER.reset(h)
        callbacks.ACTIVE.reset(c)
        with _LOCK:
            _CAPTURES[0] -= 1
            callbacks.ROOTS_TRACKED[0] -= self._roots
        _maybe_uninstall()

    async def __aenter__(self) -> capture:
        return self.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        self.__exit__(*exc)
