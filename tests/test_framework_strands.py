"""OTel intake on REAL Strands Agents apps (strands-agents 1.62): an ``Agent`` with a ``@tool``, a
``Swarm`` handing off with ``handoff_to_agent`` and a ``GraphBuilder`` graph, traced by Strands' own
tracer into the real ``EpisodeSpanProcessor``. The models are scripted ``strands.models.Model``
subclasses (no network). Each D is written by hand from the rules in
``docs/capture/dependency-graph.md`` (OpenTelemetry intake); ``tests/test_otel_frameworks.py`` checks
the same rules on hand-written spans.

What Strands emits (``strands/telemetry/tracer.py``): ``invoke_swarm`` / ``invoke_graph`` (operation
``invoke_swarm`` / ``invoke_graph``: neither an agent nor a workflow to us) > ``invoke_agent <name>``
(``gen_ai.agent.name`` = the ``Agent(name=...)``, not the graph node id) > ``execute_event_loop_cycle``
> ``chat`` (no ``gen_ai.agent.name``, no request model for a custom model) and
``execute_tool <tool>`` (``gen_ai.tool.name``, ``gen_ai.tool.call.id``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Strands' tracer reads this once, when its singleton is built (first Agent): without the opt-in it
# writes the older per-message events (``gen_ai.user.message``, ``gen_ai.choice``; read too, the last
# test); with it, message content goes in GenAI-convention ``gen_ai.input.messages`` /
# ``gen_ai.output.messages`` on ``gen_ai.client.inference.operation.details`` span events (read by
# ``spans.span_attributes``) and tool spans carry ``gen_ai.tool.call.arguments`` / ``.result``.
# Adding ``gen_ai_span_attributes_only`` would put the content on span attributes instead; both work.
_OPT_IN = "gen_ai_latest_experimental"
_LEGACY = os.environ.get("MARFT_TEST_STRANDS_LEGACY") == "1"  # the run without it (the last test)
if not _LEGACY and _OPT_IN not in os.environ.get("OTEL_SEMCONV_STABILITY_OPT_IN", "").split(","):
    os.environ["OTEL_SEMCONV_STABILITY_OPT_IN"] = ",".join(
        v for v in (os.environ.get("OTEL_SEMCONV_STABILITY_OPT_IN"), _OPT_IN) if v)

pytest.importorskip("strands")

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from strands import Agent, tool  # noqa: E402
from strands.models import Model  # noqa: E402
from strands.multiagent import GraphBuilder, Swarm  # noqa: E402

from otel_views import Route, only_episode, view  # noqa: E402

from marft_bridge.integrations import otel  # noqa: E402


_ROUTE = Route()


@pytest.fixture(scope="module", autouse=True)
def _global_provider():
    tp = TracerProvider()
    tp.add_span_processor(_ROUTE)
    trace.set_tracer_provider(tp)  # this file runs in a process of its own
    yield


@pytest.fixture
def captured(sqlite_store):
    _ROUTE.target = otel.EpisodeSpanProcessor(sqlite_store)
    yield sqlite_store
    _ROUTE.target = None


class Scripted(Model):
    """A model that plays its turns in order: a string is a text answer, a ``(name, id, args)``
    tuple a tool call. One instance per agent."""

    def __init__(self, *turns):
        self.turns = list(turns)

    def update_config(self, **model_config):
        pass

    def get_config(self):
        return {}

    async def structured_output(self, output_model, prompt, system_prompt=None, **kwargs):
        raise NotImplementedError
        yield  # pragma: no cover - an async generator, as the base class declares

    async def stream(self, messages, tool_specs=None, system_prompt=None, **kwargs):
        turn = self.turns.pop(0)
        yield {"messageStart": {"role": "assistant"}}
        if isinstance(turn, str):
            yield {"contentBlockStart": {"start": {}}}
            yield {"contentBlockDelta": {"delta": {"text": turn}}}
            stop = "end_turn"
        else:
            name, call_id, args = turn
            yield {"contentBlockStart": {"start": {"toolUse": {"name": name, "toolUseId": call_id}}}}
            yield {"contentBlockDelta": {"delta": {"toolUse": {"input": json.dumps(args)}}}}
            stop = "tool_use"
        yield {"contentBlockStop": {}}
        yield {"messageStop": {"stopReason": stop}}
        yield {"metadata": {"usage": {"inputTokens": 1, "outputTokens": 1, "totalTokens": 2},
                            "metrics": {"latencyMs": 1}}}


def agent(name, *turns, **kw):
    return Agent(name=name, model=Scripted(*turns), callback_handler=None, **kw)


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def handoff(call_id, to, message):
    return ("handoff_to_agent", call_id, {"agent_name": to, "message": message})


def test_agent_with_a_tool_model_call_tool_step_model_call(captured):
    calc = agent("calc", ("add", "t-1", {"a": 2, "b": 3}), "It is 5.", tools=[add])
    assert str(calc("2+3?")).strip() == "It is 5."
    ep = only_episode(captured)
    # Strands' tool result is its content blocks, as JSON: ``[{"text": "5"}]``
    c0, step, c1 = "calc:llm:", 'calc:tool:[{"text": ', "calc:llm:It is 5."
    assert view(ep) == [
        (c0, []),
        (step, [c0]),  # the call that asked for it (gen_ai.tool.call.id), and only that
        (c1, sorted([c0, step])),  # its own agent's earlier actions; the tool call and its result by id
    ]
    assert ep.task == "2+3?"  # the root invoke_agent span's input
    tool_step = ep.actions[1]
    assert tool_step.metadata["tool.name"] == "add"
    assert tool_step.metadata["tool.arguments"] == {"a": 2, "b": 3}
    assert tool_step.metadata["tool_call_id"] == "t-1"
    assert [c["id"] for c in ep.actions[0].output.tool_calls] == ["t-1"]


def test_swarm_handoff_to_agent_is_a_source_of_the_receiving_agents_first_call(captured):
    """researcher -> coder -> reviewer. The receiving agent sees the handoff only as text in its
    new prompt ("Handoff Message: ..."); the handoff tool step is still its first call's source.
    After its handoff the handing agent's loop makes one more call before the swarm moves on."""
    researcher = agent("researcher", handoff("h-1", "coder", "write the parser"), "Over to coder.",
                       system_prompt="You research.")
    coder = agent("coder", handoff("h-2", "reviewer", "review parse()"), "Over to reviewer.",
                  system_prompt="You code.")
    reviewer = agent("reviewer", "Looks good.", system_prompt="You review.")
    result = Swarm([researcher, coder, reviewer])("build a parser")
    assert [n.node_id for n in result.node_history] == ["researcher", "coder", "reviewer"]

    ep = only_episode(captured)
    r0, t1, r1 = "researcher:llm:", 'researcher:tool:[{"text": ', "researcher:llm:Over to co"
    c0, t2, c1 = "coder:llm:", 'coder:tool:[{"text": ', "coder:llm:Over to re"
    v0 = "reviewer:llm:Looks good"
    assert view(ep) == [
        (r0, []),
        (t1, [r0]),
        (r1, sorted([r0, t1])),
        (c0, [t1]),  # the handoff that named "coder"; not the researcher's closing remark
        (t2, [c0]),
        (c1, sorted([c0, t2])),
        (v0, [t2]),  # only the handoff that named it: researcher's handoff was taken by coder
    ]
    assert ep.task == "build a parser"  # the invoke_swarm span's input
    assert ep.actions[1].metadata["tool.arguments"] == {"agent_name": "coder", "message": "write the parser"}


def test_swarm_agent_handed_back_to_starts_from_the_handoff(captured):
    """a hands to b, b hands back to a. The swarm resets an agent's history for each visit (a new
    ``invoke_agent a`` span, a prompt without its earlier turns): a's second visit depends on b's
    handoff, not on a's first visit, which only reached it through b."""
    a = agent("a", handoff("h-1", "b", "your turn"), "A waits.", "Final.")
    b = agent("b", handoff("h-2", "a", "back to you"), "B waits.")
    Swarm([a, b])("ping pong")
    ep = only_episode(captured)
    a0, at, a1 = "a:llm:", 'a:tool:[{"text": ', "a:llm:A waits."
    b0, bt, b1 = "b:llm:", 'b:tool:[{"text": ', "b:llm:B waits."
    assert view(ep) == [
        (a0, []),
        (at, [a0]),
        (a1, sorted([a0, at])),
        (b0, [at]),
        (bt, [b0]),
        (b1, sorted([b0, bt])),
        ("a:llm:Final.", [bt]),
    ]


def test_graph_edge_the_second_agent_depends_on_the_first_agents_output(captured):
    """GraphBuilder passes a node's result on as text ("From plan: - Agent: PLAN-1"): message flow.
    Agents are named by their Strands names, not the graph's node ids."""
    g = GraphBuilder()
    g.add_node(agent("planner", "PLAN-1"), "plan")
    g.add_node(agent("writer", "DONE from the plan"), "write")
    g.add_edge("plan", "write")
    g.set_max_node_executions(4)
    result = g.build()("write the report")
    assert [n.node_id for n in result.execution_order] == ["plan", "write"]
    ep = only_episode(captured)
    assert view(ep) == [("planner:llm:PLAN-1", []), ("writer:llm:DONE from ", ["planner:llm:PLAN-1"])]
    assert ep.task == "write the report"


def test_graph_fan_in_reads_both_branches_which_do_not_read_each_other(captured):
    """Two entry nodes run concurrently and feed one: the join depends on both, the branches on
    neither (compared as a mapping: the branches' order is the scheduler's)."""
    g = GraphBuilder()
    g.add_node(agent("researcher", "FACTS-1"), "research")
    g.add_node(agent("outliner", "OUTLINE-1"), "outline")
    g.add_node(agent("writer", "REPORT-1"), "write")
    g.add_edge("research", "write")
    g.add_edge("outline", "write")
    g.set_max_node_executions(6)
    g.build()("write the report")
    facts, outline = "researcher:llm:FACTS-1", "outliner:llm:OUTLINE-1"
    assert dict(view(only_episode(captured))) == {facts: [], outline: [], "writer:llm:REPORT-1": sorted([facts, outline])}


def test_agent_run_inside_a_tool_is_a_source_of_that_tool_step(captured):
    """Strands' "agents as tools" pattern: a ``@tool`` that calls another ``Agent``. Its
    ``invoke_agent`` span is a child of the ``execute_tool`` span: the sub-agent's first call depends
    on the call that asked for the tool, the tool step on that call and the sub-agent's answer."""
    researcher = agent("researcher", "moon pulls")

    @tool
    def research(question: str) -> str:
        """Ask the researcher."""
        return str(researcher(question)).strip()

    boss = agent("boss", ("research", "t-1", {"question": "why tides?"}), "The moon.", tools=[research])
    boss("why tides?")
    b0, r0, step, b1 = "boss:llm:", "boss/researcher:llm:moon pulls", 'boss:tool:[{"text": ', "boss:llm:The moon."
    assert view(only_episode(captured)) == [
        (b0, []),
        (r0, [b0]),  # the call that asked for the tool it runs in
        (step, sorted([b0, r0])),  # the asking call, and the sub-agent's answer in its result
        (b1, sorted([b0, r0, step])),  # its own actions; the answer also occurs in the tool result it reads
    ]


@pytest.mark.skipif(_LEGACY, reason="this is the run without the opt-in")
def test_without_the_opt_in_the_older_per_message_events_give_the_same_d():
    """Strands' default (no OTEL_SEMCONV_STABILITY_OPT_IN) writes each message as its own event, its
    content as Strands' content blocks (text, toolUse, toolResult): the same D as with the opt-in.
    Its tracer reads the setting once per process, hence a process of its own."""
    env = {k: v for k, v in os.environ.items() if k != "OTEL_SEMCONV_STABILITY_OPT_IN"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "tool_step_model_call or swarm_handoff or inside_a_tool"],
                         env={**env, "MARFT_TEST_STRANDS_LEGACY": "1"}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "3 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
