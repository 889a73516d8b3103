"""One A2A agent of the example team, served on 127.0.0.1 with capture.

    python examples/a2a_team/agent.py writer --port 9102 --store traces.db
    python examples/a2a_team/agent.py researcher --port 9101 --store traces.db \
        --delegate http://127.0.0.1:9102

Each agent runs a two-node LangGraph app whose chat models are deterministic fakes (no model
download): the writer ``draft`` -> ``polish``; the researcher ``notes`` -> ``delegate`` (which
sends the notes to the writer over A2A). ``CaptureExecutor`` records each request
into the caller's episode; the run script (``run.py``) shows the assembled episode.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import uuid

from a2a.helpers import new_text_message
from a2a.server.agent_execution import AgentExecutor
from a2a.server.request_handlers import DefaultRequestHandlerV2
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill, Role, SendMessageRequest
from a2a.types import Message, Part
from a2a.utils.constants import TransportProtocol
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import END, START, MessagesState, StateGraph

import marft_bridge as mb
from marft_bridge.integrations import a2a as cap
from marft_bridge.integrations.crossprocess.propagation import flush_joins


def fake_model(text: str) -> GenericFakeChatModel:
    """A chat model that answers ``text`` (deterministic stand-in for a served adapter)."""
    return GenericFakeChatModel(messages=iter([AIMessage(text)]))


def two_node_graph(first: tuple, second: tuple):
    """A compiled ``START -> first -> second -> END`` graph of ``(name, node)`` pairs."""
    g = StateGraph(MessagesState)
    g.add_node(*first)
    g.add_node(*second)
    g.add_edge(START, first[0])
    g.add_edge(first[0], second[0])
    g.add_edge(second[0], END)
    return g.compile()


async def send_text(client, text: str) -> str:
    """Send ``text`` to an A2A agent; returns the text of its reply message."""
    msg = Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[Part(text=text)])
    reply = ""
    async for ev in client.send_message(SendMessageRequest(message=msg)):
        if ev.HasField("message"):
            reply = "\n".join(p.text for p in ev.message.parts if p.HasField("text"))
    return reply


def writer_graph():
    async def draft(state: MessagesState) -> dict:
        q = state["messages"][-1].content
        return {"messages": [await fake_model(f"draft: {q}").ainvoke(state["messages"])]}

    async def polish(state: MessagesState) -> dict:
        d = state["messages"][-1].content
        return {"messages": [await fake_model(d.replace("draft", "final").upper()).ainvoke(state["messages"])]}

    return two_node_graph(("draft", draft), ("polish", polish))


def researcher_graph(delegate: str):
    client = None

    async def notes(state: MessagesState) -> dict:
        q = state["messages"][-1].content
        return {"messages": [await fake_model(f"notes on {q}").ainvoke(state["messages"])]}

    async def delegate_writing(state: MessagesState) -> dict:
        nonlocal client
        if client is None:
            client = await cap.connect(delegate)
        return {"messages": [AIMessage(await send_text(client, state["messages"][-1].content))]}

    return two_node_graph(("notes", notes), ("delegate", delegate_writing))


class GraphExecutor(AgentExecutor):
    """Runs a captured LangGraph app on the message text and replies with its last message."""

    def __init__(self, app, store, prefix: str = ""):
        self.app = mb.instrument(app, store=store)
        self.prefix = prefix

    async def execute(self, context, event_queue):
        text = context.get_user_input()
        if not text:
            raise ValueError("this agent needs a text part")
        out = await self.app.ainvoke({"messages": [HumanMessage(text)]})
        await event_queue.enqueue_event(new_text_message(self.prefix + out["messages"][-1].content,
                                                         context_id=context.context_id, task_id=context.task_id))

    async def cancel(self, context, event_queue):
        raise NotImplementedError


class EchoExecutor(AgentExecutor):
    """Replies with the message text: no model, so a benchmark sees the protocol capture alone
    (``delay_ms``: after that long, like an agent whose work takes time)."""

    def __init__(self, delay_ms: float = 0.0):
        self.delay_ms = delay_ms

    async def execute(self, context, event_queue):
        if self.delay_ms > 0:
            await asyncio.sleep(self.delay_ms / 1000)
        await event_queue.enqueue_event(new_text_message(context.get_user_input(), context_id=context.context_id,
                                                         task_id=context.task_id))

    async def cancel(self, context, event_queue):
        raise NotImplementedError


class OpenAIExecutor(AgentExecutor):
    """Answers with one raw ``openai`` chat-completions call to ``model_url`` (model ``<name>-model``):
    an agent with no framework, whose model call capture records in its half as well."""

    def __init__(self, name: str, model_url: str):
        from openai import AsyncOpenAI

        self.name = name
        self.client = AsyncOpenAI(base_url=model_url, api_key="local", max_retries=0)

    async def execute(self, context, event_queue):
        reply = await self.client.chat.completions.create(
            model=f"{self.name}-model", messages=[{"role": "user", "content": context.get_user_input()}])
        await event_queue.enqueue_event(new_text_message(f"{self.name}: {reply.choices[0].message.content}",
                                                         context_id=context.context_id, task_id=context.task_id))

    async def cancel(self, context, event_queue):
        raise NotImplementedError


def card(name: str, port: int) -> AgentCard:
    return AgentCard(
        name=name, description=f"example {name} agent", version="1.0",
        supported_interfaces=[AgentInterface(url=f"http://127.0.0.1:{port}", protocol_binding=TransportProtocol.JSONRPC)],
        capabilities=AgentCapabilities(streaming=False), default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[AgentSkill(id=name, name=name, description=name, tags=["example"])],
    )


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    from starlette.applications import Starlette

    ap = argparse.ArgumentParser(description="Serve one example A2A agent with marft_bridge capture.")
    ap.add_argument("name", choices=["writer", "researcher", "echo"], help="echo: replies with the text (benchmarks)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--store", required=True, help="trace store URL or SQLite path shared by the team")
    ap.add_argument("--delegate", help="the writer's URL (researcher only)")
    ap.add_argument("--no-capture", action="store_true", help="serve without capture (for benchmarks)")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="echo: reply after this long (for benchmarks)")
    ap.add_argument("--model-url", help="answer with one raw openai call to this OpenAI-compatible server "
                                        "(model '<name>-model') instead of the agent's LangGraph app")
    args = ap.parse_args(argv)
    store = mb.TraceStore.open(args.store)
    agent_card = card(args.name, args.port)
    if args.model_url:
        inner = OpenAIExecutor(args.name, args.model_url)
    elif args.name == "echo":
        inner = EchoExecutor(args.delay_ms)
    elif args.name == "writer":
        inner = GraphExecutor(writer_graph(), store)
    else:
        inner = GraphExecutor(researcher_graph(args.delegate), store, prefix="researcher: ")
    if args.no_capture and hasattr(inner, "app"):
        mb.uninstrument(inner.app)
    executor = inner if args.no_capture else cap.CaptureExecutor(inner, agent_card, store=store)
    handler = DefaultRequestHandlerV2(executor, InMemoryTaskStore(), agent_card)
    app = Starlette(routes=[*create_agent_card_routes(agent_card), *create_jsonrpc_routes(handler, "/")])
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning")
    server = uvicorn.Server(config)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))
        await server.serve()

    asyncio.run(serve())
    # Halves wait for the caller's half to be stored; give them a little time before exiting.
    flush_joins(timeout=30)
    store.close()
    print(f"{args.name}: stopped", file=sys.stderr)


if __name__ == "__main__":
    main()
