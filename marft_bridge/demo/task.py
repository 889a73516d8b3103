"""The demo task: two-operator arithmetic where the order of operations is the planner's job.

A question is ``a op b op c`` with digits 1-6, one ``*`` and one ``+`` or ``-`` ("4+5*3",
"4*3-2"), chosen so that doing the two steps in the wrong order gives a different number. The
*planner* reasons without computing: it brackets the step that comes first ("4+(5*3)"). The *solver*
computes by following the plan step by step ("5*3=15,4+15=19"); the last number is its answer. A
wrong plan therefore makes even a perfect solver wrong, which is the two-agent credit-assignment
problem MARFT is about. Everything is character-level and short (tens of characters) so a tiny model
can generate and train on it quickly.

Questions are enumerated exhaustively and split by a seeded shuffle, so the held-out split never
overlaps the training split.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

PLANNER_SYSTEM = "Plan; do not compute."
SOLVER_SYSTEM = "Compute by the plan."
SINGLE_SYSTEM = "Plan, then compute."

Order = Literal["left", "right"]
_OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
_QUESTION = re.compile(r"^\s*(\d)\s*([-+*])\s*(\d)\s*([-+*])\s*(\d)\s*$")
_INT = re.compile(r"-?\d+")
MAX_OPERAND = 6  # operands are digits 1..MAX_OPERAND
MAX_VALUE = 99  # every intermediate and final value, in either order, stays in 0..99


@dataclass(frozen=True)
class Problem:
    """One question with its correct answer."""

    question: str
    answer: int

    @property
    def operands(self) -> tuple[int, str, int, str, int]:
        return parse_question(self.question)

    @property
    def correct_order(self) -> Order:
        """``left`` when the first operator must be applied first (it is the ``*``)."""
        return "left" if self.operands[1] == "*" else "right"


def parse_question(question: str) -> tuple[int, str, int, str, int]:
    """``"4+5*3"`` -> ``(4, "+", 5, "*", 3)``; a ValueError names anything else."""
    m = _QUESTION.match(question)
    if m is None:
        raise ValueError(f"not a demo question (want 'digit op digit op digit', op in + - *): {question!r}")
    a, op1, b, op2, c = m.groups()
    return int(a), op1, int(b), op2, int(c)


def steps(question: str, order: Order) -> tuple[tuple[int, str, int, int], tuple[int, str, int, int]]:
    """The two computation steps ``(x, op, y, result)`` when the operators are applied in ``order``."""
    a, op1, b, op2, c = parse_question(question)
    if order == "left":
        r1 = _OPS[op1](a, b)
        return (a, op1, b, r1), (r1, op2, c, _OPS[op2](r1, c))
    r1 = _OPS[op2](b, c)
    return (b, op2, c, r1), (a, op1, r1, _OPS[op1](a, r1))


def solve(question: str) -> int:
    """The correct value: ``*`` binds tighter than ``+``/``-``."""
    a, op1, b, op2, c = parse_question(question)
    order: Order = "left" if op1 == "*" else "right"
    return steps(question, order)[1][3]


def plan_text(question: str, order: Order) -> str:
    """The plan for ``order``, without any result: the question with the first step bracketed,
    ``"(4+5)*3"`` or ``"4+(5*3)"``."""
    a, op1, b, op2, c = parse_question(question)
    if order == "left":
        return f"({a}{op1}{b}){op2}{c}"
    return f"{a}{op1}({b}{op2}{c})"


def plan_order(question: str, plan: str) -> Order | None:
    """Which order a plan asks for, or None when it is neither of the question's two plans."""
    plan = plan.strip()
    for order in ("left", "right"):
        if plan == plan_text(question, order):
            return order
    return None


def solution_text(question: str, order: Order, *, final: int | None = None) -> str:
    """The worked solution following ``order``: ``"5*3=15,4+15=19"``. ``final`` overrides the last number
    (used to write imperfect demonstrations)."""
    (x1, o1, y1, r1), (x2, o2, y2, r2) = steps(question, order)
    return f"{x1}{o1}{y1}={r1},{x2}{o2}{y2}={r2 if final is None else final}"


def extract_answer(text: str | None) -> int | None:
    """The last integer in ``text`` (the solver's final result), or None when there is none."""
    if not text:
        return None
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def is_correct(question: str, answer_text: str | None) -> bool:
    return extract_answer(answer_text) == solve(question)


def reward(question: str, answer_text: str | None) -> float:
    """The environment checker: 1.0 when the last number in ``answer_text`` is the correct value, else 0.0."""
    return 1.0 if is_correct(question, answer_text) else 0.0


# -- prompts (OpenAI chat messages) -------------------------------------------------------------


def planner_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": PLANNER_SYSTEM}, {"role": "user", "content": question}]


def solver_messages(question: str, plan: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SOLVER_SYSTEM},
        {"role": "user", "content": f"{question}\nplan: {plan.strip()}"},
    ]


def single_agent_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SINGLE_SYSTEM}, {"role": "user", "content": question}]


def single_agent_reply(question: str, order: Order, *, final: int | None = None) -> str:
    """What the single agent writes: its plan, a newline, then the worked solution."""
    return f"{plan_text(question, order)}\n{solution_text(question, order, final=final)}"


# -- the question set and its splits --------------------------------------------------------------


def _in_range(question: str) -> bool:
    values = [v for order in ("left", "right") for (_, _, _, v) in steps(question, order)]
    return all(0 <= v <= MAX_VALUE for v in values)


def all_problems() -> list[Problem]:
    """Every valid question, in a fixed order: one ``*`` and one ``+``/``-``, both orders in range and
    giving different answers (so the plan always matters)."""
    out = []
    for op1, op2 in (("*", "+"), ("*", "-"), ("+", "*"), ("-", "*")):
        for a in range(1, MAX_OPERAND + 1):
            for b in range(1, MAX_OPERAND + 1):
                for c in range(1, MAX_OPERAND + 1):
                    q = f"{a}{op1}{b}{op2}{c}"
                    if not _in_range(q):
                        continue
                    left, right = steps(q, "left")[1][3], steps(q, "right")[1][3]
                    if left != right:
                        out.append(Problem(q, solve(q)))
    return out


@dataclass(frozen=True)
class Splits:
    train: list[Problem]
    heldout: list[Problem]


def make_splits(seed: int = 0, heldout_size: int = 100) -> Splits:
    """A seeded partition of :func:`all_problems` into training and held-out questions (disjoint)."""
    problems = all_problems()
    if not 0 < heldout_size < len(problems):
        raise ValueError(f"heldout_size must be between 1 and {len(problems) - 1}, got {heldout_size}")
    random.Random(seed).shuffle(problems)
    return Splits(train=problems[heldout_size:], heldout=problems[:heldout_size])


def sample_problems(problems: list[Problem], n: int, seed: int) -> list[Problem]:
    """``n`` problems drawn with replacement from ``problems``, reproducibly for a seed."""
    rng = random.Random(seed)
    return [rng.choice(problems) for _ in range(n)]
