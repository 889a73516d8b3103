"""``fit``'s options as one typed object (the ``marft fit`` flags), and loading ``MODULE:NAME`` callables."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import MarftError


class FitSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    app: Any  # "MODULE:FACTORY" or the factory; FACTORY(endpoint) -> the app
    tasks: Path  # JSONL, one app input (a JSON object) per line, optional "id"
    reward: Any  # "MODULE:FN" or FN(task, output) -> float | {agent: float}, may be async
    base_model: Path
    agents: list[str] = Field(min_length=1)  # adapter names, one per trained agent
    out: Path
    val: Path | None = None  # held-out tasks (default: a fixed 10% of tasks)
    config: Any = None  # MarftConfig, a dict of its fields, or a YAML path
    iterations: int = Field(10, ge=1)
    tasks_per_iteration: int = Field(8, ge=1)  # K
    group_size: int = Field(4, ge=1)  # G rollouts per task, distinct sampling seeds
    concurrency: int = Field(16, ge=1)  # C app runs at a time
    seed: int = Field(0, ge=0)
    server: str | None = None  # a running server (vLLM); default: the embedded one, started by fit
    api_key_env: str | None = None  # the environment variable holding --server's key
    store: str | None = None  # trace store URL (default: OUT/traces.db)
    rollout_timeout: float | None = Field(300.0, gt=0)  # seconds per app run; None: no limit
    server_start_timeout: float = Field(120.0, gt=0)  # seconds the embedded server may take to start
    resume: bool = False
    progress: bool = True
    # The update: ``ppo`` (the MARFT update of --config) or ``expert_iteration`` (expert.py: each agent
    # fine-tuned on its own best rollouts of the iteration's groups; needs min_reward or top_k_per_group).
    algorithm: Literal["ppo", "expert_iteration"] = "ppo"
    min_reward: float | None = None  # expert_iteration: keep rollouts whose reward is >= this
    top_k_per_group: int | None = Field(None, ge=1)  # expert_iteration: at most K best rollouts per task group
    sft_epochs: int = Field(1, ge=1)  # expert_iteration: passes over the kept actions per iteration
    sft_lr: float = Field(1e-4, gt=0)
    sft_batch_size: int = Field(8, ge=1)  # actions per optimiser step
    # Python API only: sharing one running server and registry between runs (the demo does).
    api_key: str | None = None
    publisher: str = "vllm"  # with ``server``: "vllm" or "embedded"
    registry: Path | None = None  # default OUT/registry
    served: dict[str, str] | None = None  # agent -> its adapter's name on the server (default: the agent's)
    source: str = "fit"  # Episode.source of the episodes this run stores
    console: Any = None

    @model_validator(mode="after")
    def _algorithm_options(self) -> FitSettings:
        chosen = self.min_reward is not None or self.top_k_per_group is not None
        if self.algorithm == "expert_iteration" and not chosen:
            raise ValueError("--algorithm expert_iteration needs --min-reward R or --top-k-per-group K "
                             "(which rollouts each agent learns from)")
        if self.algorithm == "ppo" and chosen:
            raise ValueError("--min-reward and --top-k-per-group choose expert iteration's rollouts; "
                             "pass --algorithm expert_iteration (ppo learns from every rewarded rollout)")
        return self

    def served_names(self) -> dict[str, str]:
        names = {a: (self.served or {}).get(a, a) for a in self.agents}
        if len(set(names.values())) != len(names):
            raise MarftError(f"two agents share one served adapter name: {names}")
        return names

    def store_url(self) -> str:
        return self.store or str(Path(self.out) / "traces.db")

    def public_dict(self) -> dict:
        """The settings as results.json records them (callables by name, no console, no key)."""
        d = self.model_dump(mode="json", exclude={"console", "api_key", "config", "app", "reward"})
        for k in ("app", "reward"):
            v = getattr(self, k)
            d[k] = v if isinstance(v, str) else f"{getattr(v, '__module__', '?')}:{getattr(v, '__qualname__', v)}"
        d["config"] = marft_config(self).model_dump(mode="json")
        return d


def marft_config(s: FitSettings):
    """The trainer config: ``s.config`` with fit's seed; no periodic trainer checkpoints (fit keeps its
    own, once per iteration)."""
    from ..trainers.config import MarftConfig

    c = s.config
    if c is None:
        cfg = MarftConfig()
    elif isinstance(c, MarftConfig):
        cfg = c
    elif isinstance(c, dict):
        cfg = MarftConfig(**c)
    else:
        cfg = MarftConfig.from_yaml(c)
    update: dict[str, Any] = {"seed": s.seed, "checkpoint_every": None}
    if s.algorithm == "expert_iteration":
        update["advantage"] = "reward"  # the trainer only holds the adapters: no critic built
    return cfg.model_copy(update=update)


def load_callable(spec: Any, what: str) -> Callable:
    """``MODULE:NAME`` (a module importable from the working directory, or ``path/to/file.py:NAME``), or
    a callable as it is."""
    if callable(spec):
        return spec
    mod, _, name = str(spec).partition(":")
    if not mod or not name:
        raise MarftError(f"{what} {spec!r}: expected MODULE:NAME")
    try:
        if mod.endswith(".py") or "/" in mod:
            path = Path(mod).resolve()
            loaded = importlib.util.spec_from_file_location(path.stem, path)
            if loaded is None or not path.is_file():
                raise ImportError(f"no file {path}")
            module = importlib.util.module_from_spec(loaded)
            sys.modules.setdefault(path.stem, module)
            loaded.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))  # as `python -m` would: the user's modules live here
            module = _import_current(mod)
        fn = getattr(module, name)
    except (ImportError, AttributeError) as e:
        raise MarftError(f"cannot load {what} {spec!r}: {e}") from None
    if not callable(fn):
        raise MarftError(f"{what} {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def _import_current(mod: str) -> Any:
    """Import ``mod`` as the path finds it now: a same-named top-level module imported earlier from
    another folder (two examples' ``app``, a notebook that changed directory) is replaced, not reused."""
    top = mod.partition(".")[0]
    cached = sys.modules.get(top)
    if cached is not None and getattr(cached, "__file__", None):
        spec = importlib.machinery.PathFinder.find_spec(top)
        if spec is not None and spec.origin and Path(spec.origin).resolve() != Path(cached.__file__).resolve():
            for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                del sys.modules[name]
    return importlib.import_module(mod)

