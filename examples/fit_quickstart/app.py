"""A small two-agent LangGraph app, written the way any LangGraph app is: a planner brackets the step to
do first ("4+(5*3)"), a solver computes by the plan ("5*3=15,4+15=19"). Each agent is a ChatOpenAI model.

The only thing `marft fit` asks of it: build the app in a function that takes the endpoint, and point
each agent's model at it (``endpoint.base_url``, ``endpoint.api_key``, ``endpoint.model(agent)``).
``seed=endpoint.seed`` is optional: it makes each rollout's sampling reproducible.
"""

from typing import TypedDict

from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph


class State(TypedDict, total=False):
    question: str
    answer: int  # the task file's answer (the reward reads it; the agents never see it)
    plan: str
    solution: str


def build_app(endpoint):
    def model(agent: str) -> ChatOpenAI:
        return ChatOpenAI(model=endpoint.model(agent), base_url=endpoint.base_url, api_key=endpoint.api_key,
                          temperature=0.7, max_tokens=32)

    planner, solver = model("planner"), model("solver")

    def plan(state: State) -> State:
        reply = planner.invoke([("system", "Plan; do not compute."), ("user", state["question"])],
                               seed=endpoint.seed)
        return {"plan": reply.content}

    def solve(state: State) -> State:
        reply = solver.invoke([("system", "Compute by the plan."),
                               ("user", f"{state['question']}\nplan: {state['plan'].strip()}")],
                              seed=None if endpoint.seed is None else endpoint.seed + 1)
        return {"solution": reply.content}

    graph = StateGraph(State)
    graph.add_node("planner", plan)
    graph.add_node("solver", solve)
    graph.add_edge(START, "planner")
    graph.add_edge("planner", "solver")
    graph.add_edge("solver", END)
    return graph.compile()
