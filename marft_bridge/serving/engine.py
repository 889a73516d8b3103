"""The generation engine: one base model, any number of LoRA adapters, batches across adapters.

A single worker thread owns the model. It collects concurrent requests for a few milliseconds,
runs them as one left-padded batch in which every row uses its own adapter (peft's mixed-batch
``adapter_names``), and applies adapter loads/unloads only between batches. So a swap is atomic:
a batch that started on version N finishes on N, and the next batch sees N+1.

Each loaded version gets its own internal peft adapter name (``<agent>@v<N>``); a swap loads the
new one, flips the route, then deletes the old one, so nothing is overwritten in place.
"""

from __future__ import annotations

import itertools
import queue
import random
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import MarftError
from .adapter_files import AdapterError, base_fingerprint, check_against_base, inspect_adapter

BASE_ROW = "__base__"  # peft's name for "no adapter" in a mixed batch


class UnknownAdapter(MarftError):
    """A request named an adapter that is not loaded."""


class RequestError(MarftError):
    """A request the engine cannot serve as asked (too long, bad settings)."""


@dataclass
class GenerationRequest:
    """One completion to generate. ``adapter`` None means the base model."""

    prompt_ids: list[int]
    adapter: str | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    top_logprobs: int = 0
    # Called from the worker thread with ("start", (name, version)), ("token", TokenEvent),
    # ("done", GenerationResult) or ("error", exception).
    sink: Callable[[str, Any], None] | None = None


@dataclass
class TokenEvent:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    text_delta: str


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: str  # "stop" or "length"
    adapter: str
    version: int | None


@dataclass
class _Slot:
    name: str
    version: int | None
    internal: str
    path: str


class AdapterEngine:
    """A base model with hot-swappable LoRA adapters and a cross-adapter batching worker.

    Usable in-process (``generate``) and behind the HTTP server. ``registry`` confines loads to
    the registry root and supplies version numbers from the ``v<N>`` directory names.
    """

    def __init__(
        self,
        base_model: str | Path,
        *,
        registry=None,
        max_lora_rank: int = 64,
        max_batch_size: int = 16,
        batch_wait_s: float = 0.005,
        max_tokens_limit: int = 1024,
        dtype: str = "float32",
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.base_path = str(base_model)
        self.base_name = Path(base_model).name or str(base_model)
        self.registry = registry
        self.max_lora_rank = max_lora_rank
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_tokens_limit = max_tokens_limit
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_path)
        model = AutoModelForCausalLM.from_pretrained(self.base_path, dtype=getattr(torch, dtype))
        self._base = model.eval()
        self._peft = None  # becomes a PeftModel wrapping _base at the first adapter load
        self._base_modules = {
            n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
        }
        self._base_fp = base_fingerprint(self.base_path)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 2048))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_id = self.tokenizer.eos_token_id
        self._routes: dict[str, _Slot] = {}  # read by request threads, replaced only by the worker
        self._retired: list[str] = []  # peft refuses to lose its last adapter: delete these later
        self._counter = itertools.count(1)
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._run, name="marft-engine", daemon=True)
        self._worker.start()
        self.stats = {"batches": 0, "rows": 0}

    # -- adapters --------------------------------------------------------------------------------
    def adapters(self) -> dict[str, tuple[int | None, str]]:
        """Loaded adapters: name -> (version, path)."""
        return {n: (s.version, s.path) for n, s in dict(self._routes).items()}

    def load_adapter(
        self, name: str, path: str | Path, *, version: int | None = None, load_inplace: bool = False
    ) -> int | None:
        """Vet and load an adapter under ``name``, replacing the current one when ``load_inplace``.
        Returns the version now serving. Raises ``AdapterError`` (and changes nothing) for a bad adapter."""
        from .registry import MANIFEST_FILE, AdapterManifest, check_agent_name

        check_agent_name(name)
        if name == self.base_name:
            raise AdapterError(f"adapter name {name!r} is the base model's name; requests could not tell them apart")
        adapter_fp = None
        if self.registry is not None:
            _, version = self.registry.resolve(path)
            manifest = AdapterManifest.model_validate_json((Path(path) / MANIFEST_FILE).read_text())
            adapter_fp = manifest.base_fingerprint
        info = inspect_adapter(path)
        if adapter_fp is None and info.base_model:
            adapter_fp = base_fingerprint(info.base_model)
        check_against_base(
            info,
            self._base_modules,
            base_name=self.base_name,
            base_fp=self._base_fp,
            adapter_fp=adapter_fp,
            max_rank=self.max_lora_rank,
        )
        if name in self._routes and not load_inplace:
            raise AdapterError(f"adapter {name!r} is already loaded; pass load_inplace=true to replace it")
        return self._between_batches(lambda: self._do_load(name, str(path), version, load_inplace))

    def load_current(self) -> dict[str, str]:
        """Load the current version of every agent in the registry; returns agent -> "v<N>" or the
        reason it was skipped (one bad adapter must not keep the others from serving)."""
        report = {}
        for agent in self.registry.agents() if self.registry is not None else []:
            version = self.registry.current(agent)
            if version is None:
                continue
            try:
                self.load_adapter(agent, self.registry.path(agent, version), load_inplace=True)
                report[agent] = f"v{version}"
            except MarftError as e:
                report[agent] = f"skipped v{version}: {e}"
        return report

    def unload_adapter(self, name: str) -> None:
        if name not in self._routes:
            raise UnknownAdapter(f"adapter {name!r} is not loaded")
        self._between_batches(lambda: self._do_unload(name))

    def _between_batches(self, op: Callable[[], Any]) -> Any:
        fut: Future = Future()
        self._queue.put((op, fut))
        return fut.result()

    def _do_load(self, name: str, path: str, version: int | None, load_inplace: bool) -> int | None:
        from peft import PeftModel

        if name in self._routes and not load_inplace:
            raise AdapterError(f"adapter {name!r} is already loaded; pass load_inplace=true to replace it")
        internal = f"{name}@v{version if version is not None else 'x'}#{next(self._counter)}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # transformers deprecation noise from inside peft
                if self._peft is None:
                    self._peft = PeftModel.from_pretrained(self._base, path, adapter_name=internal, is_trainable=False)
                    self._peft.eval()
                else:
                    self._peft.load_adapter(path, adapter_name=internal, is_trainable=False)
        except Exception as e:  # peft's own errors: report them as a refusal, keep serving the old one
            self._delete_internal(internal)
            raise AdapterError(f"{path}: peft could not load the adapter ({type(e).__name__}: {e})") from None
        old = self._routes.get(name)
        routes = dict(self._routes)
        routes[name] = _Slot(name, version, internal, path)
        self._routes = routes  # one assignment: request threads see the old or the new table
        if old is not None:
            self._delete_internal(old.internal)
        return version

    def _do_unload(self, name: str) -> None:
        routes = dict(self._routes)
        slot = routes.pop(name, None)
        if slot is None:
            raise UnknownAdapter(f"adapter {name!r} is not loaded")
        self._routes = routes
        self._delete_internal(slot.internal)

    def _delete_internal(self, internal: str) -> None:
        if self._peft is None or internal not in self._peft.peft_config:
            return
        self._retired.append(internal)
        live = {s.internal for s in self._routes.values()}
        if not live:
            return  # keep the last one until another adapter arrives
        # Point peft's "active" adapter at a live one first, so no deletion hits the active one.
        self._peft.base_model.set_adapter(sorted(live)[0])
        for old in list(self._retired):
            if old in self._peft.peft_config:
                self._peft.delete_adapter(old)
            self._retired.remove(old)

    # -- generation ------------------------------------------------------------------------------
    def validate(self, req: GenerationRequest) -> None:
        """Refuse a request that cannot be served, before it is queued."""
        if req.adapter is not None and req.adapter != self.base_name and req.adapter not in self._routes:
            raise UnknownAdapter(f"The model `{req.adapter}` does not exist.")
        if not req.prompt_ids:
            raise RequestError("the prompt is empty")
        if not 1 <= req.max_tokens <= self.max_tokens_limit:
            raise RequestError(f"max_tokens must be between 1 and {self.max_tokens_limit}, got {req.max_tokens}")
        if len(req.prompt_ids) + req.max_tokens > self.max_positions:
            raise RequestError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the model's "
                f"context of {self.max_positions} tokens"
            )
        if req.temperature < 0 or not 0 < req.top_p <= 1 or req.top_k < 0 or not 0 <= req.top_logprobs <= 20:
            raise RequestError("need temperature >= 0, 0 < top_p <= 1, top_k >= 0, 0 <= top_logprobs <= 20")

    def submit(self, req: GenerationRequest) -> None:
        """Queue a request; its ``sink`` receives the events from the worker thread."""
        self.validate(req)
        self._queue.put(req)

    def generate(self, prompt_ids: list[int], **params) -> GenerationResult:
        """Generate synchronously (in-process use); concurrent callers are batched together."""
        done: Future = Future()

        def sink(kind, payload):
            if done.done():  # a batch that fails after this row finished reports an error too
                return
            if kind == "done":
                done.set_result(payload)
            elif kind == "error":
                done.set_exception(payload)

        self.submit(GenerationRequest(prompt_ids=list(prompt_ids), sink=sink, **params))
        return done.result()

    def close(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._worker.join(timeout=10)

    def _run(self) -> None:
        import torch

        with torch.inference_mode():
            while not self._stop.is_set():
                item = self._queue.get()
                if item is None:
                    break
                batch, ops = [], []
                (ops if isinstance(item, tuple) else batch).append(item)
                deadline = time.monotonic() + self.batch_wait_s
                # Collect concurrent requests for a few ms (swap requests arriving meanwhile wait for it).
                while batch and len(batch) < self.max_batch_size:
                    try:
                        nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                    except queue.Empty:
                        break
                    if nxt is None:
                        self._stop.set()
                        break
                    (ops if isinstance(nxt, tuple) else batch).append(nxt)
                for op, fut in ops:  # swaps happen here, between batches
                    try:
                        fut.set_result(op())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
                if batch:
                    self._generate(batch)

    def _bind(self, req: GenerationRequest) -> _Slot | None:
        if req.adapter is None or req.adapter == self.base_name:
            return None
        slot = self._routes.get(req.adapter)
        if slot is None:
            raise UnknownAdapter(f"The model `{req.adapter}` does not exist.")
        return slot

    def _generate(self, batch: list[GenerationRequest]) -> None:
        rows, slots = [], []
        for req in batch:
            try:
                slots.append(self._bind(req))
                rows.append(req)
            except UnknownAdapter as e:  # unloaded after the request was queued
                _emit(req, "error", e)
        if not rows:
            return
        for req, slot in zip(rows, slots):
            _emit(req, "start", (slot.name, slot.version) if slot else (self.base_name, None))
        try:
            self._decode(rows, slots)
        except Exception as e:  # noqa: BLE001 - fail this batch's requests, keep the worker alive
            for req in rows:
                _emit(req, "error", e)

    def _decode(self, rows: list[GenerationRequest], slots: list[_Slot | None]) -> None:
        import torch

        from .sampling import processed_logprobs, sample

        b = len(rows)
        width = max(len(r.prompt_ids) for r in rows)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: every row's next token sits in the last column
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attn[i, width - len(r.prompt_ids) :] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        kwargs = {}
        model = self._base
        if self._peft is not None:
            model = self._peft
            kwargs["adapter_names"] = [s.internal if s else BASE_ROW for s in slots]
        temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32)
        top_k = torch.tensor([r.top_k for r in rows], dtype=torch.long)
        top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32)
        greedy = [r.temperature <= 0 for r in rows]
        gens = [torch.Generator().manual_seed(r.seed if r.seed is not None else random.getrandbits(63)) for r in rows]
        states = [_RowState(self.tokenizer, r.stop) for r in rows]
        cache = None
        cur = ids
        self.stats["batches"] += 1
        self.stats["rows"] += b
        for step in range(max(r.max_tokens for r in rows)):
            out = model(input_ids=cur, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True, **kwargs)
            cache = out.past_key_values
            logprobs = processed_logprobs(out.logits[:, -1, :], temps, top_k, top_p)
            tokens = sample(logprobs, greedy, gens)
            for i, (req, st) in enumerate(zip(rows, states)):
                if st.finish:
                    continue
                tok = int(tokens[i])
                top = []
                if req.top_logprobs:
                    vals, idx = logprobs[i].topk(req.top_logprobs)
                    top = [(int(t), _finite(float(v))) for v, t in zip(vals, idx)]
                delta = st.add(tok, float(logprobs[i, tok]), top, tok == self.eos_id, step + 1 >= req.max_tokens)
                _emit(req, "token", TokenEvent(tok, float(logprobs[i, tok]), top, delta))
                if st.finish:
                    _emit(req, "done", st.result(req, slots[i], self.base_name))
            if all(st.finish for st in states):
                break
            cur = tokens.unsqueeze(1)
            attn = torch.cat([attn, torch.ones((b, 1), dtype=torch.long)], dim=1)
            pos = pos[:, -1:] + 1


def _finite(x: float) -> float:
    # Masked tokens have -inf log-probs; JSON has no infinity, so report vLLM's -9999.0 instead.
    return x if x > -9999.0 else -9999.0


def _emit(req: GenerationRequest, kind: str, payload: Any) -> None:
    if req.sink is None:
        return
    try:
        req.sink(kind, payload)
    except Exception:  # noqa: BLE001 - a gone client (closed event loop) must not stop the other rows
        req.sink = None


class _RowState:
    """Decoded text, stop-string handling and held-back streaming text for one row."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.text = ""
        self.sent = 0
        self.finish: str | None = None

    def add(self, tok: int, logprob: float, top, is_eos: bool, at_limit: bool) -> str:
        self.token_ids.append(tok)
        self.logprobs.append(logprob)
        self.top.append(top)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if is_eos:
            self.finish = "stop"
        for s in self.stop:
            # Search only where the newest token could have completed a stop string.
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                self.finish = "stop"
                break
        if self.finish is None and at_limit:
            self.finish = "length"
        # Hold back text that might be the start of a stop string until it is decided.
        upto = len(self.text) if self.finish else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return delta

    def result(self, req: GenerationRequest, slot: _Slot | None, base_name: str) -> GenerationResult:
        return GenerationResult(
            prompt_ids=list(req.prompt_ids),
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            top_logprobs=self.top,
            text=self.text,
            finish_reason=self.finish or "length",
            adapter=slot.name if slot else base_name,
            version=slot.version if slot else None,
        )
