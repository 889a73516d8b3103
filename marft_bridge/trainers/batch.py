"""Episodes -> training samples: topological order, tokens, behaviour log-probs, rewards placed.

Each trainable action (kind "llm", trained adapter known) becomes a Sample, in the episode's
topological order by D. A sample's ``agent`` is the adapter it trains: ``schema.adapter_name``
(the model name that served the call, else the agent's registry-safe name) when it is one of
``agents``, else the recorded agent name itself (trainers named by graph node).

Observation tokens are the recorded prompt token ids, else the base model's chat template over
the recorded messages with the tools the model was offered (``tools=``), assistant tool calls,
tool results' ``tool_call_id``/``name``, and ``add_generation_prompt=True``; else the recorded
completion prompt. Action tokens are the sampled ids, else the assistant message (text and tool
calls) as the template renders it: template(messages + assistant) minus template(messages,
add_generation_prompt=True), up to and including the end-of-turn EOS when the model stopped
(nothing after it: the model never samples the template's separators). When the second is not a
prefix of the first (a template that rewrites earlier turns), the action is skipped as
``template_prefix_unstable`` rather than trained on shifted tokens. Without messages the text is
re-tokenised (+EOS when it stopped). Re-tokenised actions are counted, and their log-probs (if
any) are not used. An action sampled with ``allowed_token_ids`` keeps that set (its log-probs are
masked alike).

Rewards: a team reward (no agent, no action) goes on the episode's last trainable action; an
agent reward on that agent's last trainable action; an action reward on its action, or on the
nearest earlier trainable action when that action is not trained (a tool call, a skipped action).

Bad input is skipped with a counted reason, never truncated: episodes without rewards, actions
whose agent has no adapter, actions ``admission`` excludes (foreign policies, stale versions), token ids beyond the vocabulary, a sampled token outside its
``allowed_token_ids``, sequences longer than the context
window, empty outputs. ``build_batch`` raises MarftError when nothing trainable remains.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from ..errors import MarftError
from ..chat_template import template_message, template_tool, template_tool_call
from ..schema import Action, Episode, adapter_name, agent_adapter_name

log = logging.getLogger("marft_bridge.trainers")


@dataclass
class Sample:
    episode: int  # index of the episode in the batch
    episode_id: str
    action_id: str
    agent: str
    step: int
    obs_ids: list[int]
    act_ids: list[int]
    beh_logp: list[float] | None  # None: no behaviour log-probs recorded (treated as on-policy)
    temperature: float
    reward: float = 0.0
    end: bool = False  # last trainable action of its episode
    # D among the samples: indices (into Batch.samples) of the nearest trainable actions this one
    # depends on, directly or through untrained actions (tools, env steps, skipped calls).
    parents: list[int] = field(default_factory=list)
    # The tokens it was sampled among (SamplingParams.allowed_token_ids; None: the whole vocabulary):
    # every log-prob of this action is the masked log-softmax over them.
    allowed: tuple[int, ...] | None = None
    version: int | None = None  # the adapter version that played it (Policy.version), if recorded
    ret: float = 0.0  # its agent's return in the episode: team rewards + the agent's own (groups.py)
    group: tuple[str, int] | None = None  # its episode's (task id, rollout), if recorded


@dataclass
class Batch:
    samples: list[Sample]
    episodes: int  # episodes that contributed samples
    episode_returns: list[float]  # sum of all rewards of each contributing episode
    skipped: Counter = field(default_factory=Counter)  # reason -> count (episodes or actions)
    flagged: Counter = field(default_factory=Counter)  # reason -> count of kept actions
    foreign: Counter = field(default_factory=Counter)  # model name -> actions excluded as foreign_policy
    # Per contributing episode (Sample.episode indexes these): id, group, team return, own returns by adapter.
    episode_ids: list[str] = field(default_factory=list)
    episode_groups: list[tuple[str, int] | None] = field(default_factory=list)
    team_returns: list[float] = field(default_factory=list)
    own_returns: list[dict[str, float]] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(len(s.act_ids) for s in self.samples)


# Finish reasons of a model that ended its turn itself (its EOS is part of the action).
STOPPED = frozenset({"stop", "tool_calls", "function_call"})


def _template_ids(tokenizer, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
    tools = [template_tool(t) for t in tools] if tools else None
    enc = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                        tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def observation_ids(action: Action, tokenizer) -> list[int] | None:
    obs = action.observation
    if obs.prompt_token_ids is not None:
        return list(obs.prompt_token_ids)
    if obs.messages:
        return _template_ids(tokenizer, [template_message(m) for m in obs.messages], obs.tools, True)
    if obs.prompt:
        return tokenizer(obs.prompt, add_special_tokens=False)["input_ids"]
    return None


def _stopped(action: Action) -> bool:
    out = action.output
    return out.finish_reason in STOPPED or (out.finish_reason is None and bool(out.tool_calls))


def action_ids(action: Action, tokenizer) -> tuple[list[int] | None, list[float] | None, bool]:
    """(token ids, behaviour log-probs or None, re-tokenised?); ids are None when the chat template's
    prefix is unstable for this action (see the module docstring)."""
    out = action.output
    if out.token_ids is not None:
        return list(out.token_ids), (list(out.logprobs) if out.logprobs is not None else None), False
    eos = tokenizer.eos_token_id
    obs = action.observation
    if not obs.messages:
        ids = tokenizer(out.text, add_special_tokens=False)["input_ids"]
        return (ids + [eos] if out.finish_reason == "stop" and eos is not None else ids), None, True
    messages = [template_message(m) for m in obs.messages]
    turn = {"role": "assistant", "content": out.text}
    if out.tool_calls:
        turn["tool_calls"] = [template_tool_call(c) for c in out.tool_calls]
    prefix = _template_ids(tokenizer, messages, obs.tools, True)
    full = _template_ids(tokenizer, messages + [turn], obs.tools, False)
    if full[:len(prefix)] != prefix:
        return None, None, True
    ids = full[len(prefix):]
    if eos is not None and eos in ids:
        end = len(ids) - 1 - ids[::-1].index(eos)  # the turn's closing EOS; after it only separators
        ids = ids[:end + 1] if _stopped(action) else ids[:end]
    return ids, None, True


def trained_name(action: Action, agents: set[str]) -> str | None:
    """The adapter among ``agents`` that ``action`` trains, or None (see the module docstring)."""
    for name in (adapter_name(action, agents), action.agent, agent_adapter_name(action.agent)):
        if name in agents:
            return name
    return None


def _place_untrained(act: Action, kept: list, placed_on: dict[str, int]) -> None:
    # Credit flows back along D: to the latest trained action this one depends on, else the previous one.
    deps = [placed_on[d] for d in act.depends_on if d in placed_on]
    if deps:
        placed_on[act.id] = max(deps)
    elif kept:
        placed_on[act.id] = len(kept) - 1


@dataclass
class _Rules:
    tokenizer: object
    agents: set[str]
    vocab_size: int
    max_context: int
    default_temperature: float
    admission: object | None  # admission.Admission, or None: every action admitted


def _tokens(act: Action, name: str | None, rules: _Rules):
    """(skip reason or None, observation ids, action ids, behaviour log-probs, re-tokenised?)."""
    if name is None:
        return "agent_without_adapter", None, None, None, False
    if rules.admission is not None and (reason := rules.admission.reason(act, name)):
        return reason, None, None, None, False
    obs = observation_ids(act, rules.tokenizer)
    ids, beh, retok = action_ids(act, rules.tokenizer)
    allowed = set(act.sampling.allowed_token_ids or []) if act.sampling else set()
    reason = None
    if obs is None or not obs:
        reason = "no_observation"
    elif ids is None:
        reason = "template_prefix_unstable"
    elif not ids:
        reason = "empty_output"
    elif max(obs + ids + list(allowed)) >= rules.vocab_size:
        reason = "token_id_beyond_vocab"
    elif allowed and not allowed.issuperset(ids):
        reason = "token_outside_allowed"
    elif len(obs) + len(ids) > rules.max_context:
        reason = "longer_than_context"
    return reason, obs, ids, beh, retok


def _episode_samples(ep: Episode, e: int, rules: _Rules, batch: Batch):
    """The episode's samples in topological order, and where its actions' rewards land."""
    kept: list[Sample] = []
    placed_on: dict[str, int] = {}  # action id -> index in kept that receives its reward
    nearest: dict[str, set[int]] = {}  # action id -> nearest kept ancestors (itself when kept)
    last_of_agent: dict[str, int] = {}  # recorded agent -> index in kept of its last sample
    group = (ep.group.task_id, ep.group.rollout) if ep.group is not None else None
    for act in ep.topological_order():
        parents = set().union(*(nearest.get(d, set()) for d in act.depends_on))
        nearest[act.id] = parents
        if act.kind != "llm":
            _place_untrained(act, kept, placed_on)
            continue
        name = trained_name(act, rules.agents)
        reason, obs, ids, beh, retok = _tokens(act, name, rules)
        if reason:
            batch.skipped[reason] += 1
            if reason == "foreign_policy":
                batch.foreign[act.policy.name] += 1
            _place_untrained(act, kept, placed_on)
            continue
        if retok:
            batch.flagged["retokenized"] += 1
        if beh is None:
            batch.flagged["no_behaviour_logprobs"] += 1
        temp = act.sampling.temperature if act.sampling and act.sampling.temperature else rules.default_temperature
        allowed = tuple(sorted(set(act.sampling.allowed_token_ids or []))) if act.sampling else ()
        placed_on[act.id] = last_of_agent[act.agent] = len(kept)
        nearest[act.id] = {len(kept)}
        kept.append(Sample(e, ep.id, act.id, name, act.step, obs, ids, beh, float(temp), parents=sorted(parents),
                           allowed=allowed or None, version=act.policy.version if act.policy else None,
                           group=group))
    return kept, placed_on, last_of_agent


def _place_rewards(ep: Episode, kept: list[Sample], placed_on: dict[str, int], last_of_agent: dict[str, int],
                   skipped: Counter) -> tuple[float, dict[str, float]]:
    """Each reward onto its sample (module docstring); (the team return, each adapter's own return)."""
    team, own = 0.0, {}
    for r in ep.rewards:
        if r.action_id is not None:
            target = placed_on.get(r.action_id, 0)  # reward before any trained action: the first
        elif r.agent is not None:
            target = last_of_agent.get(r.agent)
            if target is None:
                skipped["reward_for_untrained_agent"] += 1
                continue
        else:
            target = len(kept) - 1
            team += r.value
        kept[target].reward += r.value
        if r.action_id is not None or r.agent is not None:
            own[kept[target].agent] = own.get(kept[target].agent, 0.0) + r.value
    return team, own


def build_batch(episodes: list[Episode], tokenizer, agents: set[str], vocab_size: int, max_context: int,
                default_temperature: float, *, admission=None) -> Batch:
    """The batch of ``episodes`` (module docstring); ``admission`` (admission.Admission) excludes
    foreign and stale actions, counted."""
    rules = _Rules(tokenizer, agents, vocab_size, max_context, default_temperature, admission)
    batch = Batch([], 0, [])
    for ep in episodes:
        if not ep.rewards:
            batch.skipped["episode_without_reward"] += 1
            continue
        kept, placed_on, last_of_agent = _episode_samples(ep, len(batch.episode_returns), rules, batch)
        if not kept:
            batch.skipped["episode_without_trainable_action"] += 1
            continue
        team, own = _place_rewards(ep, kept, placed_on, last_of_agent, batch.skipped)
        kept[-1].end = True
        for s in kept:
            s.parents = [len(batch.samples) + i for i in s.parents]
            s.ret = team + own.get(s.agent, 0.0)
        batch.samples += kept
        batch.episode_returns.append(sum(r.value for r in ep.rewards))
        batch.episode_ids.append(ep.id)
        batch.episode_groups.append(kept[0].group)
        batch.team_returns.append(team)
        batch.own_returns.append(own)
        batch.episodes += 1
    if batch.skipped:
        log.warning("skipped while building the batch: %s", dict(batch.skipped))
    if batch.flagged:
        log.info("flagged actions: %s", dict(batch.flagged))
    if not batch.samples:
        raise MarftError(f"nothing trainable in {len(episodes)} episodes (skipped: {dict(batch.skipped) or 'none'})")
    return batch
