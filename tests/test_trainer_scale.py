"""The trainer at scale, on CPU: chunked LM head, vectorised packing, token-budget micro-batches,
KV-cached rollouts; each checked against the direct (unchunked, per-token) computation."""

from __future__ import annotations

import random

import pytest
import torch

from marft_bridge.trainers import losses, microbatch
from marft_bridge.trainers.config import MarftConfig
from marft_bridge.trainers.logprobs import chunked_logprobs
from marft_bridge.trainers.policy import MultiAgentPolicy, pack

torch.set_num_threads(1)


def full_logprobs(h, head, targets, temp):
    z = head(h)
    logp_all = torch.log_softmax(z.to(torch.promote_types(z.dtype, torch.float32)) / temp[:, None], dim=-1)  # (N, V)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), losses.entropy(logp_all)


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_chunked_logprobs_and_entropy_equal_the_full_computation(chunk, dtype, tol):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16, generator=g) * 2)
    h = torch.randn(23, 16, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, 50, (23,), generator=g)
    temp = torch.rand(23, generator=g, dtype=dtype) + 0.3
    w = torch.randn(23, generator=g, dtype=dtype)
    v = torch.randn(23, generator=g, dtype=dtype)

    lp_full, ent_full = full_logprobs(h, head, targets, temp)
    (gh_full,) = torch.autograd.grad((lp_full * w).sum() + (ent_full * v).sum(), h)
    lp, ent = chunked_logprobs(h, head, targets, temp, chunk, with_entropy=True)
    (gh,) = torch.autograd.grad((lp * w).sum() + (ent * v).sum(), h)
    torch.testing.assert_close(lp, lp_full, atol=tol, rtol=tol)
    torch.testing.assert_close(ent, ent_full, atol=tol, rtol=tol)
    torch.testing.assert_close(gh, gh_full, atol=tol, rtol=tol)
    with torch.no_grad():
        lp_ng, none = chunked_logprobs(h, head, targets, temp, chunk)
    assert none is None
    torch.testing.assert_close(lp_ng, lp_full.detach(), atol=tol, rtol=tol)


def test_chunked_gradient_pass_keeps_only_chunk_inputs():
    # Under checkpointing, autograd saves no (chunk, vocab) tensor for backward: count saved elements.
    head = torch.nn.Linear(8, 4000, bias=False)
    h = torch.randn(64, 8, requires_grad=True)
    targets = torch.randint(0, 4000, (64,))
    temp = torch.ones(64)
    saved = []

    def pack_hook(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        lp, ent = chunked_logprobs(h, head, targets, temp, 16, with_entropy=True)
    assert max(saved) < 16 * 4000  # the unchunked pass saves (64, 4000) logits and softmax
    (lp.sum() + ent.sum()).backward()
    assert h.grad.shape == h.shape and torch.isfinite(h.grad).all()


def reference_pack(obs, acts, pad_id):
    """The previous per-token implementation, kept here as the specification."""
    t = max(len(o) + len(a) for o, a in zip(obs, acts))
    ids = torch.full((len(obs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(obs), t), dtype=torch.long)
    rows, cols, targets = [], [], []
    for b, (o, a) in enumerate(zip(obs, acts)):
        ids[b, : len(o) + len(a)] = torch.tensor(o + a)
        mask[b, : len(o) + len(a)] = 1
        for j, tok in enumerate(a):
            rows.append(b)
            cols.append(len(o) - 1 + j)
            targets.append(tok)
    return ids, mask, rows, cols, targets, [len(o) - 1 for o in obs]


def test_pack_is_the_per_token_reference():
    rng = random.Random(3)
    obs = [[rng.randrange(1, 90) for _ in range(rng.randrange(1, 12))] for _ in range(9)]
    acts = [[rng.randrange(1, 90) for _ in range(rng.randrange(1, 9))] for _ in range(9)]
    p = pack(obs, acts, 0, "cpu")
    ids, mask, rows, cols, targets, last = reference_pack(obs, acts, 0)
    assert torch.equal(p.input_ids, ids) and torch.equal(p.attention_mask, mask)
    assert p.rows.tolist() == rows and p.cols.tolist() == cols and p.targets.tolist() == targets
    assert p.last_obs.tolist() == last
    # Hand-checked: o=[5,6], a=[7,8,9] -> tokens 7,8,9 are predicted at positions 1,2,3.
    q = pack([[5, 6], [4]], [[7, 8, 9], [3]], 0, "cpu")
    assert q.input_ids.tolist() == [[5, 6, 7, 8, 9], [4, 3, 0, 0, 0]]
    assert q.rows.tolist() == [0, 0, 0, 1] and q.cols.tolist() == [1, 2, 3, 0] and q.targets.tolist() == [7, 8, 9, 3]


def test_micro_batch_plan_respects_the_budget_and_keeps_padding_small():
    rng = random.Random(0)
    lengths = [rng.randrange(50, 2000) for _ in range(200)]
    plan = microbatch.plan(lengths, 4096)
    assert sorted(i for b in plan for i in b) == list(range(200))
    assert all(len(b) * max(lengths[i] for i in b) <= 4096 for b in plan)
    padded = microbatch.padded_tokens(lengths, plan)
    assert padded <= 1.1 * sum(lengths)  # sorted: <10% padding (chunks of 4 in arrival order pad ~40%)
    unsorted = [list(range(k, min(k + 2, 200))) for k in range(0, 200, 2)]
    assert padded < microbatch.padded_tokens(lengths, unsorted)
    # Hand-checked: budget 10 over lengths [3, 12, 4, 5]: 12 alone (over budget), then 5+4 (2 x 5), then 3.
    assert microbatch.plan([3, 12, 4, 5], 10) == [[1], [3, 2], [0]]
    assert microbatch.weights([3, 1]) == [0.75, 0.25]
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        microbatch.plan([1], 0)


def test_kv_cached_rollout_logprobs_equal_the_trainer_forward(tiny_model_dir):
    policy = MultiAgentPolicy(tiny_model_dir, ["a", "b"], MarftConfig(), torch.device("cpu"))
    with torch.no_grad():  # a non-zero adapter, so the adapter path is really exercised
        for p in policy.adapter_params(policy.adapter_of["a"]):
            p.normal_(0, 0.2)
    prompts = [[5, 9, 11, 40], [7, 8], [30, 31, 32, 33, 34, 35, 36]]  # unequal: one left-padded batch
    out = policy.sample("a", prompts, 12, 0.7, torch.Generator().manual_seed(1))
    assert [len(t) for t, _ in out] != [0, 0, 0]
    acts = [t for t, _ in out]
    packed = pack(prompts, acts, policy.pad_id, "cpu")
    temp = torch.full((packed.targets.shape[0],), 0.7)
    with torch.no_grad():
        logp, _, _ = policy.token_logprobs(policy.adapter_of["a"], packed, temp)
    torch.testing.assert_close(torch.tensor([x for _, lp in out for x in lp]), logp, atol=1e-4, rtol=1e-4)
    # The cache really is used: the sampler runs one prefill and one single-token step per new token.
    calls = []
    hook = policy.backbone.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[1]),
                                                     with_kwargs=True)
    try:
        policy.sample("b", prompts, 6, 1.0, torch.Generator().manual_seed(2))
    finally:
        hook.remove()
    assert calls[0] == 7 and set(calls[1:]) <= {1}


def test_rollback_snapshot_is_on_the_host_and_copies_only_changed_groups():
    from marft_bridge.trainers.snapshot import RollbackSnapshot

    nets = {g: torch.nn.Linear(3, 2) for g in ("a", "b")}
    opts = {g: torch.optim.AdamW(n.parameters(), lr=0.1) for g, n in nets.items()}
    groups = {g: (dict(n.named_parameters()), opts[g]) for g, n in nets.items()}

    def step(g):
        nets[g](torch.ones(1, 3)).sum().backward()
        opts[g].step()
        opts[g].zero_grad()

    for g in nets:
        step(g)
    snap = RollbackSnapshot(pin=False)
    snap.take(groups)
    stable = {g: [p.detach().clone() for p in n.parameters()] for g, n in nets.items()}
    moments = {g: opts[g].state_dict()["state"][0]["exp_avg"].clone() for g in nets}
    assert all(t.device.type == "cpu" for w in snap.weights.values() for t in w.values())
    assert snap.nbytes() == 2 * (8 * 4 + 2 * 8 * 4 + 2 * 4)  # weights + 2 moments (fp32) + 2 step counters
    step("a")
    copied_before = snap.weights["b"]["weight"].data_ptr()
    snap.take(groups, changed=["a"])  # b did not change: its buffers are not touched
    assert snap.weights["b"]["weight"].data_ptr() == copied_before
    stable["a"] = [p.detach().clone() for p in nets["a"].parameters()]
    moments["a"] = opts["a"].state_dict()["state"][0]["exp_avg"].clone()
    step("a")
    step("a")
    snap.restore(groups, which=["a"])
    for g in nets:
        assert all(torch.equal(p, q) for p, q in zip(nets[g].parameters(), stable[g]))
        assert torch.equal(opts[g].state_dict()["state"][0]["exp_avg"], moments[g])
    step("a")  # the restored optimiser state is its own (not the snapshot's buffers)
    assert torch.equal(snap.weights["a"]["weight"], stable["a"][0])


def test_trainable_head_takes_the_checkpointed_path_with_equal_gradients():
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(8, 30, bias=False).double()  # e.g. LoRA on lm_head: the head itself needs a gradient
    h = torch.randn(11, 8, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 30, (11,), generator=g)
    temp = torch.full((11,), 0.5, dtype=torch.float64)
    lp_full, ent_full = full_logprobs(h, head, targets, temp)
    full = torch.autograd.grad(lp_full.sum() - 0.3 * ent_full.sum(), [h, head.weight])
    lp, ent = chunked_logprobs(h, head, targets, temp, 4, with_entropy=True)
    chunked = torch.autograd.grad(lp.sum() - 0.3 * ent.sum(), [h, head.weight])
    for a, b in zip(chunked, full):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.fixture(scope="module")
def episodes(tiny_model_dir):
    from test_trainer import make_env

    from marft_bridge.trainers.marft import MarftTrainer
    from marft_bridge.trainers.rollout import RolloutPolicy

    tr = MarftTrainer(MarftConfig(), tiny_model_dir, agents=["a", "b"])
    return make_env(3)(RolloutPolicy(tr), 12, 4)


def trained(model_dir, eps, **cfg):
    from marft_bridge.trainers.marft import MarftTrainer

    base = dict(ppo_epochs=2, num_minibatches=2, lr=1e-2, critic_lr=1e-2, critic_backbone="lora",
                target_modules=["q_proj", "v_proj", "o_proj"])
    tr = MarftTrainer(MarftConfig(**{**base, **cfg}), model_dir, agents=["a", "b"])
    m = tr.train_on(eps)
    return tr, m


def initial(model_dir):
    from marft_bridge.trainers.marft import MarftTrainer

    tr = MarftTrainer(MarftConfig(critic_backbone="lora", target_modules=["q_proj", "v_proj", "o_proj"]), model_dir,
                      agents=["a", "b"])
    return {n: p.detach().clone() for n, p in tr.named_weights().items()}


@pytest.mark.parametrize("mode", ["marft_a", "marft_t"])
def test_micro_batched_update_equals_the_unbatched_one(tiny_model_dir, episodes, mode):
    one, m1 = trained(tiny_model_dir, episodes, mode=mode, micro_batch_tokens=10**6, forward_batch_size=1000)
    # 1-token budget: every sequence is its own micro-batch in every pass (gradients accumulate over ~6).
    many, m2 = trained(tiny_model_dir, episodes, mode=mode, micro_batch_tokens=1, forward_batch_size=1000,
                       gradient_checkpointing=True, logits_chunk_tokens=2)
    w1, w2 = one.named_weights(), many.named_weights()
    assert w1.keys() == w2.keys() and any("marft_critic" in n for n in w1)
    # Float tolerance after 4 AdamW steps of lr 1e-2: summation order differs, and Adam's g / sqrt(v)
    # magnifies rounding in near-zero gradients to ~1e-5 (0.1% of one step); the updates are ~1e-2.
    for n in w1:
        torch.testing.assert_close(w2[n], w1[n], atol=5e-5, rtol=1e-4, msg=n)
    moved = max((w1[n] - w0).abs().max().item() for n, w0 in initial(tiny_model_dir).items())
    assert moved > 5e-3
    assert not torch.equal(w1["value_head.mlp.2.weight"], torch.zeros_like(w1["value_head.mlp.2.weight"]))
    for k in ("policy_loss", "kl_ref", "entropy", "approx_kl", "clipfrac", "behaviour_weight", "value_loss"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    assert m1["agent_order"] == m2["agent_order"] and m1["skipped_nonfinite"] == m2["skipped_nonfinite"] == 0


def test_gradient_checkpointing_is_on_in_gradient_passes_only(tiny_model_dir):
    policy = MultiAgentPolicy(tiny_model_dir, ["a"], MarftConfig(gradient_checkpointing=True), torch.device("cpu"))
    inner = policy.model.get_base_model()
    assert inner.is_activation_checkpointing and not policy.model.training
    with policy.grad_mode():
        assert policy.model.training  # transformers checkpoints decoder layers only in train mode
    assert not policy.model.training
    assert not MultiAgentPolicy(tiny_model_dir, ["a"], MarftConfig(), torch.device("cpu")).gradient_checkpointing
    assert inner.config._attn_implementation == "sdpa"


def test_fsdp2_without_a_process_group_is_refused_with_a_clear_message(tiny_model_dir):
    # fsdp2 shards over the ranks torchrun starts (tests/test_trainer_fsdp.py); alone it cannot run.
    from marft_bridge.errors import MarftError
    from marft_bridge.trainers.marft import MarftTrainer

    with pytest.raises(MarftError, match="parallelism 'fsdp2' shards the base over a process group and none"):
        MarftTrainer(MarftConfig(parallelism="fsdp2"), tiny_model_dir, agents=["a"])


def test_rollout_sampler_has_the_serving_engines_logprob_semantics(tiny_model_dir, tmp_path):
    # The trainer's KV-cached sampler and `marft serve`'s engine report the same processed log-probs
    # (log-softmax of logits / T) for the same adapter, and both equal the trainer's forward.
    from marft_bridge.serving.engine import AdapterEngine
    from marft_bridge.trainers.marft import MarftTrainer
    from marft_bridge.trainers.rollout import RolloutPolicy

    tr = MarftTrainer(MarftConfig(), tiny_model_dir, agents=["a", "b"])
    with torch.no_grad():
        for p in tr.policy.adapter_params(tr.policy.adapter_of["a"]):
            p.normal_(0, 0.2)
    tr.save_adapters(tmp_path / "adapters")
    msgs = [{"role": "user", "content": "hello there"}]
    act = RolloutPolicy(tr).act("a", msgs, max_new_tokens=10, temperature=0.7, generator=torch.Generator().manual_seed(5))
    engine = AdapterEngine(tiny_model_dir)
    try:
        engine.load_adapter("a", tmp_path / "adapters" / "a")
        res = engine.generate(act.observation.prompt_token_ids, adapter="a", max_tokens=10, temperature=0.7, seed=5)
    finally:
        engine.close()

    def forward(prompt, ids):
        packed = pack([prompt], [ids], tr.policy.pad_id, "cpu")
        with torch.no_grad():
            return tr.policy.token_logprobs(tr.policy.adapter_of["a"], packed, torch.full((len(ids),), 0.7))[0]

    torch.testing.assert_close(torch.tensor(act.output.logprobs), forward(act.observation.prompt_token_ids,
                                                                          act.output.token_ids), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(res.logprobs), forward(res.prompt_ids, res.token_ids), atol=1e-4, rtol=1e-4)


def test_every_pass_respects_the_token_budget(tiny_model_dir, episodes):
    from marft_bridge.trainers.marft import MarftTrainer

    tr = MarftTrainer(MarftConfig(ppo_epochs=1, num_minibatches=1, critic_backbone="lora", micro_batch_tokens=100,
                                  forward_batch_size=1000), tiny_model_dir, agents=["a", "b"])
    longest = max(len(a.observation.prompt_token_ids) + len(a.output.token_ids) for e in episodes for a in e.actions)
    assert longest <= 50  # so the budget fits two sequences: micro-batches really are cut by tokens
    shapes = []
    hook = tr.policy.backbone.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                        with_kwargs=True)
    try:
        tr.train_on(episodes)
    finally:
        hook.remove()
    # proximal + reference + critic, policy gradient, M fold and critic gradient passes: all within budget
    assert shapes and all(b * t <= 100 for b, t in shapes)
    assert max(b for b, _ in shapes) >= 2
    # 24 samples: proximal, reference, critic values, policy and critic gradients, and the pass after each
    # agent's update (its M fold, and every agent's KL-step diagnostic): 24 each
    assert sum(b for b, _ in shapes) == 6 * 24
