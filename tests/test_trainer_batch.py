"""Episodes -> samples: topological order, tokens, reward placement, flags and counted skips."""

from __future__ import annotations

import pytest

from marft_bridge.errors import MarftError
from marft_bridge.schema import Action, Episode, Message, Observation, Output, Reward, SamplingParams
from marft_bridge.trainers.batch import build_batch
from marft_bridge.demo.tinymodel import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _episode():
    # Recorded out of order: the coder (step 1) is recorded first, the planner (step 0) second.
    coder = Action(id="c1", agent="coder", step=1,
                   observation=Observation(prompt_token_ids=[5, 6, 7]),
                   output=Output(text="xy", token_ids=[40, 41], logprobs=[-0.5, -0.25]),
                   sampling=SamplingParams(temperature=0.5))
    planner = Action(id="p1", agent="planner", step=0,
                     observation=Observation(messages=[Message(role="user", content="hi")]),
                     output=Output(text="ok", finish_reason="stop"))
    tool = Action(id="t1", agent="calc", step=1, kind="tool", depends_on=["p1"])
    coder2 = Action(id="c2", agent="coder", step=2, depends_on=["c1", "t1"],
                    observation=Observation(prompt_token_ids=[8]), output=Output(token_ids=[9], logprobs=[-1.0]))
    rewards = [Reward(value=1.0), Reward(value=0.5, agent="planner"), Reward(value=0.25, action_id="t1"),
               Reward(value=2.0, agent="coder")]
    return Episode(id="e1", actions=[coder, planner, tool, coder2], rewards=rewards)


def test_order_tokens_and_reward_placement(tok):
    b = build_batch([_episode()], tok, {"planner", "coder"}, len(tok), 1024, default_temperature=1.0)
    assert [s.action_id for s in b.samples] == ["p1", "c1", "c2"]  # topological: step 0 first
    p, c1, c2 = b.samples
    assert p.obs_ids == list(tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                     add_generation_prompt=True, tokenize=True)["input_ids"])
    assert p.act_ids == tok("ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # stopped: EOS
    assert p.beh_logp is None and p.temperature == 1.0
    assert c1.obs_ids == [5, 6, 7] and c1.act_ids == [40, 41] and c1.beh_logp == [-0.5, -0.25]
    assert c1.temperature == 0.5
    # planner: agent reward 0.5 + the tool action's 0.25 (the tool depends on the planner, via D);
    # coder's last action: team 1.0 + agent 2.0.
    assert [s.reward for s in b.samples] == [0.75, 0.0, 3.0]
    assert [s.end for s in b.samples] == [False, False, True]
    assert b.flagged == {"retokenized": 1, "no_behaviour_logprobs": 1}
    assert b.episode_returns == [3.75] and b.n_tokens == len(p.act_ids) + 3


def test_bad_input_is_skipped_and_counted(tok):
    good = _episode()
    no_reward = Episode(actions=[Action(agent="coder", observation=Observation(prompt_token_ids=[1]),
                                       output=Output(token_ids=[2]))])
    bad = Episode(actions=[
        Action(id="u", agent="stranger", observation=Observation(prompt_token_ids=[1]), output=Output(token_ids=[2])),
        Action(id="v", agent="coder", observation=Observation(prompt_token_ids=[1]), output=Output(token_ids=[10_000])),
        Action(id="w", agent="coder", observation=Observation(prompt_token_ids=[1] * 40), output=Output(token_ids=[2])),
        Action(id="x", agent="coder", observation=Observation(prompt_token_ids=[1]), output=Output(token_ids=[])),
    ], rewards=[Reward(value=1.0)])
    b = build_batch([good, no_reward, bad], tok, {"planner", "coder"}, len(tok), max_context=32,
                    default_temperature=1.0)
    assert b.episodes == 1 and len(b.samples) == 3
    assert b.skipped == {"episode_without_reward": 1, "agent_without_adapter": 1, "token_id_beyond_vocab": 1,
                         "longer_than_context": 1, "empty_output": 1, "episode_without_trainable_action": 1}


def test_nothing_trainable_is_a_clear_error(tok):
    ep = Episode(actions=[Action(agent="x", observation=Observation(prompt_token_ids=[1]), output=Output(token_ids=[2]))],
                 rewards=[Reward(value=1.0)])
    with pytest.raises(MarftError, match="nothing trainable in 1 episodes.*agent_without_adapter"):
        build_batch([ep], tok, {"coder"}, len(tok), 1024, 1.0)


def test_parents_are_the_nearest_trained_ancestors_across_the_batch(tok):
    # c2 depends on c1 directly and on p1 through the untrained tool step t1; indices are batch-wide.
    b = build_batch([_episode(), _episode().model_copy(update={"id": "e2"})], tok, {"planner", "coder"}, len(tok),
                    1024, default_temperature=1.0)
    assert [s.action_id for s in b.samples] == ["p1", "c1", "c2"] * 2
    assert [s.parents for s in b.samples] == [[], [], [0, 1], [], [], [3, 4]]
    # An untrained agent in between passes its own ancestors on.
    only_coder = build_batch([_episode()], tok, {"coder"}, len(tok), 1024, default_temperature=1.0)
    assert [(s.action_id, s.parents) for s in only_coder.samples] == [("c1", []), ("c2", [0])]
