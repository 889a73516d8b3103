"""Rollout correction: ``max_version_lag`` drops (and counts) actions of old adapter versions; per
update and agent the train-inference log-prob gap on the actions the current version played."""

from __future__ import annotations

import pytest

from marft_bridge.schema import Episode
from marft_bridge.trainers.config import MarftConfig
from marft_bridge.trainers.marft import MarftTrainer
from marft_bridge.trainers.rollout import RolloutPolicy
from test_trainer import FAST, make_env, model_dir  # noqa: F401 - model_dir is a fixture


def _shift(eps: list[Episode], agent: str, delta: float) -> list[Episode]:
    """The episodes with ``agent``'s recorded behaviour log-probs moved by ``delta`` per token."""
    out = []
    for ep in eps:
        acts = [a.model_copy(update={"output": a.output.model_copy(update={"logprobs": [x + delta for x in
                                                                                          a.output.logprobs]})})
                if a.agent == agent else a for a in ep.actions]
        out.append(ep.model_copy(update={"actions": acts}))
    return out


def test_actions_more_than_n_versions_behind_are_dropped_and_counted(model_dir):  # noqa: F811
    env = make_env()
    tr = MarftTrainer(MarftConfig(**FAST), model_dir, agents=["a", "b"])
    old = env(RolloutPolicy(tr), 8, 1)  # played at version 0
    tr.train_on(env(RolloutPolicy(tr), 8, 2))
    tr.train_on(env(RolloutPolicy(tr), 8, 3))
    new = env(RolloutPolicy(tr), 8, 4)  # version 2 = the update count
    assert {a.policy.version for e in old for a in e.actions} == {0}
    assert {a.policy.version for e in new for a in e.actions} == {2}

    tr.config = tr.config.model_copy(update={"max_version_lag": 1})
    m = tr.train_on(old + new)  # old is 2 versions behind: both its actions per episode go
    assert m["skipped"] == {"stale_version": 16, "episode_without_trainable_action": 8}
    assert (m["episodes"], m["samples"]) == (8, 16)

    tr.config = tr.config.model_copy(update={"max_version_lag": 3})  # now 3 behind: kept
    m = tr.train_on(old + new)
    assert m["skipped"] == {} and m["samples"] == 32
    # A publisher's versions take the place of the update count: registry v7 makes new 5 behind.
    tr.policy_versions = {"a": 7}
    m = tr.train_on(new)
    assert m["skipped"] == {"stale_version": 8} and {s for s in m["per_agent"]} == {"b"}


def test_logprob_gap_on_the_current_versions_actions(model_dir):  # noqa: F811
    env = make_env(b_tokens=2)
    tr = MarftTrainer(MarftConfig(**FAST), model_dir, agents=["a", "b"])
    old = _shift(env(RolloutPolicy(tr), 4, 5), "b", -1.0)  # version 0, far off: not counted later
    tr.train_on(env(RolloutPolicy(tr), 8, 6))
    # An engine whose recorded log-probs for a sit 0.25 below the trainer's forward, on every token.
    new = _shift(env(RolloutPolicy(tr), 8, 7), "a", -0.25)
    m = tr.train_on(new + old)
    gap = m["logprob_gap"]
    b_tokens = sum(len(a.output.token_ids) for e in new for a in e.actions if a.agent == "b")
    assert gap["a"]["tokens"] == 8 and gap["b"]["tokens"] == b_tokens  # the version-1 actions only
    assert gap["a"]["mean"] == pytest.approx(0.25, abs=1e-5) and gap["a"]["max"] == pytest.approx(0.25, abs=1e-5)
    assert gap["b"]["max"] < 1e-5  # our own engine: the same forward
