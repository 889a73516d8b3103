"""The demo: a seeded two-operator arithmetic task (``task``), a warm-started tiny base model
(``warmstart``), the planner → solver LangGraph app (``app``) and in-process evaluation
(``evaluate``). Submodules are imported on use so ``import marft_bridge.demo`` stays light.
"""
