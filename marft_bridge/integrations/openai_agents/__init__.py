"""The OpenAI Agents SDK: its runs as episodes (tracing processor) and their steps (runs)."""

from __future__ import annotations

from .tracing import (registered_processors, FIX, AgentsState, trace_processor, AGENTS, instrument, uninstrument)
from .runs import (ts, handoff_tool_name, FunctionStep, Run, tool_step)

__all__ = ['registered_processors', 'AGENTS', 'AgentsState', 'FIX', 'FunctionStep', 'Run', 'handoff_tool_name', 'instrument',
           'tool_step', 'trace_processor', 'ts', 'uninstrument']
