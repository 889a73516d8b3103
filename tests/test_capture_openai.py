"""OpenAI-compatible capture against a real local HTTP server that answers like vLLM.

The server returns ``choices[].token_ids``, top-level ``prompt_token_ids`` and per-token
``logprobs``; for the models in ``VERSIONS`` it answers like our serving layer, with
``"adapter": {"name", "version"}``, for the others like vLLM, which says nothing about the adapter
version. Capture must sqlite_store them exactly, also through ``langchain_openai.ChatOpenAI`` (which drops
``token_ids`` itself). It also accepts vLLM's ``/v1/load_lora_adapter`` (requests kept in ``loaded``).
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypedDict

import pytest
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from openai import AsyncOpenAI, OpenAI

import marft_bridge as mb

VERSIONS = {"planner": 3, "coder": 7}  # served by `marft serve`; other models by vLLM
LOGPROBS = [-0.123456789012345, -1.5, -0.000244140625, -2.718281828459045]
# What vLLM's ChatCompletionResponse adds to OpenAI's fields (all null here); no adapter version.
VLLM_FIELDS = {"service_tier": None, "system_fingerprint": None, "prompt_logprobs": None, "kv_transfer_params": None}


def reply(req: dict) -> dict:
    """A deterministic vLLM-shaped chat completion for ``req``."""
    model = req["model"]
    last = req["messages"][-1]["content"]
    text = f"{model} answer to {last}" if model != "hostile" else "ok \ud800 done"  # a lone surrogate
    seed = sum(map(ord, model)) % 97
    ids = [seed + i for i in range(len(LOGPROBS))]
    choice: dict = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    body: dict = {"id": "cmpl-1", "object": "chat.completion", "created": 1, "model": model, "choices": [choice],
                  "usage": {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids)}}
    if model in VERSIONS:
        body["adapter"] = {"name": model, "version": VERSIONS[model]}
    else:
        body |= {"id": f"chatcmpl-{seed:032x}", **VLLM_FIELDS}
        choice["message"] |= {"tool_calls": [], "reasoning_content": None}
        choice["stop_reason"] = None
    if req.get("logprobs"):
        tokens = [f"token_id:{i}" for i in ids] if req.get("return_tokens_as_token_ids") else list("abcd")
        lps = LOGPROBS if model != "hostile" else [*LOGPROBS[:3], float("nan")]
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                          for t, lp in zip(tokens, lps)]}
    if req.get("return_token_ids"):
        choice["token_ids"] = ids if model != "broken" else ids[:2]
        body["prompt_token_ids"] = [1, 2, seed]
    return body


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "tiny llama"}'}}


def stream_reply(req: dict) -> list[dict]:
    """``reply(req)`` as vLLM streams it: role chunk with ``prompt_token_ids``, one chunk per token
    (``token_ids`` + ``logprobs.content``), the finish reason on the last token chunk, then usage.
    ``misaligned`` pairs ids and log-probs wrongly per chunk with equal totals; ``tooler`` streams a
    tool call in pieces."""
    full = reply(req)
    choice, model = full["choices"][0], req["model"]
    head = {k: full[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    head |= {"adapter": full["adapter"]} if "adapter" in full else {}
    first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    if "prompt_token_ids" in full:
        first["prompt_token_ids"] = full["prompt_token_ids"]
    chunks = [first]
    if model == "tooler":
        args = TOOL_CALL["function"]["arguments"]
        pieces = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "search", "arguments": args[:5]}},
                  {"index": 0, "function": {"arguments": args[5:]}}]
        chunks += [{**head, "choices": [{"index": 0, "delta": {"tool_calls": [p]}, "finish_reason": None}]} for p in pieces]
        chunks[-1]["choices"][0]["finish_reason"] = "tool_calls"
        return chunks
    text, lps = choice["message"]["content"], (choice.get("logprobs") or {}).get("content")
    ids, n = choice.get("token_ids"), len(LOGPROBS)
    cuts = [len(text) * i // n for i in range(n + 1)]
    for i in range(n):
        c: dict = {"index": 0, "delta": {"content": text[cuts[i]:cuts[i + 1]]}, "finish_reason": None,
                   "logprobs": {"content": lps[i:i + 1]} if lps else None}
        if ids is not None:
            c["token_ids"] = ids[i:i + 1]
        chunks.append({**head, "choices": [c]})
    if model == "misaligned":  # chunk 1 gets two ids, chunk 2 none: 4 and 4 in total
        chunks[1]["choices"][0]["token_ids"], chunks[2]["choices"][0]["token_ids"] = ids[:2], []
    chunks[-1]["choices"][0]["finish_reason"] = "stop"
    if (req.get("stream_options") or {}).get("include_usage"):
        chunks.append({**head, "choices": [], "usage": full["usage"]})
    return chunks


def completion(req: dict) -> tuple[bytes, str]:
    if req.get("stream"):
        events = "".join(f"data: {json.dumps(c)}\n\n" for c in stream_reply(req)) + "data: [DONE]\n\n"
        return events.encode(), "text/event-stream"
    return json.dumps(reply(req)).encode(), "application/json"


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/load_lora_adapter":  # vLLM answers plain text
            self.server.loaded.append(req)
            data, kind = f"Success: LoRA adapter '{req['lora_name']}' added successfully.".encode(), "text/plain"
        else:
            self.server.requests.append(req)
            if self.server.on_request is not None:  # a test's hook: something happens while the server works
                self.server.on_request(req)
            data, kind = completion(req)
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.requests, httpd.loaded, httpd.on_request = [], [], None
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")


def token_model(url: str, model: str, **kw) -> ChatOpenAI:
    return ChatOpenAI(model=model, base_url=url, api_key="test", temperature=0.5, max_tokens=16, logprobs=True,
                      extra_body={"return_token_ids": True, "top_k": 20}, max_retries=0, **kw)


class S(TypedDict, total=False):
    q: str
    plan: str
    code: str


def two_agents(url: str, asynchronous: bool = False, streaming: bool = False,
               agents: tuple[str, str] = ("planner", "coder")):
    """``agents[0]`` plans from ``q``, ``agents[1]`` codes from the plan; each node calls its own model."""
    first, second = agents
    planner, coder = token_model(url, first, streaming=streaming), token_model(url, second, streaming=streaming)
    g = StateGraph(S)
    if asynchronous:
        async def plan(s):
            return {"plan": (await planner.ainvoke(s["q"])).content}

        async def code(s):
            return {"code": (await coder.ainvoke(s["plan"])).content}
    else:
        def plan(s):
            return {"plan": planner.invoke(s["q"]).content}

        def code(s):
            return {"code": coder.invoke(s["plan"]).content}
    g.add_node(first, plan)
    g.add_node(second, code)
    g.add_edge(START, first)
    g.add_edge(first, second)
    g.add_edge(second, END)
    return g.compile()


def check_exact(ep, server_requests):
    planner, coder = ep.actions
    assert [a.agent for a in ep.actions] == ["planner", "coder"] and coder.depends_on == [planner.id]
    for a, model in ((planner, "planner"), (coder, "coder")):
        expected = reply(next(r for r in server_requests if r["model"] == model))
        choice = expected["choices"][0]
        assert a.output.token_ids == choice["token_ids"]
        assert a.output.logprobs == LOGPROBS  # bit-exact floats
        assert a.observation.prompt_token_ids == expected["prompt_token_ids"]
        assert a.output.text == choice["message"]["content"]
        assert a.token_source == "server"
        assert (a.policy.name, a.policy.version) == (model, VERSIONS[model])
        assert a.sampling.model_dump(exclude_none=True) == {"temperature": 0.5, "top_k": 20, "max_tokens": 16}
    assert planner.observation.messages[0].content == "what?"
    assert coder.observation.messages[0].content == "planner answer to what?"


def test_chatopenai_token_ids_and_logprobs_stored_exactly(server, sqlite_store):
    httpd, url = server
    httpd.requests.clear()
    app = mb.instrument(two_agents(url), store=sqlite_store)
    out = app.invoke({"q": "what?"})
    assert out["code"] == "coder answer to planner answer to what?"
    assert all(r["return_token_ids"] is True and r["logprobs"] is True for r in httpd.requests)
    sqlite_store.flush()
    check_exact(sqlite_store.get_episode(app.last_episode_id), httpd.requests)


def test_chatopenai_async_graph(server, sqlite_store):
    httpd, url = server
    httpd.requests.clear()
    app = mb.instrument(two_agents(url, asynchronous=True), store=sqlite_store)
    asyncio.run(app.ainvoke({"q": "what?"}))
    sqlite_store.flush()
    check_exact(sqlite_store.get_episode(app.last_episode_id), httpd.requests)


def test_direct_openai_client_inside_a_node(server, sqlite_store):
    _, url = server
    client = OpenAI(base_url=url, api_key="test", max_retries=0)
    critic = token_model(url, "planner")

    def plan(s):
        r = client.chat.completions.create(model="coder", messages=[{"role": "user", "content": s["q"]}],
                                           logprobs=True, temperature=0.0, extra_body={"return_token_ids": True})
        return {"plan": r.choices[0].message.content}

    g = StateGraph(S)
    g.add_node("author", plan)
    g.add_node("critic", lambda s: {"code": critic.invoke(s["plan"]).content})
    g.add_edge(START, "author")
    g.add_edge("author", "critic")
    app = mb.instrument(g.compile(), store=sqlite_store)
    app.invoke({"q": "hi"})
    sqlite_store.flush()
    author, crit = sqlite_store.get_episode(app.last_episode_id).actions
    assert (author.agent, author.kind, author.policy.version) == ("author", "llm", VERSIONS["coder"])
    assert author.output.token_ids == reply({"model": "coder", "messages": [{"content": "hi"}],
                                             "return_token_ids": True})["choices"][0]["token_ids"]
    assert author.output.logprobs == LOGPROBS and author.sampling.temperature == 0.0
    assert crit.depends_on == [author.id]


def test_plain_client_inside_episode_uses_message_flow(server, sqlite_store):
    _, url = server
    client = OpenAI(base_url=url, api_key="test", max_retries=0)
    with mb.episode(store=sqlite_store, task="relay") as ep:
        first = client.chat.completions.create(model="planner", messages=[{"role": "user", "content": "start"}])
        text = first.choices[0].message.content
        client.chat.completions.create(model="coder", messages=[{"role": "user", "content": f"Plan: {text}"}])
        client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "unrelated"}])
    sqlite_store.flush()
    a, b, c = sqlite_store.get_episode(ep.id).actions
    assert [x.agent for x in (a, b, c)] == ["planner", "coder", "coder"]
    assert b.depends_on == [a.id] and c.depends_on == []
    assert a.token_source == "retokenize" and a.output.token_ids is None and a.policy.version == 3


def test_token_ids_from_token_id_strings_and_mismatch_dropped(server, sqlite_store):
    _, url = server
    client = OpenAI(base_url=url, api_key="test", max_retries=0)
    with mb.episode(store=sqlite_store) as ep:
        client.chat.completions.create(model="planner", messages=[{"role": "user", "content": "x"}], logprobs=True,
                                       extra_body={"return_tokens_as_token_ids": True})
        client.chat.completions.create(model="broken", messages=[{"role": "user", "content": "y"}], logprobs=True,
                                       extra_body={"return_token_ids": True})
    sqlite_store.flush()
    a, b = sqlite_store.get_episode(ep.id).actions
    seed = sum(map(ord, "planner")) % 97
    assert a.output.token_ids == [seed, seed + 1, seed + 2, seed + 3] and a.output.logprobs == LOGPROBS
    assert b.output.token_ids is None and b.token_source == "retokenize"
    assert b.metadata["token_data_dropped"] == "4 log-probs for 2 token ids"
    assert b.policy.name == "broken" and b.policy.version is None


def test_hostile_token_data_and_text_lose_neither_the_action_nor_the_edge(server, sqlite_store):
    """A NaN log-prob and a lone surrogate in the answer: the app gets them as sent; the action is
    kept (token data dropped with the reason, the text repaired and said so), and the next call,
    which quotes the answer's valid part, still depends on it."""
    _, url = server
    client = OpenAI(base_url=url, api_key="test", max_retries=0)
    with mb.episode(store=sqlite_store) as ep:
        r = client.chat.completions.create(model="hostile", messages=[{"role": "user", "content": "x"}],
                                           logprobs=True, extra_body={"return_token_ids": True})
        assert r.choices[0].message.content == "ok \ud800 done"  # untouched for the app
        assert str(r.choices[0].logprobs.content[3].logprob) == "nan"
        client.chat.completions.create(model="planner", messages=[{"role": "user", "content": "you said: ok \ufffd done"}])
    sqlite_store.flush()
    a, b = sqlite_store.get_episode(ep.id).actions
    assert a.output.text == "ok \ufffd done" and a.metadata["text_repaired"].startswith("invalid Unicode")
    assert (a.output.token_ids, a.output.logprobs, a.token_source) == (None, None, "retokenize")
    assert a.metadata["token_data_dropped"].startswith("log-probs not finite")
    assert b.depends_on == [a.id]


def test_async_client_inside_episode(server, sqlite_store):
    _, url = server

    async def main():
        client = AsyncOpenAI(base_url=url, api_key="test", max_retries=0)
        with mb.episode(store=sqlite_store) as ep:
            await client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "z"}],
                                                 logprobs=True, extra_body={"return_token_ids": True})
        return ep

    ep = asyncio.run(main())
    sqlite_store.flush()
    (a,) = sqlite_store.get_episode(ep.id).actions
    assert a.output.logprobs == LOGPROBS and a.policy.version == 7 and a.token_source == "server"


def test_calls_outside_any_capture_record_nothing(server, sqlite_store):
    _, url = server
    mb.instrument(two_agents(url), store=sqlite_store)  # installs the client hook
    OpenAI(base_url=url, api_key="test", max_retries=0).chat.completions.create(
        model="planner", messages=[{"role": "user", "content": "x"}])
    two_agents(url).invoke({"q": "x"})
    sqlite_store.flush()
    assert sqlite_store.count() == 0


# -- streaming (vLLM-shaped chunks) ---------------------------------------------------------------


def test_streaming_chatopenai_graph_stored_exactly(server, sqlite_store):
    httpd, url = server
    httpd.requests.clear()
    app = mb.instrument(two_agents(url, streaming=True), store=sqlite_store)
    out = app.invoke({"q": "what?"})
    assert out["code"] == "coder answer to planner answer to what?"
    assert all(r["stream"] is True for r in httpd.requests) and len(httpd.requests) == 2
    sqlite_store.flush()
    ep = sqlite_store.get_episode(app.last_episode_id)
    check_exact(ep, httpd.requests)
    assert [a.output.finish_reason for a in ep.actions] == ["stop", "stop"]


def test_streaming_async_chatopenai_graph_stored_exactly(server, sqlite_store):
    httpd, url = server
    httpd.requests.clear()
    app = mb.instrument(two_agents(url, asynchronous=True, streaming=True), store=sqlite_store)
    asyncio.run(app.ainvoke({"q": "what?"}))
    sqlite_store.flush()
    check_exact(sqlite_store.get_episode(app.last_episode_id), httpd.requests)


def test_streaming_with_raw_response_headers(server, sqlite_store):
    httpd, url = server
    httpd.requests.clear()
    model = token_model(url, "planner", streaming=True, include_response_headers=True)  # with_raw_response inside
    app = mb.instrument(StateGraph(S).add_node("planner", lambda s: {"plan": model.invoke(s["q"]).content})
                        .add_edge(START, "planner").compile(), store=sqlite_store)
    assert app.invoke({"q": "what?"})["plan"] == "planner answer to what?"
    sqlite_store.flush()
    (a,) = sqlite_store.get_episode(app.last_episode_id).actions
    assert a.output.token_ids == reply(httpd.requests[0])["choices"][0]["token_ids"] and a.output.logprobs == LOGPROBS
    assert a.token_source == "server" and a.policy.version == VERSIONS["planner"]


def test_streamed_token_data_that_does_not_line_up_is_dropped_with_the_reason(server, sqlite_store):
    _, url = server
    client = OpenAI(base_url=url, api_key="test", max_retries=0)

    def stream(model: str, **extra) -> str:
        s = client.chat.completions.create(model=model, messages=[{"role": "user", "content": model}], stream=True,
                                           logprobs=True, extra_body=extra)
        return "".join(c.choices[0].delta.content or "" for c in s if c.choices)

    with mb.episode(store=sqlite_store) as ep:
        stream("misaligned", return_token_ids=True)
        stream("broken", return_token_ids=True)
        stream("planner", return_tokens_as_token_ids=True)
    sqlite_store.flush()
    mis, broken, planner = sqlite_store.get_episode(ep.id).actions
    for a in (mis, broken):
        assert a.output.token_ids is None and a.output.logprobs is None and a.token_source == "retokenize"
        assert a.output.text == f"{a.agent} answer to {a.agent}"
    assert mis.metadata["token_data_dropped"] == "stream chunk 1 with tokens: 1 log-probs for 2 token ids"
    assert broken.metadata["token_data_dropped"] == "4 log-probs for 2 token ids"
    seed = sum(map(ord, "planner")) % 97
    assert planner.output.token_ids == [seed, seed + 1, seed + 2, seed + 3] and planner.output.logprobs == LOGPROBS
    assert planner.token_source == "server" and planner.policy.version == VERSIONS["planner"]


def test_streamed_tool_call_pieces_are_joined(server, sqlite_store):
    _, url = server
    client = OpenAI(base_url=url, api_key="test", max_retries=0)
    with mb.episode(store=sqlite_store) as ep:
        chunks = list(client.chat.completions.create(model="tooler", messages=[{"role": "user", "content": "find"}],
                                                     stream=True))
    assert len(chunks) == 3
    sqlite_store.flush()
    (a,) = sqlite_store.get_episode(ep.id).actions
    assert a.output.tool_calls == [TOOL_CALL] and a.output.finish_reason == "tool_calls" and a.output.text == ""
    assert a.metadata["stream_chunks"] == 3
