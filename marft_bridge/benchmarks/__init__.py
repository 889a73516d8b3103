"""Benchmarks built to answer one question each, with exact evaluation where the task allows it.

``relay``: the codebook relay (encoder → relay(s) → decoder), its codes, prompts and warm start;
``exact``: its exact expected reward J by teacher-forced enumeration; ``graph``: the instrumented
LangGraph graph of its agents (capture → store → trainer); ``stats``: paired-seed statistics;
``ablation``: the arms (untrained, MARFT-A, independent PPO, shared policy) and one seed's run.
Submodules are imported on use so ``import marft_bridge.benchmarks`` stays light.
"""
