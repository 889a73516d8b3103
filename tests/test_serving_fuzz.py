"""Fuzzing the HTTP surface of a live `marft serve` with hypothesis: chat and completion bodies with
wrong types, huge numbers, deep nesting, unicode and empty lists, mixed with valid fields. Every
answer is JSON (or, for a valid streamed request, server-sent events of JSON), never a 500, and a good
request succeeds after every batch of bad ones. Bounded: a fixed number of examples per endpoint,
derandomized, no deadline (CPU contention must not make it flaky)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marft_bridge.serving.fixtures import make_random_adapter
from marft_bridge.serving.process import ServerProcess
from marft_bridge.serving.registry import AdapterRegistry

KEY = "fuzz-key"
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
EXAMPLES = 150
BATCH = 25  # a good request after every this many bad ones
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)  # any unicode but lone surrogates
huge = st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**40, 1e308, -1e308, 2**70])
scalar = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | huge | st.floats(allow_nan=False, allow_infinity=False) | text
junk = st.recursive(scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4), max_leaves=12)


def deep(n: int):
    value = "x"
    for i in range(n):
        value = [value] if i % 2 else {"a": value}
    return value


nested = st.integers(20, 400).map(deep)
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "refusal", ""]) | junk},
                             optional={"text": text | junk, "refusal": text})
tool_call = st.fixed_dictionaries({"id": text | junk, "type": st.just("function") | junk,
                                   "function": st.fixed_dictionaries({"name": text | junk, "arguments": text | junk}) | junk})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot"]) | junk},
    optional={"content": text | st.lists(part, max_size=3) | junk | nested, "tool_calls": st.lists(tool_call, max_size=2) | junk,
              "tool_call_id": text | junk, "name": text | junk},
)
tool = st.fixed_dictionaries({"type": st.just("function") | junk,
                              "function": st.fixed_dictionaries({"name": st.sampled_from(["add", "a b", ""]) | text},
                                                                optional={"parameters": junk | nested})})
good_or_junk = lambda good: good | junk  # noqa: E731
sampling = {
    "model": good_or_junk(st.sampled_from(["planner", "base", "nope", ""])),
    "max_tokens": good_or_junk(st.integers(-5, 12)) | huge,
    "temperature": good_or_junk(st.floats(-1, 3, allow_nan=False)) | huge,
    "top_p": good_or_junk(st.floats(-1, 2, allow_nan=False)),
    "top_k": good_or_junk(st.integers(-3, 100)) | huge,
    "seed": good_or_junk(st.integers(-(2**64), 2**65)),
    "stop": good_or_junk(st.lists(text, max_size=3)) | text,
    "stream": good_or_junk(st.booleans()),
    "n": good_or_junk(st.integers(-1, 3)),
    "presence_penalty": good_or_junk(st.floats(-3, 3, allow_nan=False)),
    "return_token_ids": good_or_junk(st.booleans()),
    "stream_options": good_or_junk(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "allowed_token_ids": good_or_junk(st.lists(st.integers(-5, 200), max_size=4)),
    text.filter(lambda k: k not in {"model", "messages", "prompt"}): junk,  # unknown top-level fields
}
chat_fields = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=4) | junk | nested},
    optional={**{k: v for k, v in sampling.items() if isinstance(k, str)},
              "logprobs": good_or_junk(st.booleans()), "top_logprobs": good_or_junk(st.integers(-2, 30)),
              "tools": st.lists(tool, max_size=2) | junk, "parallel_tool_calls": good_or_junk(st.booleans()),
              "tool_choice": st.sampled_from(["auto", "none", "required", "sometimes"])
              | st.just({"type": "function", "function": {"name": "add"}}) | junk},
)
completion_fields = st.fixed_dictionaries(
    {"prompt": text | st.lists(text, max_size=2) | st.lists(st.integers(-5, 10**6), max_size=5) | junk | nested},
    optional={**{k: v for k, v in sampling.items() if isinstance(k, str)},
              "logprobs": good_or_junk(st.integers(-2, 30)), "echo": good_or_junk(st.booleans())},
)
VALID_CHAT = {"model": "planner", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
VALID_COMPLETION = {"model": "planner", "prompt": "hi", "max_tokens": 3}
valid_values = {  # values that pass, to put next to the broken one
    "temperature": st.floats(0, 2), "top_p": st.floats(0.1, 1), "top_k": st.integers(-1, 50), "seed": st.integers(0, 2**63 - 1),
    "stream": st.booleans(), "logprobs": st.booleans(), "return_token_ids": st.booleans(), "stop": st.lists(text, max_size=2),
}


@st.composite
def mutated(draw, valid: dict, fields: dict):
    """A valid body with a few valid extras and at most one field broken (or an unknown one added)."""
    body = dict(valid)
    for key in draw(st.lists(st.sampled_from(sorted(valid_values)), max_size=3, unique=True)):
        body[key] = draw(valid_values[key])
    if body.get("logprobs") is True and valid is VALID_COMPLETION:
        body["logprobs"] = 2
    if draw(st.booleans()):
        key = draw(st.sampled_from(sorted(fields)) | text)
        body[key] = draw(fields.get(key, junk))
    return body


named = {k: v for k, v in sampling.items() if isinstance(k, str)}
chat_body = chat_fields | mutated(VALID_CHAT, {**named, "messages": st.lists(message, max_size=3), "tools": st.lists(tool, max_size=2),
                                             "tool_choice": junk, "n": junk, "max_tokens": junk})
completion_body = completion_fields | mutated(VALID_COMPLETION, {**named, "prompt": junk, "echo": junk, "logprobs": junk})
# Whole bodies that are not objects, not JSON, or JSON that parsers choke on.
raw_body = st.one_of(
    junk.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=60),
    st.integers(50, 5000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(50, 5000).map(lambda n: b'{"messages":' * n + b"1" + b"}" * n),
    st.sampled_from([b'{"model": "planner", "messages": [], "max_tokens": 1e999999}', b'{"seed": NaN}',
                     b'{"model": "planner", "prompt": "x", "temperature": Infinity}', b"\xef\xbb\xbf{}"]),
)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    reg = AdapterRegistry(tmp / "registry")
    reg.publish("planner", make_random_adapter(tiny_model_dir, tmp / "planner", seed=4), promote=True)
    with ServerProcess(tiny_model_dir, reg.root, api_key=KEY,
                       extra_args=["--threads", "1", "--max-tokens-limit", "8", "--max-request-bytes", "65536"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=120) as c:
        yield c


class Checker:
    """Sends one fuzzed body, checks the answer, and after every BATCH sends a good request."""

    def __init__(self, http, path: str, good: dict):
        self.http, self.path, self.good, self.sent, self.statuses = http, path, good, 0, {}

    def __call__(self, content: bytes) -> None:
        r = self.http.post(self.path, content=content)
        self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400, 404, 413), (r.status_code, content[:300], r.text[:300])
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            for e in events[:-1]:
                assert "error" not in json.loads(e), e
        else:
            body = r.json()  # never anything but JSON
            if r.status_code != 200:
                assert set(body["error"]) == {"message", "type", "param", "code"}
        self.sent += 1
        if self.sent % BATCH == 0:
            self.check_good()

    def check_good(self) -> None:
        r = self.http.post(self.path, json=self.good)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2


def encode(body) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode()


def test_fuzz_chat_completions(http):
    check = Checker(http, "/chat/completions", {"model": "planner", "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2, "temperature": 0})

    @FUZZ
    @given(chat_body)
    def run(body):
        check(encode(body))

    run()
    check.check_good()
    assert check.sent >= EXAMPLES and check.statuses.get(400, 0) > EXAMPLES // 3  # mostly refused...
    assert check.statuses.get(200, 0) > 0  # ...but the generator does reach valid bodies too


def test_fuzz_completions(http):
    check = Checker(http, "/completions", {"model": "planner", "prompt": "hi", "max_tokens": 2, "temperature": 0})

    @FUZZ
    @given(completion_body)
    def run(body):
        check(encode(body))

    run()
    check.check_good()
    assert check.statuses.get(400, 0) > EXAMPLES // 3 and check.statuses.get(200, 0) > 0


def test_fuzz_raw_bodies(http):
    # Greedy, like the other good requests: a sampled one may draw EOS first and end after one token.
    chat = Checker(http, "/chat/completions", {"model": "planner", "messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 2, "temperature": 0})
    completions = Checker(http, "/completions", {"model": "planner", "prompt": "hi", "max_tokens": 2, "temperature": 0})

    @FUZZ
    @given(raw_body, st.booleans())
    def run(content, to_chat):
        (chat if to_chat else completions)(content)

    run()
    chat.check_good()
    completions.check_good()
    # (a 500 already fails in Checker) both endpoints got raw bodies and refused them as 400s
    assert chat.statuses.get(400, 0) > 0 and completions.statuses.get(400, 0) > 0
