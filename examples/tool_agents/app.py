"""The example's app: a langgraph-supervisor team. The *supervisor* hands each question to the
*math_expert* (a prebuilt ReAct agent with two real Python tools, ``add`` and ``multiply``), which
calls the tool, reads its result, answers and hands back; the supervisor then gives the final answer.

The chat models are whatever the caller passes: ``ChatOpenAI(model="supervisor" | "math_expert")``
against ``marft serve`` for the real run (each agent selects its LoRA adapter by ``model``, as in
vLLM multi-LoRA serving), or ``ScriptedChatModel`` to produce the warm-start demonstrations.
"""

from __future__ import annotations

import random
import re
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool

SUPERVISOR_PROMPT = "Send math to math_expert."
EXPERT_PROMPT = "Use a tool."


@tool
def add(a: int, b: int) -> int:
    """a+b"""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """a*b"""
    return a * b


def questions(n: int, seed: int) -> list[tuple[str, int, int]]:
    """``n`` questions ``(op, a, b)`` with op in + and *, operands 1..4 (a small set: the tiny model
    memorises its tool calls per question)."""
    rng = random.Random(seed)
    return [(rng.choice("+*"), rng.randint(1, 4), rng.randint(1, 4)) for _ in range(n)]


def question_text(op: str, a: int, b: int) -> str:
    return f"{a}{op}{b}?"


def answer(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a * b


def reward(inputs: dict, output: dict) -> float:
    """1 when the supervisor's final message states the right number."""
    op, a, b = re.fullmatch(r"(\d)([+*])(\d)\?", inputs["messages"][0]["content"]).group(2, 1, 3)
    final = output["messages"][-1].content if output.get("messages") else ""
    return float(re.findall(r"-?\d+", final or "")[-1:] == [str(answer(op, int(a), int(b)))])


def build_app(supervisor_model, expert_model):
    """The compiled supervisor graph; invoke with ``{"messages": [{"role": "user", "content": "2+3?"}]}``."""
    from langgraph.prebuilt import create_react_agent
    from langgraph_supervisor import create_supervisor

    expert = create_react_agent(expert_model, tools=[add, multiply], name="math_expert", prompt=EXPERT_PROMPT)
    return create_supervisor([expert], model=supervisor_model, prompt=SUPERVISOR_PROMPT).compile()


class ScriptedChatModel(BaseChatModel):
    """Plays the ideal team for the warm start: reads the conversation and emits what each agent
    should say, as real ``tool_calls`` (``bind_tools`` binds OpenAI tool schemas, like ChatOpenAI)."""

    role: str  # "supervisor" or "math_expert"; also the model name captured as the policy
    calls: int = 0

    @property
    def _llm_type(self) -> str:
        return "scripted"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.role}

    def bind_tools(self, tools, **kw):
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kw)

    def _generate(self, messages, stop=None, run_manager=None, **kw) -> ChatResult:
        self.calls += 1
        question = next(m.content for m in messages if m.type == "human")
        op, a, b = re.fullmatch(r"(\d)([+*])(\d)\?", question).group(2, 1, 3)
        result = answer(op, int(a), int(b))
        last = messages[-1]
        if self.role == "supervisor":
            if last.type == "human":
                msg = _call("transfer_to_math_expert", {}, self.calls)
            else:
                msg = AIMessage(content=f"{result}")
        elif last.type == "tool" and last.name in ("add", "multiply"):
            msg = AIMessage(content=f"{result}")
        else:
            msg = _call("add" if op == "+" else "multiply", {"a": int(a), "b": int(b)}, self.calls)
        # finish_reason "stop", as a server reports it: the trainer then ends the action with EOS.
        return ChatResult(generations=[ChatGeneration(message=msg, generation_info={"finish_reason": "stop"})])


def _call(name: str, args: dict, n: int) -> AIMessage:
    return AIMessage(content="", tool_calls=[{"name": name, "args": args, "id": f"call_{n}"}])
