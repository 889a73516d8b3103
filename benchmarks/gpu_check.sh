#!/usr/bin/env bash
# On a CUDA machine: one short MARFT update (bf16 base, fp32 adapters and value head, checked),
# then the throughput/memory benchmark on the GPU. CI has no GPU; run this by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"

"$PY" - <<'PY'
import tempfile, time, torch
assert torch.cuda.is_available(), "no CUDA device visible"
from marft_bridge.tinymodel import build_tiny_model
from marft_bridge.trainers import MarftConfig, MarftTrainer, RolloutPolicy
from marft_bridge.schema import Episode, Reward

with tempfile.TemporaryDirectory() as d:
    base = build_tiny_model(f"{d}/base", hidden_size=256, num_layers=4)
    tr = MarftTrainer(MarftConfig(ppo_epochs=2, num_minibatches=2, lr=1e-3), base, agents=["a", "b"])
    assert tr.device.type == "cuda", tr.device
    assert next(tr.policy.backbone.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for n, p in tr.policy.model.named_parameters() if "lora_" in n)
    assert all(p.dtype == torch.float32 for p in tr.head.parameters())
    pol, g = RolloutPolicy(tr), torch.Generator().manual_seed(0)
    eps = []
    for i in range(32):
        a = pol.act("a", [{"role": "user", "content": "go"}], max_new_tokens=4, generator=g)
        b = pol.act("b", [{"role": "user", "content": a.output.text}], max_new_tokens=4, generator=g,
                    depends_on=[a.id], step=1)
        eps.append(Episode(actions=[a, b], rewards=[Reward(value=float(i % 2))]))
    t0 = time.perf_counter()
    m = tr.train_on(eps)
    torch.cuda.synchronize()
    print(f"one update on {torch.cuda.get_device_name()}: {time.perf_counter() - t0:.2f}s, "
          f"kl {m['kl_ref']:.4g}, entropy {m['entropy']:.4g}, value loss {m['value_loss']:.4g}, "
          f"peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    assert m["skipped_nonfinite"] == 0 and not m["rolled_back"]
    with tempfile.TemporaryDirectory() as c:
        tr.save_checkpoint(c)
        tr.load_checkpoint(c)
print("gpu update: OK")
PY

"$PY" benchmarks/trainer_throughput.py --device cuda --hidden 1024 --layers 8 --episodes 32 \
    --obs-len 256 --act-len 128 --epochs 5 --forward-batch 32
