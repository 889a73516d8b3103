"""With the precision tier, an instrumented run carries no marft callback handler: the model calls
and tool runs of its tasks are read at LangChain's callback managers (``manager_events``), so
LangChain dispatches none of the graph's runs to us. What the handler recorded is recorded the same
way — batches, text models, streamed calls, tools and model calls inside tools — and nothing twice
when the handler is there too (``capture()``, an app's own handler alongside)."""

from __future__ import annotations

import asyncio
from typing import Annotated, TypedDict

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.language_models.fake import FakeListLLM
from langchain_core.messages import HumanMessage
from langchain_core.runnables.config import var_child_runnable_config
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langchain_core.messages import AIMessage
from test_capture_langgraph import chain_app, edges, fake, stored
from tool_apps import ToolCallingModel, create_react_agent, tool_results

import marft_bridge as mb
from marft_bridge.integrations.langgraph import callbacks


class S(TypedDict, total=False):
    question: str
    answers: list
    messages: Annotated[list, add_messages]


class Counting(BaseCallbackHandler):
    """An app's own handler: counts the model calls it is told about."""

    def __init__(self):
        self.starts = 0

    def on_chat_model_start(self, *a, **k):
        self.starts += 1


def _handlers_here() -> list:
    cbs = (var_child_runnable_config.get() or {}).get("callbacks")
    if cbs is None or isinstance(cbs, list):
        return list(cbs or [])
    return [*cbs.handlers, *cbs.inheritable_handlers]


def test_an_instrumented_run_dispatches_nothing_to_capture_and_records_every_call(sqlite_store):
    seen: list[list] = []
    batch, text, streamed = fake("one", "two"), FakeListLLM(responses=["a text answer"] * 5), fake("streamed answer")

    def ask(s, config):
        seen.append(_handlers_here())
        prompts = [[HumanMessage(s["question"])], [HumanMessage("again: " + s["question"])]]
        result = batch.generate(prompts, callbacks=config["callbacks"], metadata=config["metadata"])
        return {"answers": [g[0].text for g in result.generations]}

    def complete(s):
        seen.append(_handlers_here())
        return {"answers": [*s["answers"], text.invoke(" ".join(s["answers"]))]}

    def stream(s):
        chunks = [c.content for c in streamed.stream([HumanMessage(s["answers"][-1])])]
        return {"answers": [*s["answers"], "".join(chunks)]}

    g = StateGraph(S)
    for name, fn in (("ask", ask), ("complete", complete), ("stream", stream)):
        g.add_node(name, fn)
    g.add_edge(START, "ask")
    g.add_edge("ask", "complete")
    g.add_edge("complete", "stream")
    g.add_edge("stream", END)
    app = mb.instrument(g.compile(), store=sqlite_store)
    out = app.invoke({"question": "q"})
    assert out["answers"] == ["one", "two", "a text answer", "streamed answer"]
    assert seen and all(callbacks.HANDLER not in hs for hs in seen)  # LangChain never calls the handler

    ep = stored(sqlite_store, app)
    acts = ep.actions
    assert [(a.agent, a.kind, a.output.text) for a in acts] == [
        ("ask", "llm", "one"), ("ask", "llm", "two"), ("complete", "llm", "a text answer"),
        ("stream", "llm", "streamed answer")]
    assert acts[1].observation.messages[0].content == "again: q"
    assert acts[2].observation.messages[0].content == "one two" and acts[2].policy.name == "FakeListLLM"
    assert set(acts[2].depends_on) == {acts[0].id, acts[1].id} and acts[3].depends_on == [acts[2].id]


def _tool_agent(inner):
    @tool
    def lookup(topic: str) -> str:
        """Look a topic up (asks another model)."""
        return inner.invoke([HumanMessage(f"facts about {topic}")]).content

    def policy(messages):
        if not tool_results(messages):
            return AIMessage("", tool_calls=[{"name": "lookup", "args": {"topic": "owls"}, "id": "call_1"}])
        return AIMessage("owls are birds")

    return create_react_agent(ToolCallingModel(policy=policy), [lookup])


def test_tools_and_a_model_call_inside_a_tool_keep_their_edges_without_the_handler(sqlite_store):
    app = mb.instrument(_tool_agent(fake("owls hoot")), store=sqlite_store)
    out = app.invoke({"messages": [HumanMessage("tell me about owls")]})
    assert out["messages"][-1].content == "owls are birds"
    ep = stored(sqlite_store, app)
    by = {(a.kind, a.output.text): a for a in ep.actions}
    ask, inner = by[("llm", "")], by[("llm", "owls hoot")]
    step, answer = by[("tool", "owls hoot")], by[("llm", "owls are birds")]
    assert step.agent == "agent" and step.metadata["tool_call_id"] == "call_1"
    assert inner.depends_on == [ask.id] and set(step.depends_on) == {ask.id, inner.id}
    assert step.id in answer.depends_on
    assert len(ep.actions) == 4


def test_the_handler_and_the_manager_hooks_never_both_record(sqlite_store):
    app = mb.instrument(chain_app(), store=sqlite_store)
    mine = Counting()
    app.invoke({"question": "q"}, {"callbacks": [mine]})  # the app's own handler still gets every call
    assert mine.starts == 3 and len(stored(sqlite_store, app).actions) == 3
    with mb.capture(store=sqlite_store) as c:  # LangChain's configure hook adds the handler here
        app.invoke({"question": "q"})
        chain_app().invoke({"question": "q"})
    # the block records the plain app; the instrumented app's run inside it is an episode of its own
    assert len(c.episode_ids) == 1 and app.last_episode_id not in c.episode_ids
    for eid in {*c.episode_ids, app.last_episode_id}:
        ep = stored(sqlite_store, eid)
        assert len(ep.actions) == 3, [(a.agent, a.output.text) for a in ep.actions]
        assert edges(ep)["reviewer@3"] == ("llm", ["coder@2"])


def test_async_calls_are_read_at_the_async_managers(sqlite_store):
    app = mb.instrument(chain_app(), store=sqlite_store)
    asyncio.run(app.ainvoke({"question": "q"}))
    ep = stored(sqlite_store, app)
    assert edges(ep) == {"planner@1": ("llm", []), "coder@2": ("llm", ["planner@1"]),
                         "reviewer@3": ("llm", ["coder@2"])}


def test_a_call_given_its_own_callbacks_in_a_node_is_still_recorded(sqlite_store):
    mine, first, second = Counting(), fake("own-callbacks reply"), fake("inherited reply")

    def node(s):  # callbacks in the call's config replace the ones the node inherited
        a = first.invoke(s["messages"], config={"callbacks": [mine]})
        return {"messages": [a, second.invoke([*s["messages"], a])]}

    g = StateGraph(S)
    g.add_node("agent", node)
    g.add_edge(START, "agent")
    g.add_edge("agent", END)
    app = mb.instrument(g.compile(), store=sqlite_store)
    app.invoke({"messages": [HumanMessage("x")]})
    acts = stored(sqlite_store, app).actions
    assert mine.starts == 1
    assert [a.output.text for a in acts] == ["own-callbacks reply", "inherited reply"]  # was: the second only
    assert acts[0].depends_on == [] and acts[1].depends_on == [acts[0].id]
