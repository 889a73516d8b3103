"""The environment interface for on-policy training and evaluation.

An environment is any callable ``env_fn(policy, n, seed) -> list[Episode]`` that runs the
multi-agent system ``n`` times with the current adapters and returns rewarded episodes. ``policy``
is a RolloutPolicy: an in-process sampler (``policy.act(agent, messages, ...)`` returns a complete
schema Action with prompt token ids, sampled ids and behaviour log-probs) and, for systems that call
a server instead, ``policy.save_adapters(dir)`` to publish the current adapters first. The trainer
consumes the returned episodes exactly like stored traces.

In-process sampling is KV-cached (``MultiAgentPolicy.sample``: one prefill of the left-padded
prompts, then one token per step) and reports the processed log-probs ``marft serve`` reports with
top-k/top-p off (log-softmax of logits / T), which equal the trainer's forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import torch

from ..schema import Action, Episode, Message, Observation, Output, Policy, SamplingParams


PROMPT_CACHE = 4096  # distinct rendered prompts a RolloutPolicy keeps


class RolloutPolicy:
    """The trainer's current adapters (or the untrained base, ``use_adapters=False``) as a sampler."""

    def __init__(self, trainer, use_adapters: bool = True):
        self.trainer = trainer
        self.use_adapters = use_adapters
        self.tokenizer = trainer.policy.tokenizer
        self._prompts: dict[tuple, list[int]] = {}  # rendered chat templates of this rollout's prompts

    @property
    def version(self) -> int:
        return self.trainer.update_count if self.use_adapters else 0

    def act(self, agent: str, messages: list[dict] | list[Message], *, max_new_tokens: int = 32,
            temperature: float = 1.0, generator: torch.Generator | None = None,
            depends_on: list[str] | None = None, step: int = 0) -> Action:
        return self.act_many(agent, [messages], max_new_tokens=max_new_tokens, temperature=temperature,
                             generator=generator, depends_on=[depends_on or []], step=step)[0]

    def act_many(self, agent: str, batch: list, *, max_new_tokens: int = 32, temperature: float = 1.0,
                 generator: torch.Generator | None = None, depends_on: list[list[str]] | None = None,
                 step: int = 0, allowed_token_ids: list[int] | None = None) -> list[Action]:
        """One sampled Action per message list (prompts of equal length are sampled as one batch);
        ``allowed_token_ids``: sample only among these, recorded so the trainer masks alike."""
        msgs = [[m if isinstance(m, Message) else Message(**m) for m in ms] for ms in batch]
        prompts = [self._prompt_ids(ms) for ms in msgs]
        outs = self.trainer.policy.sample(agent, prompts, max_new_tokens, temperature, generator,
                                          use_adapter=self.use_adapters, allowed_token_ids=allowed_token_ids)
        eos = self.tokenizer.eos_token_id
        actions = []
        for k, (ms, prompt, (ids, lps)) in enumerate(zip(msgs, prompts, outs)):
            stopped = bool(ids) and ids[-1] == eos
            text = self.tokenizer.decode(ids[:-1] if stopped else ids)
            actions.append(Action(
                agent=agent, step=step, kind="llm",
                observation=Observation(messages=ms, prompt_token_ids=prompt),
                output=Output(text=text, token_ids=ids, logprobs=lps, finish_reason="stop" if stopped else "length"),
                sampling=SamplingParams(temperature=temperature, max_tokens=max_new_tokens, logprobs_processed=True,
                                        allowed_token_ids=allowed_token_ids),
                policy=Policy(name=agent, version=self.version),
                depends_on=(depends_on[k] if depends_on else []),
            ))
        return actions

    def _prompt_ids(self, messages: list[Message]) -> list[int]:
        # Episodes of one rollout repeat their prompts (a task's inputs, every agent's instructions):
        # each distinct one is rendered once (the trainer makes a policy per rollout; a kept one
        # starts over past PROMPT_CACHE prompts).
        key = tuple((m.role, m.content or "") for m in messages)
        ids = self._prompts.get(key)
        if ids is None:
            if len(self._prompts) >= PROMPT_CACHE:
                self._prompts.clear()
            enc = self.tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in key],
                                                     add_generation_prompt=True, tokenize=True)
            ids = self._prompts[key] = list(enc["input_ids"])
        return list(ids)

    def save_adapters(self, directory: str | Path) -> Path:
        return self.trainer.save_adapters(directory)


class EnvFn(Protocol):
    def __call__(self, policy: RolloutPolicy, n: int, seed: int) -> list[Episode]: ...


def mean_return(episodes: list[Episode]) -> float:
    """Mean over episodes of the sum of all their rewards (team, agent and action)."""
    if not episodes:
        return float("nan")
    return sum(sum(r.value for r in ep.rewards) for ep in episodes) / len(episodes)


def evaluate(trainer, env_fn: Callable, n: int, seed: int, untrained: bool = False) -> float:
    """Mean episode return of ``n`` fresh rollouts: the trained system, or the untrained base."""
    return mean_return(env_fn(RolloutPolicy(trainer, use_adapters=not untrained), n, seed))
