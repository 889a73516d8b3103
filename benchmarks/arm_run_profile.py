"""Where one relay arm-run's seconds go, and what larger micro-batches would buy at what cost in J.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/arm_run_profile.py [--seeds 3] [--rounds 2] [--batch 64]

The issue-20 arm-run (MARFT-A, 3 hops, 12 iterations x 32 episodes, lr 2e-3, one thread) on seeds
100.., in one process after its imports, with each phase's exclusive wall seconds:

- graph and capture: the instrumented LangGraph graph, its capture and the SQLite store (the rollout
  minus the sampler);
- sampler: the KV-cached sampling of every agent's actions;
- no-grad passes: the proximal, reference and value passes and the M fold's log-probs;
- gradient passes: the policy and critic forwards and backwards;
- optimiser: the clipped Adam steps;
- exact J: the teacher-forced enumeration after every update (the curve itself);
- other: the rest (batching, advantages, adapter switches, trainer set-up).

Then the same runs with ``forward_batch_size`` ``--batch`` (the default config runs 16 sequences per
micro-batch; 64 puts an agent's 32 samples in one), alternating with the default ``--rounds`` times:
fastest seconds per seed side by side, and the largest |J difference| over the curves. A different
micro-batch changes the floating-point sums, so those curves are not bit-identical.

Last, an upper bound on what rewriting the same ops without transformers' and peft's Python could
save. One no-grad forward with an agent's adapter on one sequence of 2 tokens runs the model's ops on
almost no numbers: its wall time (median of 50) less its top-level ATen calls (counted with
``torch.profiler``) times one tiny ATen call's cost is the most Python a forward carries. A rewrite
still makes every call, so it saves at most that per model forward, times the run's model forwards
(counted in one more run of seed 100 with a forward pre-hook on the decoder stack).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PHASES = ["graph and capture", "sampler", "no-grad passes", "gradient passes", "optimiser", "exact J", "other"]


class PhaseClock:
    """Exclusive wall seconds per phase: a phase entered inside another is taken out of the outer one."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._stack: list[list] = []  # [phase, started, seconds spent in inner phases]

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            self._stack.append([phase, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                name, started, inner = self._stack.pop()
                spent = time.perf_counter() - started
                self.seconds[name] += spent - inner
                if self._stack:
                    self._stack[-1][2] += spent
        return timed


@contextmanager
def timed_phases(clock: PhaseClock):
    """The phases' functions wrapped by ``clock`` for the block, put back afterwards."""
    from marft_bridge.benchmarks import exact, graph
    from marft_bridge.trainers import backward, marft, passes, rollout

    targets = [(graph, "rollout", "graph and capture"), (rollout.RolloutPolicy, "act_many", "sampler"),
               (passes.SamplePasses, "rollout_stats", "no-grad passes"),
               (passes.SamplePasses, "token_logprobs", "no-grad passes"),
               (backward, "policy_backward", "gradient passes"),
               (backward, "critic_backward", "gradient passes"),
               (marft.MarftTrainer, "_step", "optimiser"), (exact, "chain_matrices", "exact J")]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in targets]
    try:
        for owner, name, phase in targets:
            setattr(owner, name, clock.wrap(phase, owner.__dict__[name]))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


@contextmanager
def forward_batch(n: int | None):
    """Every arm's config with ``forward_batch_size`` n for the block (None: the default config)."""
    from marft_bridge.benchmarks import ablation

    original = ablation.arm_config
    if n is not None:
        ablation.arm_config = lambda *a, **k: original(*a, **k).model_copy(update={"forward_batch_size": n})
    try:
        yield
    finally:
        ablation.arm_config = original


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3, help="seeds, from 100 (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of default / --batch (default 2)")
    p.add_argument("--batch", type=int, default=64, help="the larger forward_batch_size compared (default 64)")
    p.add_argument("--model-cache", default=str(ROOT / ".marft" / "models"), help="warm-started models")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from marft_bridge.benchmarks.ablation import RunSettings, run_arm, warm_imports
    from marft_bridge.benchmarks.relay import RelaySpec, WarmStartConfig, warm_start
    from marft_bridge.store import TraceStore

    spec = RelaySpec(hops=3)
    base = warm_start(spec, args.model_cache, WarmStartConfig())
    print(f"imports {warm_imports(base):.1f} s (left out of every figure)", file=sys.stderr, flush=True)
    seeds = list(range(100, 100 + args.seeds))
    sides = {"default (16)": None, f"forward_batch_size {args.batch}": args.batch}
    seconds: dict[str, dict[int, list[float]]] = {s: {} for s in sides}
    curves: dict[str, dict[int, list[float]]] = {s: {} for s in sides}
    clock = PhaseClock()
    with tempfile.TemporaryDirectory() as tmp:
        store = TraceStore.open(Path(tmp) / "traces.db")
        try:
            for r in range(args.rounds):
                for side, n in sides.items():
                    for seed in seeds:
                        profiled = r == 0 and n is None
                        with forward_batch(n), (timed_phases(clock) if profiled else nullcontext()):
                            run = run_arm(spec, base, "marft_a", seed, 2e-3, RunSettings(), store)
                        seconds[side].setdefault(seed, []).append(run["seconds"])
                        if curves[side].setdefault(seed, run["j"]) != run["j"]:
                            raise SystemExit(f"{side}, seed {seed}: the J curve changed between rounds")
                        print(f"round {r + 1}/{args.rounds} {side} seed {seed}: {run['seconds']:.2f} s",
                              file=sys.stderr, flush=True)
            with counted_forwards() as forwards:
                run_arm(spec, base, "marft_a", seeds[0], 2e-3, RunSettings(), store)
        finally:
            store.close()
    total = sum(seconds["default (16)"][seed][0] for seed in seeds)  # the profiled round
    clock.seconds["other"] = total - sum(clock.seconds.values())
    print(f"\nWhere an arm-run's seconds go (default config, round 1, {len(seeds)} seeds, per run):")
    print("| phase | s / run | share |\n|---|---|---|")
    for phase in PHASES:
        s = clock.seconds[phase] / len(seeds)
        print(f"| {phase} | {s:.2f} | {s / (total / len(seeds)):.0%} |")
    print(f"| all | {total / len(seeds):.2f} | 100% |")
    (a, b) = sides
    print(f"\nFastest of {args.rounds} rounds, s / run: {a} vs {b}")
    out = {"phases": {k: v / len(seeds) for k, v in clock.seconds.items()}, "seeds": {}}
    for seed in seeds:
        x, y = min(seconds[a][seed]), min(seconds[b][seed])
        diff = max(abs(u - v) for u, v in zip(curves[a][seed], curves[b][seed]))
        out["seeds"][seed] = {"default": x, "batched": y, "max_abs_dj": diff}
        print(f"  seed {seed}: {x:.2f} s vs {y:.2f} s ({x / y:.2f}x); max |J difference| {diff:.1e}, "
              f"bit-identical: {curves[a][seed] == curves[b][seed]}")
    out["forward"] = f = forward_cost(base, spec)
    per_run, bound = total / len(seeds), forwards[0] * f["python_ms"] / 1e3
    out.update(forwards=forwards[0], rewrite_bound_s=bound)
    print(f"\nOne no-grad forward, median of 50: 16 x 41 tokens {f['full_ms']:.2f} ms, 1 x 2 tokens {f['one_ms']:.2f} ms, "
          f"of which {f['calls']} top-level ATen calls x {f['call_us']:.1f} us; the Python around them at most "
          f"{f['python_ms']:.2f} ms per forward")
    print(f"{forwards[0]} model forwards per run: a rewrite of the same ops saves at most {bound:.2f} s of "
          f"{per_run:.2f} s ({bound / per_run:.0%})")
    return out


def forward_cost(base, spec) -> dict:
    """Median wall ms of a no-grad forward at the passes' micro-batch size and at 1 x 2 tokens; the
    latter's top-level ATen calls, one tiny call's microseconds, and the Python that leaves."""
    import statistics

    import torch
    from torch.profiler import profile

    from marft_bridge.benchmarks.ablation import arm_config
    from marft_bridge.trainers.marft import MarftTrainer
    from marft_bridge.trainers.policy import pack

    policy = MarftTrainer(arm_config("marft_a", spec, 2e-3, 100), base, agents=spec.agents).policy
    adapter = policy.adapters[0]

    def median_ms(fn, n: int = 51) -> float:
        walls = []
        for _ in range(n):  # the first one warms up
            started = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - started)
        return statistics.median(walls[1:]) * 1e3

    full = pack([[5] * 35] * 16, [[6] * 6] * 16, policy.pad_id, policy.device)
    one = pack([[5]], [[6]], policy.pad_id, policy.device)
    x = torch.ones(4)
    with torch.no_grad():
        full_ms = median_ms(lambda: policy.token_logprobs(adapter, full, torch.ones(96)))
        one_ms = median_ms(lambda: policy.token_logprobs(adapter, one, torch.ones(1)))
        with profile() as prof:
            policy.token_logprobs(adapter, one, torch.ones(1))
        call_us = median_ms(lambda: [torch.mul(x, x) for _ in range(1000)], 11)  # ms per 1000 = us per call
    calls = sum(1 for e in prof.events() if e.cpu_parent is None)
    return {"full_ms": full_ms, "one_ms": one_ms, "calls": calls, "call_us": call_us,
            "python_ms": max(one_ms - calls * call_us / 1e3, 0.0)}


@contextmanager
def counted_forwards():
    """``[n]``: the decoder stack's forwards in the block (a global forward pre-hook, removed after)."""
    import torch

    calls = [0]

    def count(module, args):
        if type(module).__name__.endswith("Model") and hasattr(module, "layers"):
            calls[0] += 1

    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        yield calls
    finally:
        handle.remove()

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
