"""One capture state per integration: nothing is registered when the package is imported; the first
``instrument`` creates an integration's state and applies its hooks, the last ``uninstrument``
drops it and puts every original back; both idempotent, per holder."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from langchain_core.tracers import context as lc_context
from langgraph.pregel import _loop
from mcp.client.session import ClientSession
from openai._base_client import AsyncAPIClient, SyncAPIClient
from test_capture_langgraph import chain_app

import marft_bridge as mb
from marft_bridge.capture import episode_context
from marft_bridge.capture import recording
from marft_bridge.integrations import mcp as mcp_capture
from marft_bridge.integrations import openai as oa
from marft_bridge.integrations import openai_agents
from marft_bridge.integrations.langgraph import LANGGRAPH


def _originals():
    return {"sync": vars(SyncAPIClient)["request"], "async": vars(AsyncAPIClient)["request"],
            "tick": vars(_loop.PregelLoop)["tick"], "session": vars(ClientSession)["call_tool"]}


def _capture_states() -> set:
    """The active LangGraph and openai-client states (MCP/A2A objects of other tests may hold theirs)."""
    return {type(s).__name__ for s in episode_context.active_states()} & {"LangGraphState", "OpenAIState"}


def _reset() -> None:
    """No instrumented app, no client capture instrumented for the process."""
    mb.uninstrument()
    oa.uninstrument()
    openai_agents.uninstrument()


def test_importing_every_integration_registers_nothing():
    code = textwrap.dedent("""
        from langchain_core.tracers import context as lc
        hooks_before = len(lc._configure_hooks)
        from openai._base_client import SyncAPIClient
        from langgraph.pregel import _loop
        before = (SyncAPIClient.request, _loop.PregelLoop.tick)
        import marft_bridge
        from marft_bridge.capture import episode_context
        from marft_bridge.integrations import a2a, mcp, openai, openai_agents, otel, session
        from marft_bridge.integrations.mcp import server as mcp_server
        from marft_bridge.integrations.otel import emit as otel_emit
        from marft_bridge.integrations.langgraph import instrumentation, state
        assert episode_context.active_states() == (), episode_context.active_states()
        assert (SyncAPIClient.request, _loop.PregelLoop.tick) == before
        assert len(lc._configure_hooks) == hooks_before
        print("clean")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "clean", out.stderr


def test_the_openai_hook_lives_while_any_holder_does():
    _reset()
    orig = _originals()
    a, b = object(), object()
    assert oa.instrument(a) and oa.instrument(a)  # idempotent per holder
    hooked = vars(SyncAPIClient)["request"]
    assert hooked is not orig["sync"] and oa.instrument(b) and vars(SyncAPIClient)["request"] is hooked
    oa.uninstrument(a)
    oa.uninstrument(a)
    assert oa.instrumented()  # b still holds it
    oa.uninstrument(b)
    assert not oa.instrumented() and oa.OPENAI.state is None
    assert vars(SyncAPIClient)["request"] is orig["sync"] and vars(AsyncAPIClient)["request"] is orig["async"]


def test_an_episode_block_instruments_the_client_for_the_process(sqlite_store):
    _reset()
    orig = _originals()
    with mb.episode(store=sqlite_store):
        assert oa.instrumented() and vars(SyncAPIClient)["request"] is not orig["sync"]
    assert oa.instrumented()  # kept: re-applying per block would cost every block
    oa.uninstrument()
    assert vars(SyncAPIClient)["request"] is orig["sync"] and oa.OPENAI.state is None


def test_instrumented_apps_hold_the_langgraph_state_and_its_hooks(sqlite_store):
    _reset()
    orig = _originals()
    assert LANGGRAPH.state is None and _capture_states() == set()
    one = mb.instrument(chain_app(), store=sqlite_store)
    state = LANGGRAPH.state
    assert mb.instrument(one, store=sqlite_store) is one and LANGGRAPH.state is state  # idempotent
    two = mb.instrument(chain_app(), store=sqlite_store)
    assert {s for s in episode_context.active_states() if s in (state, oa.OPENAI.state)} == {state, oa.OPENAI.state}
    assert vars(_loop.PregelLoop)["tick"] is not orig["tick"] and oa.instrumented()
    one.invoke({"question": "q"})
    mb.uninstrument(one)
    mb.uninstrument(one)
    assert LANGGRAPH.state is state  # two still holds it
    mb.uninstrument(two)
    assert LANGGRAPH.state is None and oa.OPENAI.state is None and _capture_states() == set()
    assert _originals() == orig
    assert one.invoke({"question": "q"})["review"] == "looks right"  # the app works as before


def test_a_capture_block_holds_the_state_only_while_open(sqlite_store):
    _reset()
    orig = _originals()
    hooks = len(lc_context._configure_hooks)
    with mb.capture(store=sqlite_store) as c:
        assert LANGGRAPH.state is not None
        chain_app().invoke({"question": "q"})
    oa.uninstrument()  # the block instruments the raw client for the process
    assert len(c.episode_ids) == 1 and LANGGRAPH.state is None and _originals() == orig
    with mb.capture(store=sqlite_store):
        pass
    # LangChain cannot unregister a configure hook: ours is registered once and inert outside blocks
    assert len(lc_context._configure_hooks) <= hooks + 1


def test_mcp_instrument_is_idempotent_and_restoring():
    orig = vars(ClientSession)["call_tool"]
    assert mcp_capture.instrument() and mcp_capture.instrument()
    assert vars(ClientSession)["call_tool"] is not orig
    mcp_capture.uninstrument()
    mcp_capture.uninstrument()
    assert vars(ClientSession)["call_tool"] is orig and mcp_capture.MCP.state is None


def test_episode_listeners_are_a_state_while_one_is_added(sqlite_store):
    seen = []
    recording.add_episode_listener(seen.append)
    recording.add_episode_listener(seen.append)  # once
    assert episode_context.listening()
    with mb.episode(store=sqlite_store) as ep:
        ep.record_action("a", output={"text": "x"})
    recording.remove_episode_listener(seen.append)
    assert not episode_context.listening() and [e.id for e in seen] == [ep.id]
