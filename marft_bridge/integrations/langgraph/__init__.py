"""Capture LangGraph runs as Flex-POMDP episodes.

``instrument(app, store=None, reward_fn=None)`` wraps a compiled graph in place (and returns it):
``invoke``/``ainvoke``/``stream``/``astream`` (and ``batch``/``abatch``, which call them) return
exactly what they did, and each run becomes one Episode (``app.last_episode_id``); inside
``marft_bridge.episode(...)`` runs join that episode instead. ``uninstrument(app)`` undoes it.
``with capture(store=...):`` captures every graph run started in the block, for apps built
elsewhere. ``reward_fn(inputs, outputs) -> float`` adds a team reward per run (for streams,
``outputs`` is the list of streamed chunks).

What becomes what:
- An agent is a node, or the node's ``metadata={"agent_name": ...}``; nodes of subgraphs are
  named by their path (``"team/researcher"``); a graph with its own agent name
  (``create_agent(name=...)``: ``lc_agent_name``) different from the graph around it starts the
  path (``"researcher/model"``), wherever it runs, inside a tool too (``provenance.agent_path``). Each chat-model call inside a node is an ``llm``
  action (every call path reports to LangChain's callbacks: invoke, stream, batch, structured
  output, tool binding); the tools bound to it are ``observation.tools``. Each tool execution
  (``ToolNode``, ``create_agent``'s tool node, ``tool.invoke`` in a node) is a ``tool`` action of
  the agent whose model call asked for it (see ``tools.py``); a handoff tool's
  ``Command(graph=Command.PARENT, goto=...)`` is that tool step, and the agent it hands to depends
  on it. A direct ``openai`` client call in a node is an action too (see ``integrations.openai``).
  A node that calls no model and no tool is recorded as an ``env`` action (not trained).
- ``Action.step`` is the LangGraph superstep (offset so later runs of one episode come after
  earlier ones); actions of a subgraph take the superstep of the parent node that ran it, and
  the raw steps are kept in ``metadata["langgraph_steps"]``.
- ``depends_on`` follows the data, not the clock: the capture hooks LangGraph's Pregel loop
  (``tick`` / ``after_tick``) and keeps, per channel, the actions whose output the channel's
  current value came from (reducer channels accumulate, plain channels are replaced, cleared
  channels are dropped). A task depends on the provenance of the channels its node reads and
  of its triggers; a ``Send`` task on the task that sent it; a subgraph's first step on the
  parent task's inputs, and the parent's writes carry what the subgraph handed back: a value it
  writes that a subgraph channel holds (the very object) that channel's provenance, anything else
  (a value the node computed, the node's trigger) the subgraph's whole output provenance. Model
  calls later in the same node also depend on the node's earlier calls that ended before they
  started — not on one that raised (it handed nothing on), and not on a failed attempt's when
  LangGraph runs the node again (``RetryPolicy``; ``execution_info.node_attempt``, LangGraph >=
  1.1.3). Env nodes pass
  provenance along through their own action. Functional-API ``@task`` calls (``accept_push``)
  are agents named after the task, at the caller's step. A task's output reaches its caller
  through its future, which the capture hands over noting reads (``.result()``, ``await``): a
  task, or a model call of the entrypoint or task itself, depends on the caller's inputs, its
  earlier calls and the results it had read before starting it; a result never read gives no
  edge. A task that calls no model is recorded as an env action when its result is read.
- Runs on a checkpointed thread read what earlier runs there wrote. Runs that join one episode
  keep that provenance per (``thread_id``, ``checkpoint_ns``), so a later run depends on the
  earlier runs' actions as if it were one run; on ``Command(resume=...)`` the interrupted step's
  tasks keep their inputs, and those that had finished are not recorded again. A channel a
  captured run did not write since (``update_state``, ``Command(update=...)``) loses its old
  provenance unless it accumulates. A run that is an episode of its own starts without history:
  the earlier writers are in other episodes, and there are no edges across episodes. The history
  belongs to the episode's recorder and goes with it.

Two tiers. The public tier (``callbacks.py``) is a LangChain callback handler reading public run
metadata (``langgraph_checkpoint_ns``/``_node``/``_step``): agents, steps, model and tool calls.
The precision tier (``precision.py``, the only importer of LangGraph's private modules) hooks the
Pregel loop for the channel provenance above, only on LangGraph versions in
``precision.SUPPORTED``; elsewhere it logs once and an action depends on every action of earlier
steps of its run (``metadata["dependency_source"]`` says which: ``"langgraph_channels"`` or
``"langgraph_run_metadata"``). Its hooks are removed when the last instrumented app is
uninstrumented and no ``capture()`` block is open: the capture's state (``state.LangGraphState``)
exists only from the first instrumented app or open block to the last (``LANGGRAPH``). Channel kinds: ``channels.py``; the rules
themselves: ``provenance.py`` (pure).

Capture never breaks the app: every hook runs under ``capture_errors.guarded`` (errors logged
and counted in ``capture_errors.capture_stats()``), and episodes are written through ``store.submit``.
"""

from __future__ import annotations

from .instrumentation import LANGGRAPH, capture, in_captured_task, instrument, record_in_current_task, uninstrument
from .runs import CaptureHandler

__all__ = ["LANGGRAPH", "CaptureHandler", "capture", "in_captured_task", "instrument", "record_in_current_task",
           "uninstrument"]
