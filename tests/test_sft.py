"""``marft sft``: supervised fine-tuning of one LoRA per agent from captured traces (distillation from a
hosted model). Labels are the action's tokens only, rendered as the RL trainer renders them; each
adapter learns from its own agent's actions only; episodes are filtered by reward; recorded token ids
of another tokenizer are re-tokenised; bad input is counted, never truncated."""

from __future__ import annotations

import pytest
import torch
from test_trainer_tools_batch import TOOLS_BLOCK, ids, react_episode

from marft_bridge.adapter_names import adapter_name, adapters_by_agent, hosted_models_by_agent
from marft_bridge.demo.tinymodel import build_tokenizer
from marft_bridge.errors import MarftError
from marft_bridge.schema import Action, Episode, Message, Observation, Output, Policy, Reward
from marft_bridge.trainers.config import MarftConfig
from marft_bridge.trainers.sft_data import build_examples, split_episodes
from marft_bridge.trainers.supervised import action_nll, select_adapters, sft_policy

HOSTED = Policy(name="gpt-4.1-mini")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def hosted(ep: Episode) -> Episode:
    for a in ep.actions:
        if a.kind == "llm":
            a.policy = HOSTED
    return ep


def chat(agent: str, q: str, a: str, k: int, step: int = 0, depends: list[str] | None = None) -> Action:
    return Action(id=f"{agent}{k}", agent=agent, step=step, policy=HOSTED, depends_on=depends or [],
                  observation=Observation(messages=[Message(role="user", content=q)]),
                  output=Output(text=a, finish_reason="stop"))


def team(k: int, reward: float, agent_rewards: dict[str, float] | None = None) -> Episode:
    """planner -> solver, both on a hosted model: the planner writes the digits, the solver sums them."""
    x, y = k % 5, (k * 3) % 5
    plan = chat("planner", f"{x}+{y}", f"{x} {y}", k)
    solve = chat("solver", f"{x} {y}", str(x + y), k, step=1, depends=[plan.id])
    rewards = [Reward(value=reward)] + [Reward(value=v, agent=ag) for ag, v in (agent_rewards or {}).items()]
    return Episode(id=f"ep{k}", actions=[plan, solve], rewards=rewards)


# -- which adapter a hosted model's action trains --------------------------------------------------------


def test_two_agents_calling_one_hosted_model_train_two_adapters():
    eps = [team(k, 1.0) for k in range(2)]
    assert adapters_by_agent(eps) == {"planner": ["planner"], "solver": ["solver"]}  # never "gpt-4.1-mini"
    assert hosted_models_by_agent(eps) == {"planner": {"gpt-4.1-mini": 2}, "solver": {"gpt-4.1-mini": 2}}
    assert select_adapters(eps) == ["planner", "solver"]
    # Our adapter served it (marft serve / the registry reported its version, or the caller knows the
    # name as one of its adapters): the name stays.
    ours = chat("team/worker", "q", "a", 0).model_copy(update={"policy": Policy(name="worker", version=2)})
    assert adapter_name(ours) == "worker"
    named = chat("team/worker", "q", "a", 0).model_copy(update={"policy": Policy(name="worker")})
    assert adapter_name(named) == "team.worker" and adapter_name(named, {"worker"}) == "worker"
    # Token ids alone do not make a teacher ours (vLLM returns them too, from its own tokenizer).
    teacher = named.model_copy(update={"output": Output(text="a", token_ids=[5], logprobs=[-0.1])})
    assert adapter_name(teacher) == "team.worker"


# -- labels: the action's tokens only, token-exact -------------------------------------------------------


def test_a_tool_calling_action_is_rendered_as_rl_renders_it_labels_on_the_action_only(tok):
    ep = hosted(react_episode())
    ex = build_examples([ep], tok, {"agent"}, vocab_size=len(tok), max_context=4096)
    first, second = ex.by_adapter["agent"]
    prompt = TOOLS_BLOCK + "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert first.obs_ids == ids(tok, prompt)  # the tools offered are in the prompt, no loss on it
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    assert first.act_ids == ids(tok, call)  # the call up to and including the end-of-turn EOS
    assert second.obs_ids == ids(tok, prompt + call + "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>"
                                 "<|im_end|>\n<|im_start|>assistant\n")
    assert second.act_ids == ids(tok, "The sum is 5.<|im_end|>")
    assert ex.flagged == {"retokenized": 2} and not ex.skipped


def test_the_loss_is_the_nll_of_the_action_tokens_only(tiny_model_dir, tok):
    ep = hosted(react_episode())
    policy = sft_policy(tiny_model_dir, ["agent"], MarftConfig(device="cpu"), 0)
    first = build_examples([ep], tok, {"agent"}, vocab_size=len(tok), max_context=4096).by_adapter["agent"][0]
    nll, right = action_nll(policy, "agent", [first], 1, grad=False)
    # By hand: one forward of observation + action; only the positions that predict action tokens count.
    seq = torch.tensor([first.obs_ids + first.act_ids])
    with torch.no_grad(), policy.activate("agent"):
        logits = policy.model(input_ids=seq).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    o, n = len(first.obs_ids), len(first.act_ids)
    want = -sum(float(logp[o - 1 + j, first.act_ids[j]]) for j in range(n))
    assert nll == pytest.approx(want, rel=1e-5)
    assert right == sum(int(logits[o - 1 + j].argmax()) == first.act_ids[j] for j in range(n))
    # A changed observation token changes the loss only through the context: no label is ever on it.
    everything = -sum(float(logp[t - 1, seq[0, t]]) for t in range(1, o + n))
    assert everything > want + 1.0


# -- reward filter, split, bad input ---------------------------------------------------------------------


def test_the_reward_filter_keeps_team_or_own_rewards_at_the_bar(tok):
    eps = [team(0, 1.0), team(1, 0.0, {"solver": 1.0}), team(2, 0.5, {"planner": 0.0}),
           Episode(id="unrewarded", actions=team(3, 0).actions)]
    kw = dict(vocab_size=len(tok), max_context=4096)
    everything = build_examples(eps, tok, {"planner", "solver"}, **kw)
    assert [len(v) for v in everything.by_adapter.values()] == [4, 4] and everything.episodes == 4
    bar = build_examples(eps, tok, {"planner", "solver"}, min_reward=0.5, **kw)
    assert {a: [e.episode_id for e in v] for a, v in bar.by_adapter.items()} == {
        "planner": ["ep0", "ep2"], "solver": ["ep0", "ep2"]}
    assert bar.skipped == {"episode_below_min_reward": 1, "episode_without_team_reward": 1}
    own = build_examples(eps, tok, {"planner", "solver"}, min_reward=0.5, per_agent_reward=True, **kw)
    # ep1: the solver's own 1.0 passes, the planner falls back to the team's 0.0; ep2: the planner's own 0.0.
    assert {a: [e.episode_id for e in v] for a, v in own.by_adapter.items()} == {
        "planner": ["ep0"], "solver": ["ep0", "ep1", "ep2"]}
    assert own.skipped == {"action_below_min_reward": 2, "action_without_reward": 2}


def test_bad_input_is_skipped_and_counted_never_truncated(tok):
    long = team(0, 1.0)
    long.actions[0].output = Output(text="9" * 300, finish_reason="stop")
    other_tok = team(1, 1.0)  # a teacher's ids from another tokenizer: re-tokenised from the text
    other_tok.actions[1].output = Output(text="4", token_ids=[90001, 17], logprobs=[-0.1, -0.2], finish_reason="stop")
    same_tok = team(2, 1.0)  # ids of this tokenizer that decode to the text: used as recorded
    same_tok.actions[1].output = Output(text="1", token_ids=ids(tok, "1<|im_end|>"), finish_reason="stop")
    empty = team(3, 1.0)
    empty.actions[1].output = Output(text="", finish_reason="length")
    ex = build_examples([long, other_tok, same_tok, empty], tok, {"planner", "solver"}, vocab_size=len(tok),
                        max_context=64)
    assert ex.skipped == {"longer_than_context": 1, "empty_output": 1}
    assert ex.flagged == {"retokenized": 4, "retokenized_foreign_ids": 1}  # 8 actions: 2 skipped, 1 as recorded
    solver = {e.episode_id: e.act_ids for e in ex.by_adapter["solver"]}
    assert solver["ep1"] == ids(tok, "4<|im_end|>") and solver["ep2"] == ids(tok, "1<|im_end|>")
    assert "ep0" not in [e.episode_id for e in ex.by_adapter["planner"]]
    with pytest.raises(MarftError, match="unknown agent or adapter 'critic'"):
        select_adapters([team(0, 1.0)], ["critic"])


def test_the_held_out_split_is_by_episode_and_stable():
    ids_ = [f"e{k}" for k in range(20)]
    val = split_episodes(ids_, 0.1, seed=0)
    assert len(val) == 2 and val == split_episodes(list(reversed(ids_)), 0.1, seed=0)
    assert split_episodes(ids_, 0.1, seed=1) != val or len(val) == 2
    assert split_episodes(["a"], 0.5, 0) == set() and len(split_episodes(["a", "b"], 0.9, 0)) == 1
