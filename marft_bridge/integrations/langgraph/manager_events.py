"""The callback handler's events read at LangChain's callback managers, not dispatched to it.

With the precision tier installed an instrumented run's config carries no callback handler. Were it
there, LangChain would dispatch every run of the graph to it (each node, each channel write, the
events it ignores included) and check it, on every model call, against its streaming protocol (a
``typing.Protocol`` check, slow on Python 3.11) — most of what capture cost a plain invoke. Every
model call and tool run makes its callback manager's events whatever handlers it has, so
pass-through hooks (``precision._targets``) on the public managers hand the events the handler
wants straight to it (``callbacks.HANDLER``), with the arguments LangChain would give it:

- ``CallbackManager`` / ``AsyncCallbackManager``: ``on_chat_model_start``, ``on_llm_start``,
  ``on_tool_start`` (after the manager made its runs: their run ids, its metadata);
- the run managers they return: ``on_llm_end`` / ``on_llm_error``, ``on_tool_end`` /
  ``on_tool_error``.

A manager that holds the handler itself (inside ``capture()`` blocks LangChain's configure hook
adds it to every run; a run configured without the precision tier) dispatches to it as before, so
nothing is seen twice; with no captured task running (no task registered, no instrumented run in
this context) the hooks pass the call through untouched.
"""

from __future__ import annotations

import functools
from typing import Any

from ...capture_errors import capture_error
from ..hooks import arg
from . import callbacks

# The argument each event hands over per run: a start's list (one run per item), an end's result.
_STARTS = {"on_chat_model_start": "messages", "on_llm_start": "prompts"}
_ENDS = {"on_llm_end": "response", "on_llm_error": "error", "on_tool_end": "output", "on_tool_error": "error"}


def _listening(state: Any, manager: Any) -> bool:
    return state.capturing() and callbacks.HANDLER not in manager.handlers


def _rest(kwargs: dict, *names: str) -> dict:
    rest = dict(kwargs)  # a copy less the names given: a few keys, each popped in C
    for k in names:
        rest.pop(k, None)
    return rest


def _started(event: str, manager: Any, args: tuple, kwargs: dict, runs: Any) -> None:
    """Hand a start event to the handler for each run the manager made (one per prompt, one tool run)."""
    h = callbacks.HANDLER
    serialized = arg(args, kwargs, 0, "serialized")
    if event == "on_tool_start":
        rest = _rest(kwargs, "serialized", "input_str", "run_id", "parent_run_id", "inputs")
        h.on_tool_start(serialized, arg(args, kwargs, 1, "input_str"), run_id=runs.run_id,
                        metadata=manager.metadata, inputs=arg(args, kwargs, 4, "inputs"), **rest)
        return
    items = _STARTS[event]
    rest = _rest(kwargs, "serialized", items, "run_id")
    handle, metadata = getattr(h, event), manager.metadata
    for item, run in zip(arg(args, kwargs, 1, items) or (), runs or ()):
        handle(serialized, [item], run_id=run.run_id, metadata=metadata, **rest)


# The hooks catch what ``guarded`` would (an ``Exception``, counted under the same name) with a bare
# ``try``: they run on every model call and tool run, where a context manager object per call shows.


def _start(event: str, state: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    runs = wrapped(*args, **kwargs)
    if _listening(state, instance):
        try:
            _started(event, instance, args, kwargs, runs)
        except Exception as e:  # noqa: BLE001 - capture must not break the app
            capture_error("langgraph.manager_start", e)
    return runs


async def _astart(event: str, state: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    runs = await wrapped(*args, **kwargs)
    if _listening(state, instance):
        try:
            _started(event, instance, args, kwargs, runs)
        except Exception as e:  # noqa: BLE001
            capture_error("langgraph.manager_start", e)
    return runs


def _ended(on_end: Any, result: str, in_flight: str, state: Any, run: Any, args: tuple, kwargs: dict) -> None:
    # ``on_end``: the handler's method; ``in_flight``: the state's registry of its runs (calls, tools).
    if getattr(state, in_flight) and _listening(state, run):
        try:
            on_end(arg(args, kwargs, 0, result), run_id=run.run_id)
        except Exception as e:  # noqa: BLE001
            capture_error("langgraph.manager_end", e)


def _end(ended: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    ended(instance, args, kwargs)
    return wrapped(*args, **kwargs)


async def _aend(ended: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    ended(instance, args, kwargs)
    return await wrapped(*args, **kwargs)


def targets(state: Any) -> list[tuple[Any, str, Any]]:
    from langchain_core.callbacks import manager as m

    def ended(e: str) -> Any:  # what an end event needs, looked up once: not on every call
        return functools.partial(_ended, getattr(callbacks.HANDLER, e), _ENDS[e],
                                 "calls" if e.startswith("on_llm") else "tools", state)

    starts = (*_STARTS, "on_tool_start")
    llm_ends, tool_ends = ("on_llm_end", "on_llm_error"), ("on_tool_end", "on_tool_error")
    out = [(owner, e, functools.partial(hook, e, state)) for owner, hook in
           ((m.CallbackManager, _start), (m.AsyncCallbackManager, _astart)) for e in starts]
    return out + [(owner, e, functools.partial(hook, ended(e))) for owner, events, hook in
                  ((m.CallbackManagerForLLMRun, llm_ends, _end), (m.AsyncCallbackManagerForLLMRun, llm_ends, _aend),
                   (m.CallbackManagerForToolRun, tool_ends, _end), (m.AsyncCallbackManagerForToolRun, tool_ends, _aend))
                  for e in events]
