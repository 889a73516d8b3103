"""Raw ``openai`` client capture: the Responses API (``/responses``, plain and streamed) like chat
completions, dependencies by tool-call id, and ``mb.episode`` / ``mb.capture`` installing the hook
in a fresh process. Against the scripted local server of ``fake_responses``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from openai import OpenAI

import marft_bridge as mb
from fake_responses import USAGE, FakeServer

TOOL = {"type": "function", "name": "lookup", "description": "Weather.", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def srv():
    with FakeServer() as s:
        yield s


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url, api_key="test", max_retries=0)


def test_responses_call_is_captured_like_chat_completions(srv, sqlite_store):
    c = client(srv.url)
    history = [{"role": "user", "content": "weather?"},
               {"type": "function_call", "call_id": "call_0", "name": "lookup", "arguments": '{"city": "Rome"}'},
               {"type": "function_call_output", "call_id": "call_0", "output": "Rome: 25C"},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and Paris?"}]}]
    with mb.episode(store=sqlite_store) as ep:
        first = c.responses.create(model="triage-model", instructions="You route.", input="weather in Paris",
                                   tools=[TOOL], tool_choice="required", temperature=0.3, max_output_tokens=64)
        c.responses.create(model="triage-model", input=history, tools=[TOOL],
                           tool_choice={"type": "function", "name": "lookup"})
    assert first.output[0].call_id == "call_lookup"  # the app's response is untouched
    sqlite_store.flush()
    a, b = sqlite_store.get_episode(ep.id).actions
    assert [m.model_dump(exclude_none=True) for m in a.observation.messages] == [
        {"role": "system", "content": "You route."}, {"role": "user", "content": "weather in Paris"}]
    fn = {k: TOOL[k] for k in ("name", "description", "parameters", "strict")}
    assert a.observation.tools == [{"type": "function", "function": fn}] and a.observation.tool_choice == "required"
    assert a.output.tool_calls == [{"id": "call_lookup", "type": "function",
                                    "function": {"name": "lookup", "arguments": '{"city": "Paris"}'}}]
    assert (a.output.text, a.output.finish_reason, a.token_source) == ("", "tool_calls", "retokenize")
    assert a.sampling.model_dump(exclude_none=True) == {"temperature": 0.3, "max_tokens": 64}
    assert (a.agent, a.policy.name) == ("triage-model", "triage-model")
    assert a.metadata["usage"] == {k: v for k, v in USAGE.items() if isinstance(v, int)}
    # input items: function_call -> assistant tool_calls, function_call_output -> tool message
    assert [m.model_dump(exclude_none=True) for m in b.observation.messages] == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"id": "call_0", "type": "function",
                                              "function": {"name": "lookup", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "Rome: 25C"},
        {"role": "user", "content": "and Paris?"}]
    assert b.observation.tool_choice == {"type": "function", "function": {"name": "lookup"}}
    assert b.output.text == "Handing over." and b.output.tool_calls[0]["id"] == "call_handoff"


def test_streamed_responses_call_records_the_completed_response(srv, sqlite_store):
    c = client(srv.url)
    with mb.episode(store=sqlite_store) as ep:
        events = list(c.responses.create(model="echo-model", input="hello there", stream=True))
    assert [e.type for e in events][-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "echo: hello there"
    sqlite_store.flush()
    (a,) = sqlite_store.get_episode(ep.id).actions
    assert a.output.text == "echo: hello there" and a.output.finish_reason == "stop"
    assert a.metadata["stream_chunks"] == len(events) and a.observation.messages[0].content == "hello there"


def test_a_tool_result_depends_on_the_call_that_asked_for_it(srv, sqlite_store):
    """No output text to match: the edge comes from the tool-call id alone."""
    c = client(srv.url)
    with mb.episode(store=sqlite_store) as ep:
        ask = c.chat.completions.create(model="boss-model", messages=[{"role": "user", "content": "go"}])
        call = ask.choices[0].message.tool_calls[0]
        c.chat.completions.create(model="helper-model", messages=[{"role": "user", "content": "unrelated"}])
        c.chat.completions.create(model="boss-model", messages=[
            {"role": "user", "content": "go"}, ask.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Paris"}])
        r = c.responses.create(model="billing-model", input=[
            {"type": "function_call", "call_id": "call_add", "name": "add", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_add", "output": "5"}])
    sqlite_store.flush()
    first, other, second, third = sqlite_store.get_episode(ep.id).actions
    assert first.output.text == "" and first.output.tool_calls[0]["id"] == "call_helper"
    assert second.observation.messages[2].tool_call_id == "call_helper"
    assert (other.depends_on, second.depends_on) == ([], [first.id])
    assert second.output.tool_calls[0]["id"] == "call_add"
    assert third.depends_on == [second.id] and r.output_text == "billed: 5"


def test_episode_and_capture_install_the_hook_in_a_fresh_process(srv, tmp_path):
    script = textwrap.dedent(f"""
        import marft_bridge as mb
        from marft_bridge.store import TraceStore
        from openai import OpenAI
        store = TraceStore.open({str(tmp_path / "t.db")!r})
        c = OpenAI(base_url={srv.url!r}, api_key="x", max_retries=0)
        c.chat.completions.create(model="echo-model", messages=[{{"role": "user", "content": "outside"}}])
        with mb.capture(store=store) as cap:  # raw calls outside any run open nothing
            c.chat.completions.create(model="echo-model", messages=[{{"role": "user", "content": "in capture"}}])
        with mb.episode(store=store) as ep:
            c.responses.create(model="echo-model", input="in episode")
        store.flush()
        print(store.count(), cap.episode_ids, [a.output.text for a in store.get_episode(ep.id).actions])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={"NO_PROXY": "127.0.0.1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1 [] ['echo: in episode']", out.stdout
    assert json.dumps(srv.requests[-1]["input"]) == '"in episode"'


def test_responses_token_ids_and_logprobs_when_the_server_names_tokens(srv, sqlite_store):
    from fake_responses import LOGPROBS

    with mb.episode(store=sqlite_store) as ep:
        client(srv.url).responses.create(model="echo-model", input="hi", include=["message.output_text.logprobs"])
        client(srv.url).responses.create(model="echo-model", input="hi")
    sqlite_store.flush()
    exact, plain = sqlite_store.get_episode(ep.id).actions
    assert (exact.output.token_ids, exact.output.logprobs, exact.token_source) == ([40, 41, 42], LOGPROBS, "server")
    assert (plain.output.token_ids, plain.token_source) == (None, "retokenize")


def test_a_call_continuing_a_stored_response_depends_on_it_and_what_it_read(srv, sqlite_store):
    c = client(srv.url)
    with mb.episode(store=sqlite_store) as ep:
        # the fake server names a response by its input's length: three different lengths, three ids
        r1 = c.responses.create(model="writer-model", input="draft a haiku about rain")
        r2 = c.responses.create(model="writer-model", previous_response_id=r1.id, input="shorter")
        c.responses.create(model="writer-model", previous_response_id=r2.id, input="now in French please")
        c.responses.create(model="writer-model", input="unrelated")  # starts a new conversation
    assert len({r1.id, r2.id}) == 2
    sqlite_store.flush()
    a, b, d, e = sqlite_store.get_episode(ep.id).actions
    assert [m.content for m in b.observation.messages] == ["shorter"]  # the server holds the earlier turns
    assert (b.metadata["previous_response_id"], b.depends_on) == (r1.id, [a.id])
    assert d.depends_on == [a.id, b.id]  # the whole stored conversation: r2, and r1 it continued
    assert e.depends_on == []


def test_a_structured_answer_passed_on_re_serialised_is_still_a_dependency(srv, sqlite_store):
    """The app parses the planner's JSON into a pydantic model and hands ``model_dump_json()``
    (compact) to the next agent: that call depends on the planner's; an unrelated one does not."""
    from pydantic import BaseModel

    class Plan(BaseModel):
        city: str
        days: int

    c = client(srv.url)
    with mb.episode(store=sqlite_store) as ep:
        plan = Plan.model_validate_json(c.responses.create(model="plan-json-model", input="plan a trip").output_text)
        c.responses.create(model="echo-model", input=f"book this: {plan.model_dump_json()}")
        c.responses.create(model="echo-model", input="what is a trip?")
    sqlite_store.flush()
    planner, booker, other = sqlite_store.get_episode(ep.id).actions
    assert plan.model_dump_json() not in planner.output.text  # the compact form is not what the model wrote
    assert (booker.depends_on, other.depends_on) == ([planner.id], [])
