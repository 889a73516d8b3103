"""Task sets for ``marft fit``: JSONL of app inputs, the validation split, which tasks an iteration plays
and the sampling seed of every rollout.

A task line is one JSON object: the app's input. Its optional ``"id"`` names it (else ``line<N>``); the
id stays in the input the app receives only if the user put it there, since ``id`` is the user's field.
Everything here is a pure function of the task files and the seed, so a resumed run plays exactly the
tasks and seeds the killed one would have.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MarftError

VAL_FRACTION = 0.1  # held out of --tasks when no --val is given
VAL_SEED_BASE = 10**9  # validation seeds: far from any training seed, the same every iteration


@dataclass(frozen=True)
class Task:
    id: str
    input: dict[str, Any]


def read_tasks(path: str | Path) -> list[Task]:
    """Every task of a JSONL file; a line that is not a JSON object is refused with its line number."""
    p = Path(path)
    if not p.is_file():
        raise MarftError(f"task file {p} does not exist")
    tasks, seen = [], set()
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise MarftError(f"{p} line {n}: not JSON ({e.msg}); each line must be one JSON object "
                             "(an app input)") from None
        if not isinstance(obj, dict):
            raise MarftError(f"{p} line {n}: a JSON {type(obj).__name__}, not an object; each line must be one "
                             "JSON object (an app input)")
        tid = str(obj["id"]) if obj.get("id") is not None else f"line{n}"
        if tid in seen:
            raise MarftError(f"{p} line {n}: task id {tid!r} appears twice")
        seen.add(tid)
        tasks.append(Task(tid, obj))
    if not tasks:
        raise MarftError(f"{p} holds no tasks")
    return tasks


def split_val(tasks: list[Task], seed: int) -> tuple[list[Task], list[Task]]:
    """(train, val): a fixed VAL_FRACTION of the tasks (at least one, by a seeded shuffle) held out."""
    if len(tasks) < 2:
        raise MarftError("--tasks needs at least 2 tasks to hold out a validation split (or give --val)")
    order = list(range(len(tasks)))
    random.Random(f"val/{seed}").shuffle(order)
    n_val = max(1, round(len(tasks) * VAL_FRACTION))
    held = set(order[:n_val])
    return [t for k, t in enumerate(tasks) if k not in held], [t for k, t in enumerate(tasks) if k in held]


def iteration_tasks(tasks: list[Task], iteration: int, k: int, seed: int) -> list[Task]:
    """The K tasks of iteration ``iteration`` (1-based): successive slices of one seeded shuffle per
    pass over the set, so every task is played once before any is played twice."""
    out: list[Task] = []
    start = (iteration - 1) * k
    while len(out) < k:
        epoch, offset = divmod(start + len(out), len(tasks))
        order = list(range(len(tasks)))
        random.Random(f"tasks/{seed}/{epoch}").shuffle(order)
        out.append(tasks[order[offset]])
    return out


def rollout_seed(seed: int, iteration: int, slot: int, rollout: int, group_size: int) -> int:
    """A distinct sampling seed per (run seed, iteration, task slot, rollout): requests of one rollout
    may add small offsets (one per agent call), hence the stride of 1000."""
    return ((seed * 100_003 + iteration) * 10_000 + slot * group_size + rollout) * 1000 % VAL_SEED_BASE


def val_seed(k: int) -> int:
    return VAL_SEED_BASE + 1000 * k
