"""The adapter version of actions served by vLLM, which does not report it: capture reads the live
version from the adapter registry the deployment publishes from (``use_registry``), against the
vLLM-shaped local server of test_capture_openai and a real registry whose versions are loaded into
that server through ``VLLMPublisher``."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from openai import AsyncOpenAI, OpenAI

import marft_bridge as mb
from marft_bridge.integrations import openai as oa
from marft_bridge.capture.recording import capture_stats, reset_capture_stats
from marft_bridge.serving import AdapterRegistry, VLLMPublisher
from marft_bridge.serving.fixtures import make_random_adapter
from test_capture_openai import VERSIONS, server, two_agents  # noqa: F401 - fixture reuse

AGENTS = ("writer", "reviewer", "planner")  # writer, reviewer: vLLM; planner: our server (says 3)


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    return make_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("ad") / "a", seed=1, rank=4)


@pytest.fixture
def registry(server, adapter_dir, tmp_path):
    """Versions 1-3 of each agent, version 2 live (loaded into the server before the registry says so)."""
    httpd, url = server
    reg = AdapterRegistry(tmp_path / "registry")
    for agent in AGENTS:
        for _ in range(3):
            reg.publish(agent, adapter_dir)
        reg.promote(agent, 1)
        reg.promote(agent, 2, publisher=VLLMPublisher(url))
    httpd.loaded.clear()
    return reg


@pytest.fixture(autouse=True)
def _fresh_capture():
    oa.instrument()  # the client hook, for the whole test (episode() and instrument() hold it too)
    reset_capture_stats()
    yield
    oa.use_registry(None)
    oa.uninstrument()


def served(sqlite_store, episode_id: str) -> list[tuple]:
    sqlite_store.flush()
    return [(a.agent, a.policy.version, a.metadata.get("adapter_version_source"), a.token_source)
            for a in sqlite_store.get_episode(episode_id).actions]


@pytest.mark.parametrize("asynchronous, streaming", [(False, False), (True, False), (False, True), (True, True)])
def test_chatopenai_graph_records_the_live_registry_version(server, sqlite_store, registry, asynchronous, streaming):
    httpd, url = server
    app = mb.instrument(two_agents(url, asynchronous, streaming, agents=("writer", "reviewer")), store=sqlite_store,
                        registry=registry.root)

    def run() -> list[tuple]:
        q = {"q": "what?"}
        out = asyncio.run(app.ainvoke(q)) if asynchronous else app.invoke(q)
        assert out["code"] == "reviewer answer to writer answer to what?"
        return served(sqlite_store, app.last_episode_id)

    assert run() == [("writer", 2, "registry", "server"), ("reviewer", 2, "registry", "server")]
    registry.promote("writer", 3, publisher=VLLMPublisher(url))
    assert httpd.loaded == [{"lora_name": "writer", "lora_path": str(registry.path("writer", 3)), "load_inplace": True}]
    assert run() == [("writer", 3, "registry", "server"), ("reviewer", 2, "registry", "server")]
    registry.rollback("writer", publisher=VLLMPublisher(url))
    assert run() == [("writer", 2, "registry", "server"), ("reviewer", 2, "registry", "server")]
    assert capture_stats()["errors"] == 0


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url, api_key="test", max_retries=0)


def text(response, stream: bool) -> str:
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in response if c.choices)
    return response.choices[0].message.content


def ask(url: str, model: str, stream: bool = False) -> str:
    """One call through the raw ``openai`` client; the answer's text."""
    messages = [{"role": "user", "content": "x"}]
    return text(client(url).chat.completions.create(model=model, messages=messages, stream=stream), stream)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_records_the_live_registry_version(server, sqlite_store, registry, stream):
    _, url = server
    oa.use_registry(str(registry.root))
    with mb.episode(store=sqlite_store) as ep:
        assert ask(url, "writer", stream) == "writer answer to x"
        registry.promote("writer", 3)
        assert ask(url, "writer", stream) == "writer answer to x"
    assert served(sqlite_store, ep.id) == [("writer", 2, "registry", "retokenize"), ("writer", 3, "registry", "retokenize")]


def test_a_stream_records_the_version_live_when_it_opened(server, sqlite_store, registry):
    _, url = server
    oa.use_registry(registry.root)
    with mb.episode(store=sqlite_store) as ep:
        stream = client(url).chat.completions.create(model="writer", messages=[{"role": "user", "content": "x"}],
                                                     stream=True)
        registry.promote("writer", 3)  # while the stream is read
        assert text(stream, True) == "writer answer to x"
    assert served(sqlite_store, ep.id) == [("writer", 2, "registry", "retokenize")]
    # vLLM swaps in place under a request in flight: the action says another version went live meanwhile
    meta = sqlite_store.get_episode(ep.id).actions[0].metadata
    assert (meta["adapter_version_changed"], meta["adapter_version_end"]) == (True, 3)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_version_promoted_while_the_server_answers_labels_only_later_requests(server, sqlite_store, registry,
                                                                                 asynchronous):
    httpd, url = server
    oa.use_registry(registry.root)
    httpd.on_request = lambda req: registry.promote("writer", 3)  # lands after v2's request went out
    try:
        with mb.episode(store=sqlite_store) as ep:
            if asynchronous:
                messages = [{"role": "user", "content": "x"}]
                reply = asyncio.run(AsyncOpenAI(base_url=url, api_key="test", max_retries=0).chat.completions.create(
                    model="writer", messages=messages))
                assert reply.choices[0].message.content == "writer answer to x"
            else:
                assert ask(url, "writer") == "writer answer to x"
            httpd.on_request = None
            assert ask(url, "writer") == "writer answer to x"
    finally:
        httpd.on_request = None
    assert served(sqlite_store, ep.id) == [("writer", 2, "registry", "retokenize"), ("writer", 3, "registry", "retokenize")]
    during, after = (a.metadata for a in sqlite_store.get_episode(ep.id).actions)
    assert (during.get("adapter_version_changed"), during.get("adapter_version_end")) == (True, 3)
    assert "adapter_version_changed" not in after and "adapter_version_end" not in after


def test_the_servers_adapter_version_wins(server, sqlite_store, registry):
    _, url = server
    oa.use_registry(registry)  # an AdapterRegistry works as well as its root
    with mb.episode(store=sqlite_store) as ep:
        assert ask(url, "planner") == "planner answer to x"
    assert registry.current("planner") == 2
    assert served(sqlite_store, ep.id) == [("planner", VERSIONS["planner"], "server", "retokenize")]


def test_missing_or_unreadable_registry_leaves_the_version_unknown(server, sqlite_store, registry, tmp_path):
    _, url = server
    oa.use_registry(tmp_path / "no-registry")
    with mb.episode(store=sqlite_store) as ep:
        assert ask(url, "writer") == "writer answer to x"
    assert served(sqlite_store, ep.id) == [("writer", None, None, "retokenize")]
    assert capture_stats()["by_where"] == {"openai.registry": 1}
    assert sqlite_store.get_episode(ep.id).metadata["capture_errors"] == 1  # the episode says so too
    assert not (tmp_path / "no-registry").exists()  # reading never creates a registry

    oa.use_registry(registry.root)
    (registry.root / "writer" / "state.json").write_text("{not json")
    with mb.episode(store=sqlite_store) as ep:
        assert ask(url, "writer") == "writer answer to x"
        assert ask(url, "unpublished") == "unpublished answer to x"  # an agent the registry does not manage
        assert ask(url, "org/base-model") == "org/base-model answer to x"  # not an adapter name at all
    assert [a[:2] for a in served(sqlite_store, ep.id)] == [("writer", None), ("unpublished", None), ("org/base-model", None)]
    assert capture_stats()["by_where"] == {"openai.registry": 2}  # only the unreadable state counts


def test_state_file_is_read_once_per_change(registry):
    live = oa.LiveVersions(registry.root)
    path = registry.root / "writer" / "state.json"
    assert live.get("writer") == 2
    # Rewrite in place with the same size and restore the times: to the cache nothing changed.
    st, state = path.stat(), path.read_text()
    with open(path, "r+") as f:
        f.write(state.replace('"current": 2', '"current": 1'))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert json.loads(path.read_text())["current"] == 1 and live.get("writer") == 2
    registry.promote("writer", 3)
    assert live.get("writer") == 3


def test_each_episode_reads_its_own_registry(server, sqlite_store, registry, adapter_dir, tmp_path):
    """The registry is a per-episode (per-app) setting; ``use_registry`` is only the default."""
    _, url = server
    other = AdapterRegistry(tmp_path / "other")
    for _ in range(5):
        other.publish("writer", adapter_dir)
    other.promote("writer", 5)

    class Pinned:  # any object with live_version(agent) works as a registry
        def live_version(self, agent):
            return 9 if agent == "writer" else None

    oa.use_registry(other)  # the process-wide default: used only where the episode names none
    with mb.episode(store=sqlite_store, registry=registry.root) as a:
        assert ask(url, "writer") == "writer answer to x"
        with mb.episode(store=sqlite_store) as nested:  # inherits its parent's registry
            ask(url, "writer")
    with mb.episode(store=sqlite_store, registry=Pinned()) as b:
        ask(url, "writer")
    with mb.episode(store=sqlite_store) as c:
        ask(url, "writer")
    oa.use_registry(None)
    with mb.episode(store=sqlite_store) as d:
        ask(url, "writer")
    assert [served(sqlite_store, e.id)[0][:3] for e in (a, nested, b, c, d)] == [
        ("writer", 2, "registry"), ("writer", 2, "registry"), ("writer", 9, "registry"), ("writer", 5, "registry"),
        ("writer", None, None)]
    assert capture_stats()["errors"] == 0
