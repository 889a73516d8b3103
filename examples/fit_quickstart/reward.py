"""The reward: 1.0 when the last number the solver wrote is the task's answer, else 0.0 (a team reward;
return {"planner": x, "solver": y} to reward agents separately)."""

import re


def score(task: dict, output: dict) -> float:
    numbers = re.findall(r"-?\d+", output.get("solution") or "")
    return 1.0 if numbers and int(numbers[-1]) == task["answer"] else 0.0
