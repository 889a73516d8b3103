"""Requests are validated at the boundary of a live `marft serve`: typed messages and content parts,
bounds on every numeric field, prompts longer than the context refused with the lengths named; every
refusal an OpenAI-shaped 4xx naming the field; an unexpected exception a 500 of the same shape,
logged with its request id; unknown top-level fields ignored."""

from __future__ import annotations

import logging

import httpx
import pytest

from marft_bridge.serving.fixtures import AppServer, DirectModel, make_random_adapter
from marft_bridge.serving.process import ServerProcess
from marft_bridge.serving.registry import AdapterRegistry

KEY = "val-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validation")
    reg = AdapterRegistry(tmp / "registry")
    reg.publish("planner", make_random_adapter(tiny_model_dir, tmp / "planner", seed=3), promote=True)
    with ServerProcess(tiny_model_dir, reg.root, api_key=KEY, extra_args=["--threads", "1", "--max-tokens-limit", "32"]) as srv:
        yield srv


def post(server, path, body):
    return httpx.post(server.base_url + path, json=body, headers=HEADERS, timeout=60)


def error_of(r, status=400):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def chat(**kw):
    return {"model": "planner", "messages": MSG, "max_tokens": 2, **kw}


@pytest.mark.parametrize("messages,param,text", [
    ([{"role": 7}], "messages.0", "does not match any of the expected tags"),
    ([{"role": "robot", "content": "x"}], "messages.0", "'system', 'developer', 'user', 'assistant', 'tool'"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages.0.content.0.text", "valid string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages.0.content.0.type", "'text'"),
    ([{"role": "user", "content": 5}], "messages.0.content", "valid"),
    ([{"role": "user"}], "messages.0.content", "Field required"),
    ([{"role": "tool", "content": "3"}], "messages.0.tool_call_id", "Field required"),
    ([{"role": "assistant"}], "messages.0", "needs content or tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]}],
     "messages.0.tool_calls.0.function.arguments", "valid string"),
    ([], "messages", "at least 1 item"),
    ("hello", "messages", "valid array"),
])
def test_bad_messages_are_refused_naming_the_field(server, messages, param, text):
    err = error_of(post(server, "/chat/completions", {"model": "planner", "messages": messages}))
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert text in err["message"] and err["message"].startswith(param)


@pytest.mark.parametrize("field,value", [
    ("seed", 2**70), ("seed", -1), ("seed", 1.5), ("n", 2), ("n", 0), ("top_logprobs", 21), ("top_logprobs", -1),
    ("max_tokens", 0), ("max_tokens", 10**30), ("max_tokens", True), ("max_tokens", "5"), ("max_completion_tokens", -3),
    ("temperature", -0.1), ("temperature", 1e300), ("temperature", "1"), ("top_p", 0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2**40), ("presence_penalty", 3), ("frequency_penalty", -2.5), ("presence_penalty", 0.5),
    ("repetition_penalty", 0), ("stop", 5), ("stop", ["x"] * 17), ("stream", "yes"), ("logprobs", 1),
    ("model", ""), ("model", 5), ("stream_options", {"include_usage": "yes"}),
    ("allowed_token_ids", []), ("allowed_token_ids", [True]), ("allowed_token_ids", ["a"]), ("allowed_token_ids", [-1]),
    ("allowed_token_ids", 5), ("allowed_token_ids", [10**6]), ("allowed_token_ids", [5] * 200),
])
def test_chat_numeric_and_typed_fields_are_bounded(server, field, value):
    err = error_of(post(server, "/chat/completions", chat(**{field: value})))
    assert err["param"] is not None and err["param"].split(".")[0] == field, err


@pytest.mark.parametrize("field,value", [("prompt", []), ("prompt", [1, "a"]), ("prompt", [[1, 2]]), ("prompt", 5),
                                         ("logprobs", 21), ("seed", 2**64), ("echo", True), ("prompt", [10**9])])
def test_completion_fields_are_checked(server, field, value):
    err = error_of(post(server, "/completions", {"model": "planner", "prompt": "x", "max_tokens": 2, field: value}))
    assert err["param"] is not None and err["param"].split(".")[0] == field, err


def test_prompt_longer_than_the_context_is_refused_with_the_lengths(server, tiny_model_dir):
    long = "y" * 1100  # one token per character: longer than the tiny model's 1024 positions
    n = len(DirectModel(tiny_model_dir).chat_prompt([{"role": "user", "content": long}]))
    err = error_of(post(server, "/chat/completions", {"model": "planner", "messages": [{"role": "user", "content": long}]}))
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert f"the prompt is {n} tokens" in err["message"] and "context is 1024 tokens" in err["message"]
    err = error_of(post(server, "/completions", {"model": "planner", "prompt": long}))
    assert err["code"] == "context_length_exceeded" and "the prompt is 1100 tokens" in err["message"]
    # Fits, but not with the max_tokens asked for: both numbers named.
    err = error_of(post(server, "/completions", {"model": "planner", "prompt": "y" * 1000, "max_tokens": 30}))
    assert err["param"] == "max_tokens" and "prompt (1000 tokens) + max_tokens (30)" in err["message"]
    # Without max_tokens the reply gets what is left of the context.
    r = post(server, "/completions", {"model": "planner", "prompt": "y" * 1020, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4


def test_good_bodies_pass_and_unknown_top_level_fields_are_ignored(server, tiny_model_dir):
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "add "}, {"type": "text", "text": "2 and 3"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    r = post(server, "/chat/completions", {"model": "planner", "messages": messages, "max_tokens": 2, "seed": 2**63 - 1,
                                           "return_token_ids": True, "some_future_option": {"x": [1]}, "logit_bias": {}})
    assert r.status_code == 200, r.text
    want = DirectModel(tiny_model_dir).chat_prompt([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "5"},
    ])
    assert r.json()["prompt_token_ids"] == want
    assert r.headers["x-request-id"].startswith("req-")
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
                               "logprobs", "top_logprobs", "tools", "tool_choice", "presence_penalty", "user")}
    r = post(server, "/chat/completions", {"model": "planner", "messages": MSG, "max_tokens": 2, **nulls})
    assert r.status_code == 200, r.text  # null is the default, as clients that send every option expect


def test_tool_fields_are_checked(server):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    err = error_of(post(server, "/chat/completions", chat(tools=tools, tool_choice={"type": "function", "function": {"name": "mul"}})))
    assert err["param"] == "tool_choice" and "'mul', which is not among tools" in err["message"]
    err = error_of(post(server, "/chat/completions", chat(tool_choice="required")))
    assert err["param"] == "tool_choice" and "needs tools" in err["message"]
    err = error_of(post(server, "/chat/completions", chat(tool_choice="sometimes", tools=tools)))
    assert err["param"] == "tool_choice"
    err = error_of(post(server, "/chat/completions", chat(tools=[{"type": "function", "function": {"name": "a b"}}])))
    assert err["param"] == "tools.0.function.name"
    err = error_of(post(server, "/chat/completions", chat(tools=tools, parallel_tool_calls="no")))
    assert err["param"] == "parallel_tool_calls"


def test_non_json_and_unknown_routes_answer_openai_shaped_json(server):
    for content in (b"{not json", b"", b"\xff\xfe", b"[]", b'"x"', b"null"):
        r = httpx.post(server.base_url + "/chat/completions", content=content, headers=HEADERS)
        assert error_of(r)["type"] == "invalid_request_error"
    err = error_of(httpx.get(server.base_url + "/nothing-here", headers=HEADERS), 404)
    assert err["type"] == "NotFoundError"
    error_of(httpx.get(server.base_url + "/chat/completions", headers=HEADERS), 405)
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["worker_restarts"] == 0


def test_an_unexpected_exception_is_a_json_500_logged_with_its_request_id(tiny_model_dir, caplog, monkeypatch):
    from marft_bridge.serving.engine import AdapterEngine
    from marft_bridge.serving.http.server import create_app

    engine = AdapterEngine(tiny_model_dir)
    try:
        def broken_submit(req):
            raise ZeroDivisionError("a bug")

        monkeypatch.setattr(engine, "submit", broken_submit)
        with AppServer(create_app(engine)) as srv, caplog.at_level(logging.ERROR, logger="marft_bridge.serving.http.server"):
            for stream in (False, True):
                r = httpx.post(srv.base_url + "/chat/completions", json={"model": "base", "messages": MSG, "stream": stream})
                err = error_of(r, 500)
                rid = r.headers["x-request-id"]
                assert err["type"] == "server_error" and err["code"] == "internal_error" and rid in err["message"]
                assert "a bug" not in err["message"]  # the log has the details, not the client
                assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)
    finally:
        engine.close()
