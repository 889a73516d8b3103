"""Capture on real deepagents apps (``create_deep_agent``): its file tools over graph state
(``write_file`` / ``read_file`` / ``edit_file`` on the ``files`` channel, through a ``ToolRuntime``),
its ``task`` tool running declared sub-agents (each a ``create_agent(name=...)`` invoked inside the
tool), and the names those sub-agents are recorded under. The only fake is the chat model
(``tool_apps.ToolCallingModel``, emitting real tool calls); each dependency graph D written by hand
from docs/capture/dependency-graph.md ("Agent harnesses").

deepagents does not resolve beside the project's pins: this file runs in a venv of its own and
skips elsewhere. deepagents adds two hook nodes to every agent it builds,
``PatchToolCallsMiddleware.before_agent`` (the lead's and each sub-agent's) and the lead's
``_ParentNotifierMiddleware.after_agent``; they call no model and are recorded as ``env`` steps that
depend on what they read, as any such node."""

from __future__ import annotations

import pytest

deepagents = pytest.importorskip("deepagents")

import tool_apps as ta  # noqa: E402
from langchain_core.messages import AIMessage  # noqa: E402
from test_capture_tools import labels  # noqa: E402

import marft_bridge as mb  # noqa: E402
from marft_bridge.capture import recording  # noqa: E402

create_deep_agent = deepagents.create_deep_agent

BEFORE, AFTER = "PatchToolCallsMiddleware.before_agent:env#0", "_ParentNotifierMiddleware.after_agent:env#0"


def graph(store, episode_id) -> dict[str, list[str]]:
    store.flush()
    ep = store.get_episode(episode_id)
    names = labels(ep)
    for a in ep.actions:  # parallel `task` steps: named by the sub-agent they ran, not by recording order
        if a.kind == "tool" and a.metadata["tool.name"] == "task":
            names[a.id] = f"{a.agent}:tool:task[{a.metadata['tool.arguments']['subagent_type']}]"
    return {names[a.id]: sorted(names[d] for d in a.depends_on) for a in ep.actions}


def expect(d: dict[str, list[str]]) -> dict[str, list[str]]:
    return {k: sorted(v) for k, v in d.items()}


# -- 1. file tools: a reading step depends on the writer of what it read -----------------------------------


READERS = {
    "read_file": {"file_path": "/notes.md"},
    "edit_file": {"file_path": "/notes.md", "old_string": "NOTE-7", "new_string": "NOTE-8"},
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_file_tool_reading_a_file_depends_on_the_step_that_wrote_it(sqlite_store, reader):
    def policy(msgs):
        n = len(ta.tool_results(msgs))
        if n == 0:
            return AIMessage("", tool_calls=[ta.call("write_file", {"file_path": "/notes.md", "content": "NOTE-7"},
                                                     msgs)])
        if n == 1:
            return AIMessage("", tool_calls=[ta.call(reader, READERS[reader], msgs)])
        return AIMessage("done")

    app = mb.instrument(create_deep_agent(model=ta.ToolCallingModel(policy=policy), name="lead"), store=sqlite_store)
    out = app.invoke(ta.ask())
    assert out["files"]["/notes.md"]["content"] == ("NOTE-7" if reader == "read_file" else "NOTE-8")
    step = f"lead/model:tool:{reader}#0"
    written = "lead/model:tool:write_file#0"
    assert graph(sqlite_store, app.last_episode_id) == expect({
        f"lead/{BEFORE}": [],
        "lead/model:llm#0": [f"lead/{BEFORE}"],  # its trigger; the hook wrote nothing
        written: ["lead/model:llm#0"],  # the state it was handed holds only that call's reply
        "lead/model:llm#1": ["lead/model:llm#0", written],
        # the call that asked, and the state the tool node hands it: `files` (write_file wrote it) and
        # `messages` (both model calls' replies, write_file's ToolMessage) -- not the asking call only
        step: ["lead/model:llm#0", "lead/model:llm#1", written],
        "lead/model:llm#2": (["lead/model:llm#0", "lead/model:llm#1", written, step]),
        f"lead/{AFTER}": (["lead/model:llm#0", "lead/model:llm#1", "lead/model:llm#2", written, step]),
    })


# -- 2 and 3. `task`: sub-agents run inside a tool, named by their own names -------------------------------


def _researcher(msgs):
    if not ta.tool_results(msgs):
        return AIMessage("", tool_calls=[ta.call("add", {"a": 2, "b": 3}, msgs)])
    return AIMessage("sum " + msgs[-1].content)


def team(lead_name: str | None = "lead"):
    """A lead asking for both sub-agents in one reply (two `task` calls), each sub-agent its own model."""
    def lead(msgs):
        if not ta.tool_results(msgs):
            return AIMessage("", tool_calls=[
                ta.call("task", {"description": "add 2 and 3", "subagent_type": "researcher"}, msgs, 0),
                ta.call("task", {"description": "check the sum", "subagent_type": "critic"}, msgs, 1)])
        return AIMessage("done " + " | ".join(sorted(m.content for m in ta.tool_results(msgs))))

    subagents = [
        {"name": "researcher", "description": "Adds numbers.", "system_prompt": "You research.",
         "tools": [ta.add], "model": ta.ToolCallingModel(policy=_researcher)},
        {"name": "critic", "description": "Checks answers.", "system_prompt": "You critique.",
         "tools": [], "model": ta.ToolCallingModel(policy=lambda msgs: AIMessage("looks right"))},
    ]
    return create_deep_agent(model=ta.ToolCallingModel(policy=lead), subagents=subagents, name=lead_name)


def test_task_sub_agents_are_sources_of_their_task_steps(sqlite_store):
    recording.reset_capture_stats()
    app = mb.instrument(team(), store=sqlite_store)
    out = app.invoke(ta.ask())
    assert recording.capture_stats()["errors"] == 0
    assert out["messages"][-1].content == "done looks right | sum 5"
    asked = "lead/model:llm#0"
    r_first, r_answer, c_answer = "researcher/model:llm#0", "researcher/model:llm#1", "critic/model:llm#0"
    assert graph(sqlite_store, app.last_episode_id) == expect({
        f"lead/{BEFORE}": [],
        asked: [f"lead/{BEFORE}"],
        # each sub-agent starts from what its task step read: the call that asked (the state the lead's
        # tool node hands `task` holds nothing else); the two sub-agents do not depend on each other
        f"researcher/{BEFORE}": [asked],
        r_first: [asked, f"researcher/{BEFORE}"],
        "researcher/model:tool:add#0": [r_first],
        r_answer: [asked, r_first, "researcher/model:tool:add#0"],
        f"critic/{BEFORE}": [asked],
        c_answer: [asked, f"critic/{BEFORE}"],
        # the task step: the call that asked, and the sub-agent's answer (not every action inside it)
        "lead/model:tool:task[researcher]": [asked, r_answer],
        "lead/model:tool:task[critic]": [asked, c_answer],
        # the lead's next call reads the two ToolMessages: each task step and the answer in it
        "lead/model:llm#1": ([asked, "lead/model:tool:task[researcher]", "lead/model:tool:task[critic]",
                                    r_answer, c_answer]),
        f"lead/{AFTER}": ([asked, "lead/model:llm#1", "lead/model:tool:task[researcher]",
                                 "lead/model:tool:task[critic]", r_answer, c_answer]),
    })


@pytest.mark.parametrize("lead_name", ["lead", None], ids=["named-lead", "unnamed-lead"])
def test_two_sub_agents_are_two_agents_named_by_their_own_names(sqlite_store, lead_name):
    """deepagents compiles each declared sub-agent with ``create_agent(name=spec["name"])`` (LangChain's
    ``lc_agent_name``): each starts its own path, never ``lead/tools/model``, whatever the lead is named."""
    app = mb.instrument(team(lead_name), store=sqlite_store)
    app.invoke(ta.ask())
    sqlite_store.flush()
    ep = sqlite_store.get_episode(app.last_episode_id)
    lead = f"{lead_name}/model" if lead_name else "model"
    assert {(a.agent, a.kind) for a in ep.actions if a.kind != "env"} == {
        (lead, "llm"), (lead, "tool"),  # the lead's calls and its two task steps
        ("researcher/model", "llm"), ("researcher/model", "tool"), ("critic/model", "llm")}


# -- 2 with files: a sub-agent reading a file its lead wrote -----------------------------------------------


def test_a_sub_agent_reading_a_file_the_lead_wrote_depends_on_that_write(sqlite_store):
    """`task` hands the sub-agent the lead's state (``files`` included) through its ``ToolRuntime``."""
    def researcher(msgs):
        if not ta.tool_results(msgs):
            return AIMessage("", tool_calls=[ta.call("read_file", {"file_path": "/brief.md"}, msgs)])
        return AIMessage("read " + msgs[-1].content.splitlines()[-1])

    def lead(msgs):
        n = len(ta.tool_results(msgs))
        if n == 0:
            return AIMessage("", tool_calls=[ta.call("write_file", {"file_path": "/brief.md", "content": "BRIEF-1"},
                                                     msgs)])
        if n == 1:
            return AIMessage("", tool_calls=[ta.call("task", {"description": "read /brief.md",
                                                              "subagent_type": "researcher"}, msgs)])
        return AIMessage("done " + msgs[-1].content)

    sub = {"name": "researcher", "description": "Reads.", "system_prompt": "You research.", "tools": [],
           "model": ta.ToolCallingModel(policy=researcher)}
    app = mb.instrument(create_deep_agent(model=ta.ToolCallingModel(policy=lead), subagents=[sub], name="lead"),
                        store=sqlite_store)
    assert app.invoke(ta.ask())["messages"][-1].content == "done read BRIEF-1"
    written, asked = "lead/model:tool:write_file#0", "lead/model:llm#1"
    # what the task step read: the call that asked, and the lead's state (its messages, `files`)
    task_read = ["lead/model:llm#0", asked, written]
    r_first, r_read, r_answer = "researcher/model:llm#0", "researcher/model:tool:read_file#0", "researcher/model:llm#1"
    task = "lead/model:tool:task[researcher]"
    assert graph(sqlite_store, app.last_episode_id) == expect({
        f"lead/{BEFORE}": [],
        "lead/model:llm#0": [f"lead/{BEFORE}"],
        written: ["lead/model:llm#0"],
        asked: ["lead/model:llm#0", written],
        # the sub-agent starts from what its task step read
        f"researcher/{BEFORE}": task_read,
        r_first: ([*task_read, f"researcher/{BEFORE}"]),
        # it reads `files` as handed to it: the lead's write_file is the writer of what it read
        r_read: ([*task_read, r_first]),
        r_answer: ([*task_read, r_first, r_read]),
        task: ([*task_read, r_answer]),
        "lead/model:llm#2": ([*task_read, task, r_answer]),
        f"lead/{AFTER}": ([*task_read, task, r_answer, "lead/model:llm#2"]),
    })
