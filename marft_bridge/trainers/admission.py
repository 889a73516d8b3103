"""Which recorded actions an update may learn from: foreign policies and stale adapter versions.

**Foreign policy.** A policy-gradient step needs the action to have been sampled by the policy it
updates (or an older version of it, which the behaviour weight corrects). An action whose recorded
policy (``Action.policy.name``, the model name the call sent) our adapters did not serve, by the rule
``marft train`` / ``marft sft`` name adapters with (``adapter_names.hosted_model``: no adapter
version recorded and not one of the trainer's adapters), and that is not the base, was produced by
another model (a hosted ``gpt-4.1-mini``, a teacher behind vLLM: token ids alone are no mark, a
teacher returns them from its own tokenizer). It is excluded and counted ``foreign_policy`` (per
model name: ``Batch.foreign``); supervised distillation (``marft sft``) is what such actions are
for. Not foreign: an action without a recorded policy (nothing says otherwise), a model id that is
not an adapter name (``Qwen/Qwen2.5-0.5B``: the base by its hub id), the base's directory name or
path. ``MarftConfig.allow_foreign`` keeps every action, as before (biased: the ratio is against a
policy that never produced the data; the behaviour weight then uses the proximal log-probs).

**Version lag.** ``max_version_lag`` N: an action whose recorded ``policy.version`` is more than N
versions behind the trainer's current version of that adapter is dropped and counted
``stale_version``. The current version is what the trainer was told (``MarftTrainer.policy_versions``,
set by whoever publishes: registry versions), else its update count (what its in-process rollouts
record). An action without a recorded version cannot be judged and is kept.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..adapter_names import hosted_model
from ..schema import Action


@dataclass
class Admission:
    """The rules of one batch; ``reason(action, adapter)`` is None for an admitted action."""

    agents: frozenset[str]  # the trainer's adapters (agent names as it was given them)
    base_names: frozenset[str]  # names the base model may be recorded under
    allow_foreign: bool = True
    max_version_lag: int | None = None
    current_version: Callable[[str], int] | None = None  # adapter -> its current version

    def foreign(self, action: Action) -> bool:
        if self.allow_foreign:
            return False
        model = hosted_model(action, self.agents)  # None: no policy, ours, or not an adapter-shaped name
        return model is not None and model not in self.base_names

    def lag(self, action: Action, adapter: str) -> int | None:
        """Versions the action's adapter is behind the current one (None: no version recorded)."""
        if action.policy is None or action.policy.version is None or self.current_version is None:
            return None
        return self.current_version(adapter) - action.policy.version

    def reason(self, action: Action, adapter: str) -> str | None:
        if self.foreign(action):
            return "foreign_policy"
        if self.max_version_lag is not None and (lag := self.lag(action, adapter)) is not None \
                and lag > self.max_version_lag:
            return "stale_version"
        return None


def base_names(base_model_path, name_or_path: str | None = None) -> frozenset[str]:
    """The names a call to the base model may carry: its path, its directory name (what ``marft
    serve`` calls it) and the name it was loaded from (``config._name_or_path``)."""
    p = str(base_model_path)
    return frozenset(n for n in (p, Path(p).name, name_or_path) if n)


def foreign_line(counts: Counter | dict[str, int]) -> str | None:
    """The one line ``marft train`` (and the service) prints when foreign actions were excluded."""
    if not counts:
        return None
    parts = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    first, rest = parts[0], parts[1:]
    names = f"{first[1]} actions came from {first[0]}" + "".join(f", {n} from {m}" for m, n in rest)
    return f"{names}; distil them with `marft sft` (allow_foreign: true trains on them anyway, biased)"


def count_foreign(episodes, admission: Admission) -> Counter:
    """Per model name, the llm actions of ``episodes`` that ``admission`` excludes as foreign (among
    those that would train one of its adapters)."""
    from .batch import trained_name

    out: Counter = Counter()
    agents = set(admission.agents)
    for ep in episodes:
        for act in ep.actions:
            if act.kind == "llm" and trained_name(act, agents) is not None and admission.foreign(act):
                out[act.policy.name] += 1
    return out

