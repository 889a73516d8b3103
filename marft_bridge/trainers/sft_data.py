"""Episodes -> supervised examples for ``marft sft``: one (observation, action) token pair per ``llm``
action of a trained agent, rendered exactly as the RL trainer renders it (``batch.observation_ids`` /
``batch.action_ids``: the base's chat template over the recorded messages with the tools offered,
earlier tool calls and results, the generation prompt; the assistant turn with its tool calls and
end-of-turn EOS).

Which adapter an action trains: ``adapter_names.adapter_name`` — the served model name when our
adapter served the call, else its agent's (a hosted model's actions train their agent's adapter).

Recorded token ids (``output.token_ids``, ``observation.prompt_token_ids``) are used only when they
came from this base's tokenizer: the record names no other base (``policy.base_model``), every id is
in the vocabulary, and they decode to the recorded text and tool names. Otherwise (a teacher with
another tokenizer) the action is re-tokenised from its text and tool calls, and counted.

Reward filter (``min_reward``): an episode is kept when its team reward (the sum of the rewards that
name no agent and no action) is at least R; with ``per_agent_reward`` each agent's actions are kept
when that agent's own reward (the rewards naming it) is at least R, its team reward where it has none.

Bad input is skipped and counted, never truncated: an episode below the reward bar or without one,
an action of an agent not being trained, no observation, an empty output, a template whose prefix is
unstable, ids beyond the vocabulary, an action longer than the context window.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from ..adapter_names import adapter_name
from ..schema import Action, Episode
from .batch import action_ids, observation_ids


@dataclass
class Example:
    episode_id: str
    action_id: str
    adapter: str  # the adapter it trains
    obs_ids: list[int]
    act_ids: list[int]  # the loss is on these tokens only


@dataclass
class Examples:
    by_adapter: dict[str, list[Example]]
    episodes: int  # episodes that gave at least one example
    skipped: Counter = field(default_factory=Counter)  # reason -> episodes or actions
    flagged: Counter = field(default_factory=Counter)  # reason -> kept actions (retokenized, ...)

    def all(self) -> list[Example]:
        return [e for exs in self.by_adapter.values() for e in exs]


def team_reward(ep: Episode) -> float | None:
    vals = [r.value for r in ep.rewards if r.agent is None and r.action_id is None]
    return sum(vals) if vals else None


def agent_reward(ep: Episode, agent: str) -> float | None:
    """The agent's own reward (rewards naming it), else the team's; None when the episode has neither."""
    vals = [r.value for r in ep.rewards if r.agent == agent and r.action_id is None]
    return sum(vals) if vals else team_reward(ep)


def recorded_ids_usable(action: Action, tokenizer, base_names: Collection[str]) -> bool:
    """Whether the recorded token ids came from this base's tokenizer (see the module docstring)."""
    out = action.output
    ids = out.token_ids
    if not ids:
        return False
    pol = action.policy
    if pol is not None and pol.base_model and pol.base_model not in base_names:
        return False
    prompt = action.observation.prompt_token_ids or []
    if max(list(ids) + list(prompt)) >= len(tokenizer):
        return False
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if out.text and out.text.strip() not in text:
        return False
    names = [(c.get("function") or {}).get("name") for c in out.tool_calls or () if isinstance(c, dict)]
    return all(n in text for n in names if n)


def _without_ids(action: Action) -> Action:
    return action.model_copy(update={
        "observation": action.observation.model_copy(update={"prompt_token_ids": None}),
        "output": action.output.model_copy(update={"token_ids": None, "logprobs": None})})


def render(action: Action, tokenizer, base_names: Collection[str], vocab_size: int, max_context: int,
           flagged: Counter) -> tuple[str | None, list[int], list[int]]:
    """(skip reason or None, observation ids, action ids) of one llm action."""
    has_ids = action.output.token_ids is not None
    if has_ids and not recorded_ids_usable(action, tokenizer, base_names):
        action = _without_ids(action)  # another tokenizer's ids: the text and tool calls re-rendered
        retok = "retokenized_foreign_ids"
    else:
        retok = None if has_ids else "retokenized"
    obs = observation_ids(action, tokenizer)
    ids = action_ids(action, tokenizer)[0]
    if not obs:
        return "no_observation", [], []
    if ids is None:
        return "template_prefix_unstable", [], []
    if not ids:
        return "empty_output", [], []
    if max(obs + ids) >= vocab_size:
        return "token_id_beyond_vocab", [], []
    if len(obs) + len(ids) > max_context:
        return "longer_than_context", [], []
    if retok:
        flagged[retok] += 1
    return None, obs, ids


def _episode_bar(ep: Episode, min_reward: float | None, per_agent: bool) -> str | None:
    """Why the whole episode is filtered out (None: kept, or judged per agent)."""
    if min_reward is None or per_agent:
        return None
    team = team_reward(ep)
    if team is None:
        return "episode_without_team_reward"
    return "episode_below_min_reward" if team < min_reward else None


def build_examples(episodes: list[Episode], tokenizer, adapters: Collection[str], *, vocab_size: int,
                   max_context: int, base_names: Collection[str] = (), min_reward: float | None = None,
                   per_agent_reward: bool = False, name_of: Callable[[Action], str | None] | None = None,
                   keep: Callable[[Episode, Action], bool] | None = None) -> Examples:
    """Examples per adapter in ``adapters`` (each an adapter name, see ``adapter_names.adapter_name``).
    ``name_of``: another attribution rule (``batch.trained_name``: the RL trainer's); ``keep``: only
    the actions it accepts (expert iteration's kept rollouts; the others counted ``not_kept``)."""
    adapters = set(adapters)
    out: dict[str, list[Example]] = {a: [] for a in adapters}
    skipped: Counter = Counter()
    flagged: Counter = Counter()
    n_eps = 0
    for ep in episodes:
        if reason := _episode_bar(ep, min_reward, per_agent_reward):
            skipped[reason] += 1
            continue
        kept = 0
        for act in ep.topological_order():
            if act.kind != "llm":
                continue
            name = name_of(act) if name_of is not None else adapter_name(act, adapters)
            if name not in adapters:
                skipped["agent_not_trained"] += 1
                continue
            if keep is not None and not keep(ep, act):
                skipped["not_kept"] += 1
                continue
            if per_agent_reward and min_reward is not None:
                r = agent_reward(ep, act.agent)
                if r is None or r < min_reward:
                    skipped["action_below_min_reward" if r is not None else "action_without_reward"] += 1
                    continue
            reason, obs, ids = render(act, tokenizer, base_names, vocab_size, max_context, flagged)
            if reason:
                skipped[reason] += 1
                continue
            out[name].append(Example(ep.id, act.id, name, obs, ids))
            kept += 1
        n_eps += kept > 0
    return Examples(out, n_eps, skipped, flagged)


def split_episodes(episode_ids: list[str], val_fraction: float, seed: int) -> set[str]:
    """The held-out episode ids: the ``round(val_fraction * n)`` ids first in a seeded hash order (at
    least one when the fraction is positive and there are two or more episodes; never all of them).
    The order depends only on the ids and the seed, so a resumed run holds out the same episodes."""
    ids = sorted(set(episode_ids), key=lambda i: hashlib.sha256(f"{seed}/{i}".encode()).hexdigest())
    if val_fraction <= 0 or len(ids) < 2:
        return set()
    k = min(max(1, round(val_fraction * len(ids))), len(ids) - 1)
    return set(ids[:k])
