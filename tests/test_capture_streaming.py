"""Streaming capture against the real embedded server (``marft serve``): a streamed call stores the
same token ids, log-probs, prompt ids, adapter version and finish reason as the same request made
without streaming (same seed), the app gets the same chunks as without capture, and a capture
failure or an abandoned stream never breaks the app."""

from __future__ import annotations

import asyncio
from typing import TypedDict

import pytest
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from openai import AsyncOpenAI, OpenAI

import marft_bridge as mb
from marft_bridge.integrations import openai as oa
from marft_bridge.capture.recording import capture_stats, reset_capture_stats
from marft_bridge.serving import AdapterRegistry, ServerProcess
from marft_bridge.serving.fixtures import make_random_adapter

KEY = "stream-key"
SAMPLING = {"temperature": 1.0, "seed": 7, "max_tokens": 12}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stream-serving")
    reg = AdapterRegistry(tmp / "registry")
    for agent, seed in (("planner", 21), ("coder", 22)):
        reg.publish(agent, make_random_adapter(tiny_model_dir, tmp / agent, seed=seed, scale=2.0), promote=True)
    with ServerProcess(tiny_model_dir, reg.root, api_key=KEY, extra_args=["--threads", "1", "--max-tokens-limit", "64"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")


def reference(client: OpenAI, model: str, content: str) -> dict:
    """The same request, non-streaming and outside any capture."""
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], logprobs=True,
                                       extra_body={"return_token_ids": True}, **SAMPLING).model_dump()
    choice = r["choices"][0]
    return {"ids": choice["token_ids"], "lps": [c["logprob"] for c in choice["logprobs"]["content"]],
            "text": choice["message"]["content"], "prompt": r["prompt_token_ids"], "finish": choice["finish_reason"],
            "adapter": r["adapter"]}


def assert_exact(action, ref: dict, model: str) -> None:
    assert action.output.token_ids == ref["ids"] and len(ref["ids"]) == SAMPLING["max_tokens"]
    assert action.output.logprobs == ref["lps"]  # bit-exact floats
    assert action.output.text == ref["text"] and action.output.finish_reason == ref["finish"] == "length"
    assert action.observation.prompt_token_ids == ref["prompt"]
    assert action.token_source == "server" and "token_data_dropped" not in action.metadata
    assert ref["adapter"] == {"name": model, "version": 1}
    assert (action.policy.name, action.policy.version) == (model, 1)
    assert action.sampling.seed == 7 and action.sampling.max_tokens == 12


def stream_chunks(client: OpenAI, model: str, content: str) -> list[dict]:
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], stream=True,
                                            logprobs=True, extra_body={"return_token_ids": True}, **SAMPLING)
    with stream:
        return [c.model_dump() for c in stream]


def comparable(chunks: list[dict]) -> list[dict]:
    return [{k: v for k, v in c.items() if k not in ("id", "created")} for c in chunks]


class S(TypedDict, total=False):
    q: str
    plan: str
    code: str


def test_streaming_chatopenai_in_langgraph_nodes_is_exact(server, client, sqlite_store):
    def model(name: str) -> ChatOpenAI:
        return ChatOpenAI(model=name, base_url=server.base_url, api_key=KEY, streaming=True, logprobs=True,
                          extra_body={"return_token_ids": True}, max_retries=0, **SAMPLING)

    planner, coder = model("planner"), model("coder")
    g = StateGraph(S)
    g.add_node("planner", lambda s: {"plan": "".join(c.content for c in planner.stream(s["q"]))})  # .stream()
    g.add_node("coder", lambda s: {"code": coder.invoke(s["plan"]).content})  # invoke of a streaming model
    g.add_edge(START, "planner")
    g.add_edge("planner", "coder")
    g.add_edge("coder", END)
    app = mb.instrument(g.compile(), store=sqlite_store)
    out = app.invoke({"q": "Plan: add 2 and 3."})
    sqlite_store.flush()
    plan_ref = reference(client, "planner", "Plan: add 2 and 3.")
    code_ref = reference(client, "coder", out["plan"])
    assert (out["plan"], out["code"]) == (plan_ref["text"], code_ref["text"])
    p, c = sqlite_store.get_episode(app.last_episode_id).actions
    assert [a.agent for a in (p, c)] == ["planner", "coder"] and c.depends_on == [p.id]
    assert_exact(p, plan_ref, "planner")
    assert_exact(c, code_ref, "coder")
    assert p.metadata["stream_chunks"] >= SAMPLING["max_tokens"] + 2  # role chunk, one per token, finish


def test_raw_client_stream_inside_episode_is_exact_and_unchanged(client, sqlite_store):
    plain = stream_chunks(client, "planner", "hello")  # no capture active
    with mb.episode(store=sqlite_store, task="stream") as ep:
        captured = stream_chunks(client, "planner", "hello")
        # a second call quoting the first's streamed text depends on it
        text = "".join(c["choices"][0]["delta"]["content"] or "" for c in captured if c["choices"])
        stream_chunks(client, "coder", f"Review: {text}")
    assert comparable(captured) == comparable(plain)  # the app sees the same chunks as without capture
    assert any(c["choices"] and c["choices"][0].get("token_ids") for c in captured)
    sqlite_store.flush()
    a, b = sqlite_store.get_episode(ep.id).actions
    assert_exact(a, reference(client, "planner", "hello"), "planner")
    assert_exact(b, reference(client, "coder", f"Review: {text}"), "coder")
    assert b.depends_on == [a.id]


def test_async_stream_inside_episode_is_exact(server, client, sqlite_store):
    async def main():
        aclient = AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
        with mb.episode(store=sqlite_store) as ep:
            stream = await aclient.chat.completions.create(
                model="coder", messages=[{"role": "user", "content": "async"}], stream=True, logprobs=True,
                extra_body={"return_token_ids": True}, **SAMPLING)
            chunks = [c async for c in stream]
        return ep, chunks

    ep, chunks = asyncio.run(main())
    sqlite_store.flush()
    (a,) = sqlite_store.get_episode(ep.id).actions
    assert_exact(a, reference(client, "coder", "async"), "coder")
    assert a.metadata["stream_chunks"] == len(chunks)


def test_without_token_ids_the_stream_is_kept_for_retokenization(client, sqlite_store):
    with mb.episode(store=sqlite_store) as ep:
        stream = client.chat.completions.create(model="planner", messages=[{"role": "user", "content": "t"}],
                                                stream=True, **SAMPLING)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    sqlite_store.flush()
    (a,) = sqlite_store.get_episode(ep.id).actions
    assert a.output.text == text and a.output.token_ids is None and a.output.logprobs is None
    assert a.token_source == "retokenize" and a.policy.version == 1


def test_capture_failure_never_breaks_the_stream(client, sqlite_store, monkeypatch):
    plain = stream_chunks(client, "planner", "boom")

    def explode(self, chunk):
        raise RuntimeError("capture bug")

    monkeypatch.setattr(oa.StreamAccumulator, "add", explode)
    reset_capture_stats()
    with mb.episode(store=sqlite_store) as ep:
        captured = stream_chunks(client, "planner", "boom")
    assert comparable(captured) == comparable(plain)
    assert capture_stats()["by_where"] == {"openai.stream": 1}  # counted once, then capture stops for this stream
    sqlite_store.flush()
    assert sqlite_store.get_episode(ep.id).actions == []


def test_abandoned_stream_records_nothing(client, sqlite_store):
    reset_capture_stats()
    with mb.episode(store=sqlite_store) as ep:
        stream = client.chat.completions.create(model="planner", messages=[{"role": "user", "content": "stop"}],
                                                stream=True, logprobs=True, extra_body={"return_token_ids": True},
                                                **SAMPLING)
        with stream:
            first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    sqlite_store.flush()
    assert sqlite_store.get_episode(ep.id).actions == [] and capture_stats()["errors"] == 0
