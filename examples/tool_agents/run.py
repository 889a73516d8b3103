"""A tool-calling supervisor app improved by marft_bridge, end to end, on one CPU machine:

1. a tiny base model is built and warm-started on demonstrations *captured from the app itself*
   (the same supervisor graph driven by a scripted chat model that emits real tool calls; the
   captured episodes go through the trainer's ``build_batch``, so the model learns exactly the
   token sequences the server will render — tools, Hermes ``<tool_call>`` blocks, tool results);
2. ``marft serve`` serves it with one LoRA adapter per agent (``supervisor``, ``math_expert``);
3. the app, with ``ChatOpenAI`` agents pointed at the server, is instrumented with one line and run:
   every model call, tool call and handoff is captured into the trace store;
4. one MARFT update from the store trains both adapters (every model call is a sample);
5. the new versions are published and hot-swapped into the running server; the next run's
   captured actions record version 2.

    python examples/tool_agents/run.py [--out .marft/tool_agents] [--episodes 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from app import ScriptedChatModel, build_app, question_text, questions, reward  # noqa: E402

AGENTS = ["supervisor", "math_expert"]
KEY = "example-key"


def _run(app, qs) -> float:
    wins = 0.0
    for op, a, b in qs:
        inputs = {"messages": [{"role": "user", "content": question_text(op, a, b)}]}
        wins += reward(inputs, app.invoke(inputs))
    return wins / len(qs)


def warm_start(out: Path, demos, steps: int, seed: int) -> Path:
    """SFT of a fresh tiny model on the demonstrations' (observation, action) token pairs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marft_bridge.demo.warmstart import pad_examples
    from marft_bridge.demo.tinymodel import build_tiny_model
    from marft_bridge.trainers.batch import build_batch

    target = out / "base"
    if (target / "config.json").is_file():
        return target
    raw = build_tiny_model(out / "base-init", seed=seed, hidden_size=64, num_layers=2, intermediate_size=256,
                           max_positions=2048)
    tok = AutoTokenizer.from_pretrained(raw)
    model = AutoModelForCausalLM.from_pretrained(raw)
    batch = build_batch(demos, tok, set(AGENTS), len(tok), 2048, 1.0)
    pairs = [(s.obs_ids + s.act_ids, len(s.obs_ids)) for s in batch.samples]
    print(f"warm start: {len(pairs)} (observation, action) pairs from {len(demos)} captured demonstrations; "
          f"skipped {dict(batch.skipped) or 'none'}")
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    t0 = time.time()
    for step in range(steps):
        pick = torch.randint(len(pairs), (8,), generator=gen).tolist()
        ids, attn, labels = pad_examples([pairs[i] for i in pick], tok.pad_token_id)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 50 == 0:
            print(f"  step {step + 1}/{steps}  loss {loss.item():.4f}  ({time.time() - t0:.0f} s)")
    model.eval()
    model.save_pretrained(target)
    tok.save_pretrained(target)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".marft/tool_agents", help="working directory (model, store, registry)")
    p.add_argument("--episodes", type=int, default=8, help="captured runs of the app before the update")
    p.add_argument("--warm-steps", type=int, default=300, help="SFT steps of the warm start")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import marft_bridge as mb
    from marft_bridge.cli import main as marft
    from marft_bridge.demo.app import chat_model
    from marft_bridge.serving import AdapterRegistry, EmbeddedServerPublisher, ServerProcess
    from marft_bridge.trainers import MarftConfig, MarftTrainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    qs = questions(6, args.seed)

    # 1. Demonstrations: the real app, driven by scripted models that emit real tool calls, captured.
    demo_store = mb.TraceStore.open(out / "demos.db")
    scripted = mb.instrument(build_app(ScriptedChatModel(role="supervisor"), ScriptedChatModel(role="math_expert")),
                             store=demo_store, reward_fn=reward)
    print(f"scripted team: accuracy {_run(scripted, qs * 4):.2f} on {len(qs) * 4} runs")
    demo_store.flush()
    demos = list(demo_store.episodes(source="langgraph"))
    print("\none captured demonstration (tool steps, handoffs, dependency graph D):")
    marft(["traces", "show", demos[-1].id, "--store", str(out / "demos.db")])
    base = warm_start(out, demos, args.warm_steps, args.seed)

    # 2. Serve: untrained adapters (LoRA B = 0, the warm base itself) as v1 of each agent.
    config = MarftConfig(mode="marft_a", lr=1e-3, ppo_epochs=2, num_minibatches=1, lora_r=8, seed=args.seed)
    trainer = MarftTrainer(config, base, agents=AGENTS, out_dir=out / "run")
    registry = AdapterRegistry(out / "registry")
    trainer.save_adapters(out / "v1")
    store = mb.TraceStore.open(out / "traces.db")
    with ServerProcess(base, registry, api_key=KEY) as srv:
        publisher = EmbeddedServerPublisher(srv.url, KEY)
        for agent in AGENTS:
            registry.promote(agent, registry.publish(agent, out / "v1" / agent), publisher=publisher)

        # 3. The app against the server, captured with one line.
        def agent_model(name):
            return chat_model(srv.url, name, api_key=KEY, temperature=0.7, max_tokens=96, timeout=300)

        app = mb.instrument(build_app(agent_model("supervisor"), agent_model("math_expert")), store=store,
                            reward_fn=reward, registry=registry)
        print(f"\nserved team (v1): accuracy {_run(app, (qs * 2)[:args.episodes]):.2f} on {args.episodes} runs")
        store.flush()
        episodes = list(store.episodes(source="langgraph"))
        print("\none captured episode against marft serve:")
        marft(["traces", "show", episodes[-1].id, "--store", str(out / "traces.db")])

        # 4. One MARFT update from the store.
        trainer.load_adapters(out / "v1")
        m = trainer.train_on(episodes)
        calls = sum(a.kind == "llm" for ep in episodes for a in ep.actions)
        tools = sum(a.kind == "tool" for ep in episodes for a in ep.actions)
        print(f"\nMARFT update: {calls} model calls and {tools} tool steps captured; {m['samples']} training samples "
              f"(skipped {m['skipped'] or 'none'}); reward {m['reward_mean']:.2f}, agent order {m['agent_order']}")
        trainer.save_adapters(out / "v2")

        # 5. Publish and hot-swap; the next run is served (and captured) by version 2.
        t0 = time.time()
        for agent in AGENTS:
            v = registry.publish(agent, out / "v2" / agent, metrics={"reward": m["reward_mean"]})
            registry.promote(agent, v, publisher=publisher)
        print(f"hot-swapped {', '.join(f'{a} v{registry.current(a)}' for a in AGENTS)} in {time.time() - t0:.2f} s "
              "(server kept running)")
        _run(app, qs[:1])
        store.flush()
        last = store.get_episode(app.last_episode_id)
        served = sorted({(a.policy.name, a.policy.version) for a in last.actions if a.kind == "llm" and a.policy})
        print(f"next run served by: {served}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
