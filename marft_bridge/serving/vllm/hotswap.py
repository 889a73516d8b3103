"""The hot-swap scenario against a running vLLM multi-LoRA server: swaps under load lose no request,
every response comes from a version that was live while it was in flight, and corrupt or over-rank
adapters are refused while the old version keeps serving.

vLLM does not say which version answered, so responses are attributed by their output: every
version is first loaded under a name of its own (``<agent>-v<N>``) to record its greedy output, and
a response must equal the output of a version live between the moment its request went out and the
moment it came back. The versions' outputs must differ for that to prove anything (checked).

Unlike ``marft serve`` (a request finishes on the version it started on), vLLM swaps in place: a
request in flight decodes its next tokens with the new weights. Such a response begins as a live
version's output and leaves it; it is counted in ``switched_in_flight`` (its tail cannot be
recomputed: it was decoded on the old version's KV cache), and only an output that fits neither
case is a failure.
``benchmarks/vllm_hotswap.py`` runs it by hand; ``tests/vllm/test_hotswap.py`` in CI.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import MarftError
from ..adapter_files import AdapterError
from ..publishers import VLLMPublisher

if TYPE_CHECKING:
    from ..registry import AdapterRegistry

PROMPT = [{"role": "user", "content": "Write one short sentence about the sea."}]
SWAPS = 5  # versions swapped in under load, after the first


@dataclass
class HotSwapReport:
    responses: int = 0
    errors: list[str] = field(default_factory=list)
    swaps: int = 0
    swap_latencies_s: list[float] = field(default_factory=list)  # load call -> first response from it
    load_call_s: list[float] = field(default_factory=list)  # the load calls under load
    served_versions: list[int] = field(default_factory=list)
    switched_in_flight: int = 0  # responses begun on one version and finished on the next (see run_hotswap)
    refused: dict[str, str] = field(default_factory=dict)  # bad adapter kind -> the server's answer
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lat = self.swap_latencies_s
        return (f"{self.responses} responses under load, {len(self.errors)} errors, {self.swaps} swaps, versions "
                f"served {self.served_versions}, {self.switched_in_flight} switched version in flight; swap latency (load call -> first response from the new version) "
                f"median {statistics.median(lat) * 1000:.0f} ms, max {max(lat) * 1000:.0f} ms; load call under load "
                f"median {statistics.median(self.load_call_s) * 1000:.0f} ms; refused: {', '.join(self.refused)}"
                if lat and self.load_call_s else f"{len(self.failures)} failures")


def run_hotswap(
    url: str,
    registry: AdapterRegistry,
    agent: str,
    *,
    api_key: str | None = None,
    over_rank_adapter: str | Path | None = None,
    clients: int = 4,
    requests: int = 100,
    max_tokens: int = 8,
    prompt: list[dict] | None = None,
) -> HotSwapReport:
    """Run the scenario with the last ``SWAPS + 1`` versions of ``agent`` in ``registry``, ``clients``
    threads sending greedy requests until every version has answered ``clients * requests / (SWAPS + 1)``
    requests sent after its load call returned. ``over_rank_adapter``: an adapter of a rank
    above the server's ``--max-lora-rank``, which must be refused too. Leaves the last version loaded
    under ``agent`` and unloads the per-version names."""
    import httpx

    versions = registry.versions(agent)[-(SWAPS + 1):]
    if len(versions) < SWAPS + 1:
        raise MarftError(f"need {SWAPS + 1} versions of {agent!r} in {registry.root}, found {len(versions)}")
    pub = VLLMPublisher(url, api_key)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    report = HotSwapReport()
    with httpx.Client(base_url=pub.url, headers=headers, timeout=300) as http:
        complete = _Chat(http, prompt or PROMPT, max_tokens)
        swap = _Swapper(pub, registry, agent)
        # 1. Reference outputs: each version under its own name.
        expected = {}
        for v in versions:
            swap.load(v, name=f"{agent}-v{v}")
            expected[v] = complete(f"{agent}-v{v}")
        if len(set(expected.values())) < 3:
            raise MarftError("the versions' greedy outputs are (nearly) all identical, so responses cannot be "
                             "attributed to versions; use adapters that differ more")
        # 2. Swap latency with no other load.
        _swap_latency(swap, versions, expected, complete, report)
        # 3. Swaps under load, each response attributed to a version live while it was in flight.
        per_version = max(1, clients * requests // (SWAPS + 1))
        records, live = _swaps_under_load(swap, versions, complete, report, clients, per_version)
        report.swaps, report.responses = len(live) - 1, len(records)
        _attribute(records, live, expected, report)

        # 4. Bad adapters: refused, and the old version keeps serving.
        before = complete(agent)
        if before != expected[live[-1][0]]:
            report.failures.append(f"after the swaps, {agent} does not serve v{live[-1][0]}")
        _refusals(pub, agent, registry.path(agent, live[-1][0]), over_rank_adapter, lambda: complete(agent), before,
                  report)
        for v in versions:
            pub.unload(f"{agent}-v{v}")
    return report


@dataclass
class _Chat:
    """A greedy chat completion from one model, as its token ids (what responses are compared by)."""

    http: Any  # an httpx.Client on the server
    messages: list[dict]
    max_tokens: int

    def __call__(self, model: str) -> str:
        r = self.http.post("/v1/chat/completions", json={"model": model, "messages": self.messages,
                                                         "max_tokens": self.max_tokens, "temperature": 0,
                                                         "return_token_ids": True})
        r.raise_for_status()
        return json.dumps(r.json()["choices"][0]["token_ids"])


@dataclass
class _Swapper:
    """Loads a version of the agent (under the agent's name unless ``name`` is given)."""

    pub: VLLMPublisher
    registry: AdapterRegistry
    agent: str

    def load(self, version: int, name: str | None = None) -> None:
        self.pub.load(name or self.agent, self.registry.path(self.agent, version))


def _swap_latency(swap: _Swapper, versions: list[int], expected: dict, complete: _Chat,
                  report: HotSwapReport) -> None:
    """Swap latency, no other load: load call -> first response equal to the new version's output."""
    swap.load(versions[0])
    for v in versions[1:3] + versions[:1]:
        t0 = time.monotonic()
        swap.load(v)
        while complete(swap.agent) != expected[v]:
            if time.monotonic() - t0 > 60:
                report.failures.append(f"v{v} never served after its swap")
                break
        report.swap_latencies_s.append(time.monotonic() - t0)


def _swaps_under_load(swap: _Swapper, versions: list[int], complete: _Chat, report: HotSwapReport, clients: int,
                      per_version: int) -> tuple[list, list]:
    """Swaps under load. The clients send until told to stop; each version stays live until
    ``per_version`` of the requests sent after its load call returned have come back (progress, not
    wall time), so every version serves traffic under load however fast the server is. Returns the
    ``(sent, received, output)`` records and the ``(version, load call began, load call returned)`` list."""
    records, stop, arrived = [], threading.Event(), threading.Condition()

    def failing() -> bool:  # the server keeps failing: stop sending, stop waiting
        return len(report.errors) > per_version

    def client():
        while not stop.is_set():
            sent = time.monotonic()
            try:
                out = complete(swap.agent)
                with arrived:
                    records.append((sent, time.monotonic(), out))
                    arrived.notify_all()
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                with arrived:
                    report.errors.append(repr(e))
                    arrived.notify_all()
                if failing():
                    return

    def wait_for_share(since: float, v: int) -> None:
        with arrived:
            if not arrived.wait_for(lambda: failing() or sum(s >= since for s, _, _ in records) >= per_version,
                                    timeout=300):
                report.failures.append(f"v{v}: fewer than {per_version} responses in 300 s after its load call")

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    live = [(versions[0], float("-inf"), time.monotonic())]  # (version, load call began, load call returned)
    wait_for_share(live[0][2], versions[0])
    for v in versions[1:]:
        began = time.monotonic()
        swap.load(v)
        live.append((v, began, time.monotonic()))
        report.load_call_s.append(live[-1][2] - began)
        wait_for_share(live[-1][2], v)
    stop.set()
    for t in threads:
        t.join()
    return records, live


def _attribute(records: list, live: list, expected: dict, report: HotSwapReport) -> None:
    """Attribute each ``(sent, received, output)`` of the loaded phase to a version live while it was
    in flight (``live``: ``(version, load call began, load call returned)``), else record a failure."""
    def was_live(i: int, sent: float, received: float) -> bool:
        # loaded before the response came back, not yet replaced when the request went out
        return received >= live[i][1] and (i + 1 == len(live) or sent <= live[i + 1][2])

    def switched(out: str, sent: float, received: float) -> bool:
        # vLLM loads a version in place under the same adapter id, so a request in flight decodes its next
        # tokens with the new weights (on the old version's KV cache): its output starts as a live
        # version's and leaves it where a later version's load call fell while it was in flight.
        toks = json.loads(out)
        for i, (v, _, _) in enumerate(live):
            ref = json.loads(expected[v])
            k = next((n for n, (a, b) in enumerate(zip(toks, ref)) if a != b), min(len(toks), len(ref)))
            if k and was_live(i, sent, received) and any(was_live(j, sent, received) for j in range(i + 1, len(live))):
                return True
        return False

    served = set()
    for sent, received, out in records:
        # Versions with identical outputs are indistinguishable: any one of them being live will do.
        matches = [i for i, (v, _, _) in enumerate(live) if expected[v] == out]
        if not matches:
            if switched(out, sent, received):
                report.switched_in_flight += 1
            else:
                report.failures.append(f"output matches no version live while it was in flight: {out[:80]}")
        elif not any(was_live(i, sent, received) for i in matches):
            report.failures.append(f"response from v{live[matches[0]][0]} outside the time it was live")
        else:
            served.add(live[matches[0]][0])
    report.served_versions = sorted(served)
    if report.errors:
        report.failures.append(f"{len(report.errors)} request errors, first: {report.errors[0]}")


def _refusals(pub, agent: str, current: Path, over_rank_adapter, complete, before: str, report: HotSwapReport) -> None:
    """A corrupt copy of ``current`` and the over-rank adapter must be refused with the old version
    still serving (``complete()``: the agent's output now, ``before`` until the refusals)."""
    bad_dir = Path(tempfile.mkdtemp(prefix="marft-bad-adapters-"))
    corrupt = bad_dir / "corrupt"
    shutil.copytree(current, corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    bad = {"corrupt": corrupt, **({"over-rank": Path(over_rank_adapter)} if over_rank_adapter else {})}
    for kind, path in bad.items():
        try:
            pub.load(agent, path)
            report.failures.append(f"vLLM accepted a {kind} adapter")
        except AdapterError as e:  # a refusal; any other error is a fault, and fails the run
            report.refused[kind] = str(e)
        if complete() != before:
            report.failures.append(f"output changed after the {kind} adapter was refused")
    shutil.rmtree(bad_dir, ignore_errors=True)
