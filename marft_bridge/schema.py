"""Flex-POMDP records: Episode, Action, Reward and what they hold.

The MARFT paper models a multi-agent LLM system as a Flex-POMDP whose dependency function D says
which agents' decisions an agent's decision depends on. Here D is stored per action as
``Action.depends_on`` (ids of earlier actions of the same episode whose output flowed into this
action's observation), which makes an episode a DAG of actions.

Records are pydantic v2 models: validated when built or parsed, JSON round-trip exactly. The
invariants the store relies on are checked here, so every entry point (store, import, capture)
refuses the same bad records with the same message.

Which adapter an action trains is importable here too (``adapter_name``, from ``adapter_names``: the
model name that served it, else the agent path's registry-safe form); how recorded messages and tools
enter a chat template is ``chat_template``.

The depth and size of free-form JSON (task, metadata, tool calls and tools) are bounded by
``limits.RecordLimits``: the store's own, passed as validation context (``{"limits": ...}``), else
the defaults; ``STORED`` skips the check for what the store already holds.

The parts an action is made of (Message, Observation, Output, SamplingParams, Policy), the base
model and that plumbing are in ``schema_parts``; every name is importable from here.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import Any

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

# Adapter naming lives in adapter_names.py (it reads no record type); its names stay importable here.
from .adapter_names import (ADAPTER_NAME, adapter_name, adapters_by_agent, agent_adapter_name,  # noqa: F401
                            resolve_adapters)
from .errors import RecordError
from .limits import RecordLimits, default_limits
# The record parts and the validation plumbing live in schema_parts.py; every name stays importable here.
from .schema_parts import (MAX_ACTIONS, MAX_NAME_CHARS, MAX_REWARDS, MAX_TEXT_CHARS, MAX_TOKENS,  # noqa: F401
                           STORED, ActionKind, EpisodeStatus, Message, Name, Observation, Output, Policy,
                           RecordModel, SamplingParams, TokenSource, check_within, context_limits, invariant, new_id,
                           utcnow)

# The names these had before the split (module-private; kept for code that used them).
_Record, _invariant, _limits, _within = RecordModel, invariant, context_limits, check_within

SCHEMA_VERSION = 3
# Versions older than SCHEMA_VERSION that still load, and what changed since. Each change so far
# only added optional fields, so an older document is a valid current one: reading (store reads,
# ``marft traces import``, ``parse_episode``) relabels it with the current version.
#   1 -> 2: Observation.tools and Observation.tool_choice (what the model was offered).
#   2 -> 3: Episode.group (task and rollout) and Episode.release (the team release that served it).
UPGRADABLE_VERSIONS = frozenset({1, 2})


class Action(RecordModel):
    """One decision of one agent at one Flex-POMDP step."""

    id: str = Field(default_factory=new_id, min_length=1, max_length=MAX_NAME_CHARS)
    agent: Name
    step: int = Field(default=0, ge=0)
    kind: ActionKind = "llm"
    observation: Observation = Field(default_factory=Observation)
    output: Output = Field(default_factory=Output)
    sampling: SamplingParams | None = None
    policy: Policy | None = None
    depends_on: list[str] = Field(default_factory=list)
    # "server": token ids/log-probs came from the serving engine; "retokenize": text only.
    token_source: TokenSource | None = None
    error: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    started_at: datetime | None = None
    ended_at: datetime | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _default_token_source(self) -> Action:
        if self.token_source is None and self.kind == "llm":
            self.token_source = "server" if self.output.token_ids is not None else "retokenize"
        return self

    def limited_fields(self) -> list[tuple[str, Any]]:
        """(field, value) of the free-form JSON the record limits bound (``limits.RecordLimits``)."""
        obs = self.observation
        return [("metadata", self.metadata), ("output.tool_calls", self.output.tool_calls),
                ("observation.tools", obs.tools), ("observation.tool_choice", obs.tool_choice),
                *((f"observation.messages.{k}.tool_calls", m.tool_calls)
                  for k, m in enumerate(obs.messages) if m.tool_calls)]

    @model_validator(mode="after")
    def _within_limits(self, info: ValidationInfo) -> Action:
        if (limits := context_limits(info)) is not None:
            check_within(limits, self.limited_fields())
        return self


class Reward(RecordModel):
    """A reward for the whole episode (team), one agent, or one action. May arrive late."""

    id: str = Field(default_factory=new_id, min_length=1, max_length=MAX_NAME_CHARS)
    value: float
    agent: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    action_id: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    source: str = Field(default="unknown", min_length=1, max_length=MAX_NAME_CHARS)
    created_at: datetime = Field(default_factory=utcnow)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("value")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"reward is {v}; rewards must be finite")
        return v

    def limited_fields(self) -> list[tuple[str, Any]]:
        """(field, value) of the free-form JSON the record limits bound (``limits.RecordLimits``)."""
        return [("metadata", self.metadata)]

    @model_validator(mode="after")
    def _within_limits(self, info: ValidationInfo) -> Reward:
        if (limits := context_limits(info)) is not None:
            check_within(limits, self.limited_fields())
        return self


class EpisodeGroup(RecordModel):
    """Which rollout of which task an episode is: group-relative advantages (GRPO, RLOO) compare an
    episode with the other rollouts of its task."""

    task_id: Name
    rollout: int = Field(ge=0)


class Episode(RecordModel):
    """One run of the multi-agent system on one task."""

    schema_version: int = SCHEMA_VERSION
    id: str = Field(default_factory=new_id, min_length=1, max_length=MAX_NAME_CHARS)
    source: str = Field(default="manual", min_length=1, max_length=MAX_NAME_CHARS)
    task: Any = None
    agents: list[str] = Field(default_factory=list)
    actions: list[Action] = Field(default_factory=list, max_length=MAX_ACTIONS)
    rewards: list[Reward] = Field(default_factory=list, max_length=MAX_REWARDS)
    status: EpisodeStatus = "completed"
    started_at: datetime = Field(default_factory=utcnow)
    ended_at: datetime | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    group: EpisodeGroup | None = None  # set by `marft fit`: the task and rollout index
    release: str | None = Field(default=None, max_length=MAX_NAME_CHARS)  # the team release that served it

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v in UPGRADABLE_VERSIONS:
            return SCHEMA_VERSION  # see UPGRADABLE_VERSIONS: nothing else to convert
        if v != SCHEMA_VERSION:
            raise ValueError(
                f"unknown schema version {v}; this marft_bridge reads versions "
                f"{', '.join(map(str, sorted(UPGRADABLE_VERSIONS | {SCHEMA_VERSION})))}"
                + (" (the record is newer: upgrade marft_bridge to read it)" if v > SCHEMA_VERSION else "")
            )
        return v

    def limited_fields(self) -> list[tuple[str, Any]]:
        """(field, value) of the episode's own free-form JSON the record limits bound (its actions'
        and rewards' are theirs)."""
        return [("task", self.task), ("metadata", self.metadata)]

    @model_validator(mode="after")
    def _within_limits(self, info: ValidationInfo) -> Episode:
        if (limits := context_limits(info)) is not None:
            check_within(limits, self.limited_fields())
        return self

    @model_validator(mode="after")
    def _check_invariants(self) -> Episode:
        # Agents: declared ones stay in order; agents first seen in actions are appended.
        known = list(dict.fromkeys(self.agents))
        for a in self.actions:
            if a.agent not in known:
                known.append(a.agent)
        self.agents = known
        index: dict[str, int] = {}
        for k, a in enumerate(self.actions):
            if a.id in index:
                raise invariant(f"actions.{k}.id", f"duplicate action id {a.id!r}")
            index[a.id] = k
        forward = False
        for k, a in enumerate(self.actions):
            for d in a.depends_on:
                if d not in index:
                    raise invariant(f"actions.{k}.depends_on", f"unknown action id {d!r}")
                if d == a.id:
                    raise invariant(f"actions.{k}.depends_on", "an action cannot depend on itself")
                forward = forward or index[d] > k
        # Only a dependency on a later record can close a cycle (record order is otherwise a
        # topological order), so the search runs only then.
        cycle = _find_cycle(self.actions) if forward else None
        if cycle:
            raise invariant("actions.depends_on", "dependency cycle " + " -> ".join(cycle))
        for k, a in enumerate(self.actions):
            for d in a.depends_on:
                j = index[d]
                if j > k:
                    raise invariant(f"actions.{k}.depends_on", f"depends on later action {d!r} (recorded at {j})")
                if self.actions[j].step > a.step:
                    raise invariant(
                        f"actions.{k}.depends_on",
                        f"depends on action {d!r} of a later step ({self.actions[j].step} > {a.step})",
                    )
        for k, r in enumerate(self.rewards):
            if r.action_id is not None and r.action_id not in index:
                raise invariant(f"rewards.{k}.action_id", f"unknown action id {r.action_id!r}")
            if r.agent is not None and r.agent not in known:
                raise invariant(f"rewards.{k}.agent", f"unknown agent {r.agent!r}")
        return self

    # -- helpers ---------------------------------------------------------------------------------

    def action(self, action_id: str) -> Action:
        for a in self.actions:
            if a.id == action_id:
                return a
        raise KeyError(action_id)

    def topological_order(self) -> list[Action]:
        """Actions ordered so every action comes after those it depends on (ties: step, time, record order)."""
        import heapq

        pos = {a.id: k for k, a in enumerate(self.actions)}
        indeg = {a.id: len(set(a.depends_on)) for a in self.actions}
        children: dict[str, list[str]] = {a.id: [] for a in self.actions}
        for a in self.actions:
            for d in set(a.depends_on):
                children[d].append(a.id)

        def key(a: Action) -> tuple:
            t = a.started_at.timestamp() if a.started_at else math.inf
            return (a.step, t, pos[a.id])

        heap = [(key(a), a.id) for a in self.actions if indeg[a.id] == 0]
        heapq.heapify(heap)
        out: list[Action] = []
        while heap:
            _, aid = heapq.heappop(heap)
            act = self.actions[pos[aid]]
            out.append(act)
            for c in children[aid]:
                indeg[c] -= 1
                if indeg[c] == 0:
                    heapq.heappush(heap, (key(self.actions[pos[c]]), c))
        return out

    def steps(self) -> list[int]:
        return sorted({a.step for a in self.actions})

    def dependency_matrix(self, step: int) -> tuple[list[str], list[list[int]]]:
        """D at one step: ``D[i][j] = 1`` when an action of agent j at ``step`` depends on an action of agent i.

        Rows and columns follow ``self.agents``. A dependency on an earlier step's action counts
        (the paper's D links the decisions that feed one another; LangGraph runs dependent agents
        in consecutive supersteps). An agent's dependence on its own earlier actions sets ``D[i][i]``.
        """
        agents = self.agents
        ix = {n: i for i, n in enumerate(agents)}
        by_id = {a.id: a for a in self.actions}
        d = [[0] * len(agents) for _ in agents]
        for a in self.actions:
            if a.step != step:
                continue
            for dep in a.depends_on:
                d[ix[by_id[dep].agent]][ix[a.agent]] = 1
        return agents, d

    def team_reward(self) -> float | None:
        """Sum of episode-level rewards (no agent, no action), or None when there is none."""
        vals = [r.value for r in self.rewards if r.agent is None and r.action_id is None]
        return sum(vals) if vals else None

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes, record: str | None = None) -> Episode:
        return parse_episode(data, record=record)


def _find_cycle(actions: list[Action]) -> list[str] | None:
    """A dependency cycle as a list of ids (first id repeated at the end), or None."""
    deps = {a.id: a.depends_on for a in actions}
    color: dict[str, int] = {}
    for root in deps:
        if root in color:
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        path: list[str] = []
        while stack:
            node, i = stack.pop()
            if i == 0:
                color[node] = 1
                path.append(node)
            children = [c for c in deps.get(node, []) if c in deps]
            if i < len(children):
                stack.append((node, i + 1))
                c = children[i]
                if color.get(c) == 1:
                    return path[path.index(c):] + [c]
                if c not in color:
                    stack.append((c, 0))
            else:
                color[node] = 2
                path.pop()
    return None


def record_error(exc: ValidationError, record: str | None) -> RecordError:
    """A pydantic ValidationError of a record as RecordError: the first error's field path and reason."""
    err = exc.errors()[0]
    ctx = err.get("ctx") or {}
    if err.get("type") == "invariant":
        prefix = ".".join(str(p) for p in err["loc"])
        field = ".".join(p for p in (prefix, ctx["field"]) if p)
        return RecordError(record, field, ctx["reason"])
    field = ".".join(str(p) for p in err["loc"]) or None
    return RecordError(record, field, err["msg"])


def as_record_error(exc: Exception, record: str | None) -> RecordError:
    """Any failure to build a record as RecordError (a ValidationError's first error, else its type and text)."""
    if isinstance(exc, RecordError):
        return exc
    if isinstance(exc, ValidationError):
        return record_error(exc, record)
    return RecordError(record, None, f"{type(exc).__name__}: {exc}")


def episode_data(data: str | bytes | dict, record: str | None = None, limits: RecordLimits | None = None) -> dict:
    """Raw episode JSON (text or an already decoded value) as a dict, or RecordError (not validated).

    Text longer than ``limits.max_record_bytes`` is refused unread."""
    if isinstance(data, (str, bytes)):
        cap = (limits or default_limits()).max_record_bytes
        if len(data) > cap:
            raise RecordError(record, None, f"{len(data):,} bytes of JSON, over the {cap:,}-byte limit of one "
                              "record (max_record_bytes)")
        try:
            data = json.loads(data)
        except ValueError as e:
            raise RecordError(record, None, f"malformed JSON: {e}") from None
        except RecursionError:
            raise RecordError(record, None, "JSON nested too deep to read (far past the max_depth limit of "
                              f"{(limits or default_limits()).max_depth} levels)") from None
    if not isinstance(data, dict):
        raise RecordError(record, None, f"an episode must be a JSON object, not {type(data).__name__}")
    return data


def parse_episode(data: str | bytes | dict, record: str | None = None, limits: RecordLimits | None = None, *,
                  check_fields: bool = True) -> Episode:
    """Validate raw JSON (text or a decoded dict) into an Episode, or raise RecordError.

    ``record`` names the source (for instance ``traces.jsonl line 7``); the episode's own id is
    added when it can be read, so the message names both. ``limits``: RecordLimits (default:
    ``limits.default_limits()``). ``check_fields=False`` leaves the free-form fields' depth and
    size to the caller (the store judges them on the rows it writes, ``limits.record_within``).
    """
    data = episode_data(data, record, limits)
    eid = data.get("id")
    name = ", ".join(p for p in (record, f"episode {eid}" if isinstance(eid, str) else None) if p) or None
    try:
        return Episode.model_validate(data, context={"limits": limits or default_limits()} if check_fields else STORED)
    except ValidationError as e:
        raise record_error(e, name) from None
    except RecursionError:  # a deep value in a typed field: pydantic's own guard is in Rust, this is not
        raise RecordError(name, None, "nested too deep to validate (past the max_depth limit)") from None


def validate_episode(episode: Episode) -> Episode:
    """Re-validate an Episode object (it may have been mutated since it was built)."""
    return parse_episode(episode.model_dump(mode="json"), record=None)
