"""Serving identity probe: is the adapter answering under a name the one the registry says it is?

An adapter can answer with another adapter's weights after a runtime load (vLLM issue 47724; ART,
SkyRL and miles had the same class of bug) — silently, and every reward attributed to the version is
then wrong. When a version is published, ``record_expected`` runs a fixed prompt through the base
model with the published adapter (a reference forward, outside any server) and keeps the greedy
token ids and their log-probs in ``<registry>/.releases/probes/<agent>/v<N>.json``. ``probe`` sends
the same prompt to a server, greedy, with log-probs and token ids, and compares: other tokens, or a
log-prob further than ``tolerance`` from the recorded one, is a mismatch. ``verify_release`` probes
every agent of a release (its plain names, or its served names ``<agent>@r<N>`` during a canary) and
records the result in the release state (``marft releases verify``).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..release_names import RELEASES_DIR, served_name
from ..durable import write_json
from .adapter_files import AdapterError

PROBE_MESSAGES = [{"role": "user", "content": "Probe: repeat the word 'adapter' and count to five."}]
PROBE_TOKENS = 8
DEFAULT_TOLERANCE = 0.05  # |log-prob| difference allowed (kernels, batch shapes, dtypes differ a little)


def expected_path(root: str | Path, agent: str, version: int) -> Path:
    return Path(root) / RELEASES_DIR / "probes" / agent / f"v{int(version)}.json"


def reference_greedy(base_model: str | Path, adapter_dir: str | Path | None, messages: list[dict],
                     max_tokens: int) -> dict[str, Any]:
    """Prompt ids, greedy token ids and their log-probs from the base model with the adapter
    (float32, full forward passes, no cache: the reference the server must reproduce)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_model))
    model = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logp = model(input_ids=torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            t = int(logp.argmax())
            ids.append(t)
            lps.append(float(logp[t]))
            if t == tok.eos_token_id:
                break
    return {"prompt_ids": prompt, "token_ids": ids[len(prompt):], "logprobs": lps}


def record_expected(registry: Any, agent: str, version: int, base_model: str | Path, *,
                    messages: list[dict] | None = None, max_tokens: int = PROBE_TOKENS) -> dict[str, Any]:
    """Record what ``agent`` v``version`` answers the probe (at publish time); returns the record."""
    messages = messages or PROBE_MESSAGES
    path = registry.path(agent, version)
    out = {"agent": agent, "version": int(version), "messages": messages, "max_tokens": max_tokens,
           "sha256": registry.manifest(agent, version).sha256,
           "recorded_at": datetime.now(timezone.utc).isoformat(),
           **reference_greedy(base_model, path, messages, max_tokens)}
    target = expected_path(registry.root, agent, version)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_json(target, out)
    return out


def read_expected(root: str | Path, agent: str, version: int) -> dict[str, Any] | None:
    p = expected_path(root, agent, version)
    return json.loads(p.read_text()) if p.is_file() else None


def _served(url: str, name: str, expected: dict, api_key: str | None, timeout: float) -> dict:
    import httpx

    url = url.rstrip("/")
    url = url[: -len("/v1")] if url.endswith("/v1") else url
    body = {"model": name, "messages": expected["messages"], "max_tokens": len(expected["token_ids"]),
            "temperature": 0.0, "logprobs": True, "return_token_ids": True}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=timeout)
    if r.status_code >= 400:
        raise AdapterError(f"probe of {name!r} at {url} failed (HTTP {r.status_code}): {r.text[:300]}")
    return r.json()


def compare(expected: dict, response: dict, tolerance: float) -> dict[str, Any]:
    """Whether a probe response reproduces the recorded one: same token ids, log-probs within tolerance."""
    choice = response["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    lps = [float(c["logprob"]) for c in content]
    ids = choice.get("token_ids")
    if ids is None:  # vLLM with return_tokens_as_token_ids instead
        ids = [int(str(c["token"]).split(":", 1)[1]) for c in content if str(c.get("token", "")).startswith("token_id:")]
    want_ids, want_lps = expected["token_ids"], expected["logprobs"]
    if list(ids) != list(want_ids):
        first = next((i for i, (a, b) in enumerate(zip(ids, want_ids)) if a != b), min(len(ids), len(want_ids)))
        return {"ok": False, "reason": f"token ids differ from the recorded ones at position {first}",
                "served_ids": list(ids), "expected_ids": list(want_ids), "max_logprob_diff": None}
    diff = max((abs(a - b) for a, b in zip(lps, want_lps)), default=0.0)
    if len(lps) != len(want_lps) or diff > tolerance:
        return {"ok": False, "reason": f"log-probs differ by up to {diff:.4g} (> tolerance {tolerance})",
                "max_logprob_diff": diff}
    return {"ok": True, "reason": "same tokens, log-probs within tolerance", "max_logprob_diff": diff}


def probe(url: str, name: str, expected: dict, *, api_key: str | None = None,
          tolerance: float = DEFAULT_TOLERANCE, timeout: float = 60.0) -> dict[str, Any]:
    """Probe the adapter served as ``name`` against its ``expected`` record."""
    try:
        response = _served(url, name, expected, api_key, timeout)
    except Exception as e:  # noqa: BLE001 - an unreachable server or a refused name fails the probe
        return {"ok": False, "reason": f"{type(e).__name__}: {e}", "max_logprob_diff": None}
    out = compare(expected, response, tolerance)
    adapter = response.get("adapter")
    if isinstance(adapter, dict) and adapter.get("version") not in (None, expected["version"]):
        out = {**out, "ok": False, "reason": f"the server reports version {adapter['version']}, "
               f"expected {expected['version']}; " + out["reason"]}
    return out


def verify_release(store: Any, release_id: str, url: str, *, api_key: str | None = None,
                   served_names: bool = False, tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """Probe every agent of a release; ``ok`` only if each has a recorded expectation and passes."""
    rel = store.get(release_id)
    agents: dict[str, dict] = {}
    for agent, v in sorted(rel.versions.items()):
        expected = read_expected(store.registry.root, agent, v)
        name = served_name(agent, rel.id) if served_names else agent
        if expected is None:
            agents[agent] = {"ok": False, "version": v, "reason": f"no probe was recorded for {agent} v{v}"}
            continue
        agents[agent] = {"version": v, "name": name, **probe(url, name, expected, api_key=api_key,
                                                            tolerance=tolerance)}
    result = {"ok": all(a["ok"] for a in agents.values()), "release": rel.id, "url": url, "agents": agents,
              "at": datetime.now(timezone.utc).isoformat()}
    store.record_probe(rel.id, result)
    return result


__all__ = ["DEFAULT_TOLERANCE", "PROBE_MESSAGES", "compare", "expected_path", "probe", "read_expected",
           "record_expected", "reference_greedy", "verify_release"]
