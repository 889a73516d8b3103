"""The service's configuration (the YAML ``marft service --config`` reads) and its durable state files."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..trainers.config import MarftConfig

STATE_FILE = "state.json"
DECISIONS_FILE = "decisions.jsonl"
JOURNAL_FILE = "round.json"  # the round in progress; present after a restart only if it was interrupted


class PublisherConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["embedded", "vllm"] = "embedded"
    url: str
    api_key_env: str | None = "MARFT_API_KEY"  # the key is read from this variable, never stored


class CanaryConfig(BaseModel):
    """``canary:`` — serve each gated release to a share of live episodes first, and promote or roll
    back the whole team on a sequential test of live reward (``service.canary``)."""

    model_config = ConfigDict(extra="forbid")

    fraction: float = Field(0.1, gt=0, lt=1)  # the share of episodes (by a hash of the id) the canary serves
    min_episodes: int = Field(200, ge=2)  # rewarded canary episodes before any decision
    max_hours: float = Field(24.0, gt=0)  # undecided by then: rolled back (the stable release stays)
    metric: Literal["reward"] = "reward"  # the episode's team reward
    margin: float = Field(0.0, ge=0)  # promote when the canary is not worse than stable by more than this
    test: Literal["sequential"] = "sequential"  # always-valid (mixture SPRT): a look at every poll is allowed
    alpha: float = Field(0.05, gt=0, lt=1)  # the test's error rate
    effect: float = Field(0.1, gt=0)  # tau, the reward difference the test is tuned to detect fastest


class ProbeConfig(BaseModel):
    """``probe:`` — check that each served adapter answers as recorded at publish time
    (``serving.probe``): at the first poll after every swap and every ``every_minutes``."""

    model_config = ConfigDict(extra="forbid")

    every_minutes: float = Field(10.0, gt=0)
    tolerance: float = Field(0.05, gt=0)  # largest |log-prob difference| accepted
    max_tokens: int = Field(8, ge=1, le=64)  # greedy tokens recorded and compared


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    store: str = ".marft/traces.db"
    base_model: str
    agents: list[str] = Field(min_length=1)
    registry: str = ".marft/registry"
    state_dir: str = ".marft/service"
    publishers: list[PublisherConfig] = Field(default_factory=list)
    source: str | None = None  # only episodes of this capture source
    min_new_episodes: int = Field(32, ge=1)
    max_train_episodes: int = Field(256, ge=1)
    updates_per_round: int = Field(1, ge=1)
    poll_interval_s: float = Field(10.0, gt=0)
    # "module:function" called as fn(adapters: dict[agent, Path]) -> float (higher is better);
    # None → recorded held-out episodes: their mean team reward for the live system, the same rewards
    # reweighted by importance sampling (weighted IS) for the candidate.
    eval_function: str | None = None
    heldout_fraction: float = Field(0.2, ge=0, lt=1)  # recorded episodes kept out of training for evaluation
    gate_margin: float = Field(0.0, ge=0)
    rollback_window: int = Field(32, ge=1)
    rollback_margin: float = Field(0.05, ge=0)
    canary: CanaryConfig | None = None  # None: a gated release is promoted at once (then watched)
    probe: ProbeConfig | None = None  # None: no identity probe (``marft releases verify`` still runs one)
    drift_margin: float = Field(0.1, ge=0)  # status flags a release whose live reward < gate score - this
    # MarftConfig: a bad trainer option fails at load, naming the field
    trainer: MarftConfig = Field(default_factory=MarftConfig)

    @field_validator("agents")
    @classmethod
    def _adapter_names(cls, agents: list[str]) -> list[str]:
        # The service trains, publishes and serves adapters: the names the app's chat models send as
        # ``model``. Agents named by path (``supervisor/agent`` in a supervisor app) are not adapters.
        from ..schema import ADAPTER_NAME, agent_adapter_name

        for a in agents:
            if not ADAPTER_NAME.match(a) or ".." in a:
                raise ValueError(f"{a!r} is not an adapter name: list the adapters the app's models use as `model` "
                                 f"(`marft adapters map --store ...` shows which agent used which), or "
                                 f"{agent_adapter_name(a)!r}, the registry-safe name of that agent path")
        return agents

    @classmethod
    def from_yaml(cls, path: str | Path) -> ServiceConfig:
        from ..config_files import load_yaml_config

        return load_yaml_config(cls, path)


class ServiceJournal(BaseModel):
    """The round in progress (``round.json``), written durably before each phase that a kill must not repeat."""

    model_config = ConfigDict(extra="forbid")

    id: str  # round id, stamped into every version the round publishes
    round: int
    phase: Literal["training", "publishing", "checkpointing", "baseline"]
    started: str
    agents: list[str] = Field(default_factory=list)
    sha256: dict[str, str] = Field(default_factory=dict)  # agent -> candidate adapter weights
    previous: dict[str, int | None] = Field(default_factory=dict)
    episodes: list[str] = Field(default_factory=list)
    summary: dict[str, Any] = Field(default_factory=dict)
    stage: int | None = None  # update_scheme rerollout: the place in the order of the agent this round trains


class ServiceState(BaseModel):
    cursor: int = 0
    round: int = 0
    pending: list[str] = Field(default_factory=list)  # rewarded episode ids not yet trained on
    heldout: list[str] = Field(default_factory=list)
    watch: dict[str, Any] | None = None  # {"versions": {agent: v}, "previous": {agent: v}}
    order: list[str] = Field(default_factory=list)  # update_scheme rerollout: this cycle's update order
    stage: int = 0  # ... and the place in it of the agent the next round trains
    # A running canary: {"release", "stable", "started", "rewards": {"canary": {id: r}, "stable": {id: r}}}
    canary: dict[str, Any] | None = None
    live: dict[str, dict[str, float]] = Field(default_factory=dict)  # release -> {episode id: team reward} (drift)
