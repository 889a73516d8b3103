"""Tool-calling LangGraph apps with fake chat models that emit real tool calls (reusable, no conftest).

``ToolCallingModel(policy)``: a ``BaseChatModel`` whose ``bind_tools`` binds OpenAI function-tool
schemas (``invocation_params["tools"]``, like ``ChatOpenAI``) and whose reply is
``policy(messages)``: an ``AIMessage`` with ``tool_calls`` or text. Tool-call ids are derived from
the conversation, so a run and its ``ainvoke`` twin see the same ids.

Apps (each a function returning a compiled graph):
- ``react_app()``: ``langgraph.prebuilt.create_react_agent`` with ``add``/``multiply``; the model
  asks for both in one reply (two parallel tool steps), then answers.
- ``create_agent_app()``: the same with ``langchain.agents.create_agent``.
- ``supervisor_app()``: ``langgraph_supervisor.create_supervisor`` over a ``math_expert`` ReAct
  agent; the supervisor hands off (``transfer_to_math_expert``), the expert calls ``add``, answers,
  control comes back, the supervisor answers.
- ``swarm_app()``: ``langgraph_swarm.create_swarm`` of ``alice`` (hands off with
  ``create_handoff_tool(agent_name="bob")``) and ``bob`` (calls ``add``, answers).
- ``handbuilt_app()``: a ``StateGraph`` with a model node, a ``ToolNode`` (a failing tool and one
  returning a dict), a router node returning ``Command(goto=...)``, and a node calling
  ``tool.invoke`` by hand.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypedDict

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from langgraph.types import Command

Policy = Callable[[list[BaseMessage]], AIMessage]
FAKE_MODEL = "fake-tools"  # the model name a chat model sends unless told another


class ToolCallingModel(BaseChatModel):
    """A chat model whose reply is ``policy(messages)``; binds tools like ChatOpenAI."""

    policy: Policy
    model_name: str = FAKE_MODEL

    @property
    def _llm_type(self) -> str:
        return "fake-tool-calling"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name}

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kw: Any) -> ChatResult:
        return ChatResult(generations=[ChatGeneration(message=self.policy(list(messages)))])

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, **kw: Any) -> Any:
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is not None:
            kw["tool_choice"] = tool_choice
        return self.bind(tools=formatted, **kw)


def call(name: str, args: dict, messages: list[BaseMessage], k: int = 0) -> dict:
    """A tool call whose id depends only on the conversation so far."""
    return {"name": name, "args": args, "id": f"call_{name}_{len(messages)}_{k}", "type": "tool_call"}


def tool_results(messages: list[BaseMessage]) -> list[ToolMessage]:
    return [m for m in messages if isinstance(m, ToolMessage)]


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@tool
def lookup(key: str) -> dict:
    """Look a key up (returns a dict: not a string)."""
    return {"key": key, "value": len(key)}


@tool
def broken(x: int) -> str:
    """A tool that always fails."""
    raise ValueError(f"broken tool got {x}")


# -- ReAct agents ---------------------------------------------------------------------------------


def calculator(messages: list[BaseMessage]) -> AIMessage:
    """Asks for add(2, 3) and multiply(4, 5) at once, then answers with both results."""
    results = tool_results(messages)
    if not results:
        return AIMessage("", tool_calls=[call("add", {"a": 2, "b": 3}, messages, 0),
                                         call("multiply", {"a": 4, "b": 5}, messages, 1)])
    return AIMessage("results: " + ", ".join(str(m.content) for m in results))


def create_react_agent(*args: Any, **kw: Any) -> Any:
    """``langgraph.prebuilt.create_react_agent`` (deprecated in favour of ``create_agent``, still used
    by langgraph-supervisor and most apps), without its deprecation warning."""
    from langgraph.prebuilt import create_react_agent as create

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return create(*args, **kw)


def react_app(name: str | None = None) -> Any:
    return create_react_agent(ToolCallingModel(policy=calculator), [add, multiply], name=name)


def create_agent_app() -> Any:
    from langchain.agents import create_agent

    return create_agent(ToolCallingModel(policy=calculator), [add, multiply])


# -- supervisor and swarm -------------------------------------------------------------------------


def _supervisor(messages: list[BaseMessage]) -> AIMessage:
    if not any(isinstance(m, ToolMessage) and m.name == "transfer_to_math_expert" for m in messages):
        return AIMessage("", tool_calls=[call("transfer_to_math_expert", {}, messages)])
    return AIMessage("final: " + str(messages[-1].content))


def _adder(messages: list[BaseMessage]) -> AIMessage:
    """Calls add(2, 3) once after the last handoff to it, then answers with the sum."""
    since = messages[max((i for i, m in enumerate(messages) if isinstance(m, ToolMessage)
                          and m.name.startswith("transfer_to")), default=0):]
    sums = [m for m in since if isinstance(m, ToolMessage) and m.name == "add"]
    if not sums:
        return AIMessage("", tool_calls=[call("add", {"a": 2, "b": 3}, messages)])
    return AIMessage(f"the sum is {sums[-1].content}")


def supervisor_app(supervisor_model: str = FAKE_MODEL, expert_model: str = FAKE_MODEL) -> Any:
    """The two chat models send these model names (adapter names, to a trainer)."""
    from langgraph_supervisor import create_supervisor

    expert = create_react_agent(ToolCallingModel(policy=_adder, model_name=expert_model), [add], name="math_expert")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return create_supervisor([expert], model=ToolCallingModel(policy=_supervisor, model_name=supervisor_model)).compile()


def _alice(messages: list[BaseMessage]) -> AIMessage:
    return AIMessage("", tool_calls=[call("transfer_to_bob", {}, messages)])


def swarm_app() -> Any:
    from langgraph_swarm import create_handoff_tool, create_swarm

    alice = create_react_agent(ToolCallingModel(policy=_alice), [create_handoff_tool(agent_name="bob")], name="alice")
    bob = create_react_agent(ToolCallingModel(policy=_adder), [add], name="bob")
    return create_swarm([alice, bob], default_active_agent="alice").compile()


# -- a hand-built graph -------------------------------------------------------------------------------


class Chat(TypedDict, total=False):
    messages: Annotated[list, add_messages]
    looked_up: str


def _planner(messages: list[BaseMessage]) -> AIMessage:
    if not tool_results(messages):
        return AIMessage("", tool_calls=[call("lookup", {"key": "abc"}, messages, 0),
                                         call("broken", {"x": 1}, messages, 1)])
    return AIMessage("done: " + " | ".join(str(m.content) for m in tool_results(messages)))


def handbuilt_app() -> Any:
    model = ToolCallingModel(policy=_planner).bind_tools([lookup, broken])

    def plan(s: Chat) -> dict:
        return {"messages": [model.invoke(s["messages"])]}

    def route(s: Chat) -> Command:
        # A node that calls neither a model nor a tool: an env step that routes with Command.
        last = s["messages"][-1]
        return Command(goto="tools" if getattr(last, "tool_calls", None) else "by_hand")

    def by_hand(s: Chat) -> dict:
        return {"looked_up": json.dumps(lookup.invoke({"key": "xy"}))}

    g = StateGraph(Chat)
    g.add_node("planner", plan)
    g.add_node("router", route, destinations=("tools", "by_hand"))
    g.add_node("tools", ToolNode([lookup, broken], handle_tool_errors=True))
    g.add_node("by_hand", by_hand)
    g.add_edge(START, "planner")
    g.add_edge("planner", "router")
    g.add_edge("tools", "planner")
    g.add_edge("by_hand", END)
    return g.compile()


def ask(text: str = "what is 2+3 and 4*5?") -> dict:
    return {"messages": [HumanMessage(text)]}


__all__ = ["ToolCallingModel", "add", "ask", "broken", "call", "create_agent_app", "handbuilt_app", "lookup",
           "multiply", "react_app", "supervisor_app", "swarm_app", "tool_results"]
