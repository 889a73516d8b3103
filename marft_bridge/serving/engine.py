"""The generation engine: one base model, any number of LoRA adapters, batches across adapters.

A single worker thread owns the model and runs continuous batching: requests that arrive together
are prefilled as one left-padded group and merged into the running batch, and every decode step
runs all rows at once, each row with its own adapter (peft's mixed-batch ``adapter_names``).
Finished rows leave after each step.

A request's adapter version is bound when it joins the batch and never changes. Each loaded version
gets its own internal peft adapter slot (``<agent>#k``): a swap, applied between decode steps,
loads the new version into a slot and flips the route, so later requests get it, while requests in
flight keep the old weights until they finish. A replaced slot no request uses any more is kept
as the agent's spare (one per agent): the next swap of that agent with the same LoRA shape copies
its weights into the spare instead of building new modules, so decoding pauses for a weight copy
rather than a full peft load (``benchmarks/hotswap.py`` times both). Other replaced slots are deleted.
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
from .adapter_files import WEIGHTS_FILE, AdapterError, base_fingerprint, check_against_base, inspect_adapter

BASE_ROW = "__base__"  # peft's name for "no adapter" in a mixed batch
# LoraConfig fields that do not change an adapter's modules: a spare slot with the same rest can take it.
_SLOT_FREE_FIELDS = {"base_model_name_or_path", "revision", "inference_mode"}
_WAKE = object()  # queued with each swap so an idle worker wakes up to run it


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
        # Slots out of service -> whether one may become its agent's spare (a replaced version may;
        # an unloaded agent's or a failed load's may not); handled once no running request uses them.
        self._retired: dict[str, bool] = {}
        self._spares: dict[str, str] = {}  # agent -> an unrouted, unused slot of its, ready for the next swap
        self._batch: _Batch | None = None  # the running batch, owned by the worker thread
        self._counter = itertools.count(1)
        self._queue: queue.Queue = queue.Queue()  # requests (and wake-ups)
        self._ops: queue.Queue = queue.Queue()  # swaps: never stuck behind requests when the batch is full
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._run, name="marft-engine", daemon=True)
        self._worker.start()
        self.stats = {"batches": 0, "rows": 0, "steps": 0, "swaps_in_place": 0}

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
        from peft import LoraConfig
        from safetensors.torch import load_file

        # Read here, in the caller's thread: the worker only copies them in (when a spare slot fits).
        config, weights = LoraConfig.from_pretrained(str(path)), load_file(str(Path(path) / WEIGHTS_FILE))
        return self._between_steps(lambda: self._do_load(name, str(path), version, load_inplace, config, weights))

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
        self._between_steps(lambda: self._do_unload(name))

    def _between_steps(self, op: Callable[[], Any]) -> Any:
        """Run ``op`` on the worker thread between two decode steps and return its result."""
        fut: Future = Future()
        self._ops.put((op, fut))
        self._queue.put(_WAKE)  # an idle worker waits on the request queue
        return fut.result()

    def _do_load(self, name: str, path: str, version: int | None, load_inplace: bool, config: Any,
                 weights: dict) -> int | None:
        from peft import PeftModel

        if name in self._routes and not load_inplace:
            raise AdapterError(f"adapter {name!r} is already loaded; pass load_inplace=true to replace it")
        internal = self._fill_spare(name, config, weights)
        if internal is None:
            internal = f"{name}#{next(self._counter)}"
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
            self._delete_internal(old.internal, spare=True)
        return version

    def _fill_spare(self, name: str, config: Any, weights: dict) -> str | None:
        """Copy ``weights`` into ``name``'s spare slot when its LoRA shape matches; the slot, or None."""
        from peft import set_peft_model_state_dict

        spare = self._spares.pop(name, None)
        if spare is None:
            return None
        if _slot_shape(self._peft.peft_config[spare]) == _slot_shape(config):
            try:
                set_peft_model_state_dict(self._peft, weights, adapter_name=spare)
                self.stats["swaps_in_place"] += 1
                return spare
            except Exception:  # noqa: BLE001 - the spare may be half-written: drop it, load afresh
                pass
        self._delete_internal(spare)  # another shape, or a failed copy: of no use
        return None

    def _do_unload(self, name: str) -> None:
        routes = dict(self._routes)
        slot = routes.pop(name, None)
        if slot is None:
            raise UnknownAdapter(f"adapter {name!r} is not loaded")
        self._routes = routes
        spare = self._spares.pop(name, None)
        if spare is not None:
            self._retired[spare] = False
        self._delete_internal(slot.internal)

    def _delete_internal(self, internal: str, spare: bool = False) -> None:
        """Take a slot out of service; with ``spare`` it may be kept as its agent's spare."""
        if self._peft is None or internal not in self._peft.peft_config:
            return
        self._retired[internal] = spare
        self._collect_retired()

    def _collect_retired(self) -> None:
        """Once no running request uses a replaced slot, keep it as its agent's spare (while the
        agent is loaded and has none) or delete it."""
        live = {s.internal for s in self._routes.values()}
        in_use = {r.slot.internal for r in self._batch.rows if r.slot} if self._batch else set()
        if not live:
            return  # peft cannot lose its last adapter: keep it until another one arrives
        # Point peft's "active" adapter at a live one first, so no deletion hits the active one.
        self._peft.base_model.set_adapter(sorted(live)[0])
        for old, may_spare in list(self._retired.items()):
            if old in in_use:
                continue
            del self._retired[old]
            agent = old.rpartition("#")[0]
            if may_spare and agent in self._routes and agent not in self._spares:
                self._spares[agent] = old
            elif old in self._peft.peft_config:
                self._peft.delete_adapter(old)

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
                new = self._gather()
                while not self._ops.empty():  # swaps happen here, between decode steps
                    op, fut = self._ops.get()
                    try:
                        fut.set_result(op())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
                try:
                    if self._batch is not None:
                        self._decode_step()
                    if new:
                        self._admit(new)
                except Exception as e:  # noqa: BLE001 - fail the running requests, keep the worker alive
                    for req in [r.req for r in self._batch.rows] if self._batch else []:
                        _emit(req, "error", e)
                    for req in new:
                        _emit(req, "error", e)
                    self._batch = None
                self._retire_finished()

    def _gather(self) -> list[GenerationRequest]:
        """New requests. Idle: wait for a request (or a swap), then collect others for
        ``batch_wait_s``. Busy: take what is queued without waiting, up to the batch size."""
        new = []
        room = self.max_batch_size - (len(self._batch.rows) if self._batch else 0)

        def take(item) -> None:
            if item is None:
                self._stop.set()
            elif item is not _WAKE:
                new.append(item)

        if self._batch is None:
            take(self._queue.get())
            deadline = time.monotonic() + self.batch_wait_s
            while new and len(new) < room and not self._stop.is_set():
                try:
                    take(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
        else:
            while len(new) < room and not self._stop.is_set():
                try:
                    take(self._queue.get_nowait())
                except queue.Empty:
                    break
        return new

    def _bind(self, req: GenerationRequest) -> _Slot | None:
        if req.adapter is None or req.adapter == self.base_name:
            return None
        slot = self._routes.get(req.adapter)
        if slot is None:
            raise UnknownAdapter(f"The model `{req.adapter}` does not exist.")
        return slot

    def _forward(self, rows: list[_Row], **inputs):
        model, kwargs = self._base, {}
        if self._peft is not None:
            model = self._peft
            kwargs["adapter_names"] = [r.slot.internal if r.slot else BASE_ROW for r in rows]
        return model(use_cache=True, **inputs, **kwargs)

    def _admit(self, new: list[GenerationRequest]) -> None:
        """Prefill newly arrived requests together (left-padded), sample their first tokens and merge
        them into the running batch. Their adapter version is fixed here, for their whole life."""
        import torch

        rows = []
        for req in new:
            try:
                slot = self._bind(req)
            except UnknownAdapter as e:  # unloaded after the request was queued
                _emit(req, "error", e)
                continue
            seed = req.seed if req.seed is not None else random.getrandbits(63)
            rows.append(_Row(req, slot, _RowState(self.tokenizer, req.stop), torch.Generator().manual_seed(seed)))
            _emit(req, "start", (slot.name, slot.version) if slot else (self.base_name, None))
        if not rows:
            return
        width = max(len(r.req.prompt_ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: every row's next token sits in the last column
            ids[i, width - len(r.req.prompt_ids) :] = torch.tensor(r.req.prompt_ids)
            attn[i, width - len(r.req.prompt_ids) :] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self._forward(rows, input_ids=ids, attention_mask=attn, position_ids=pos)
        self.stats["batches"] += 1
        self.stats["rows"] += len(rows)
        group = _Batch(rows, out.past_key_values, attn, pos[:, -1] + 1, self._sample(rows, out.logits[:, -1, :]))
        self._batch = group if self._batch is None else self._batch.merge(group)

    def _decode_step(self) -> None:
        import torch

        b = self._batch
        b.attn = torch.cat([b.attn, torch.ones((len(b.rows), 1), dtype=torch.long)], dim=1)
        out = self._forward(b.rows, input_ids=b.last.unsqueeze(1), attention_mask=b.attn,
                            position_ids=b.pos.unsqueeze(1), past_key_values=b.cache)
        b.cache = out.past_key_values
        b.pos = b.pos + 1
        b.last = self._sample(b.rows, out.logits[:, -1, :])
        self.stats["steps"] += 1

    def _sample(self, rows: list[_Row], logits):
        """Sample one token per row with its own settings, emit it, and mark finished rows."""
        import torch

        from .sampling import processed_logprobs, sample

        temps = torch.tensor([r.req.temperature for r in rows], dtype=torch.float32)
        top_k = torch.tensor([r.req.top_k for r in rows], dtype=torch.long)
        top_p = torch.tensor([r.req.top_p for r in rows], dtype=torch.float32)
        logprobs = processed_logprobs(logits, temps, top_k, top_p)
        tokens = sample(logprobs, [r.req.temperature <= 0 for r in rows], [r.gen for r in rows])
        for i, row in enumerate(rows):
            tok, st, req = int(tokens[i]), row.state, row.req
            top = []
            if req.top_logprobs:
                vals, idx = logprobs[i].topk(req.top_logprobs)
                top = [(int(t), _finite(float(v))) for v, t in zip(vals, idx)]
            delta = st.add(tok, float(logprobs[i, tok]), top, tok == self.eos_id, len(st.token_ids) + 1 >= req.max_tokens)
            _emit(req, "token", TokenEvent(tok, float(logprobs[i, tok]), top, delta))
            if st.finish:
                _emit(req, "done", st.result(req, row.slot, self.base_name))
        return tokens

    def _retire_finished(self) -> None:
        """Drop finished rows from the running batch, then delete adapter versions no row uses."""
        b = self._batch
        if b is not None:
            keep = [i for i, r in enumerate(b.rows) if not r.state.finish]
            if not keep:
                self._batch = None
            elif len(keep) < len(b.rows):
                b.select(keep)
        if self._retired:
            self._collect_retired()


def _slot_shape(config: Any) -> dict:
    """What of a LoraConfig shapes its modules (rank, targets, ...): equal shapes share a slot."""
    return {k: v for k, v in config.to_dict().items() if k not in _SLOT_FREE_FIELDS}


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


@dataclass
class _Row:
    req: GenerationRequest
    slot: _Slot | None  # bound when the request joins the batch; never changes afterwards
    state: _RowState
    gen: Any  # torch.Generator


class _Batch:
    """The running batch: rows, their KV cache (left-padded to one length), attention mask,
    next position ids and the sampled tokens not yet fed to the model."""

    def __init__(self, rows: list[_Row], cache, attn, pos, last):
        self.rows, self.cache, self.attn, self.pos, self.last = rows, cache, attn, pos, last

    def merge(self, other: _Batch) -> _Batch:
        import torch
        import torch.nn.functional as F

        width = max(self.attn.shape[1], other.attn.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            # Left-pad the shorter cache with zeros; the attention mask hides them.
            mine.keys = torch.cat([_pad_left(mine.keys, width, dim=2), _pad_left(theirs.keys, width, dim=2)])
            mine.values = torch.cat([_pad_left(mine.values, width, dim=2), _pad_left(theirs.values, width, dim=2)])
        self.attn = torch.cat([F.pad(self.attn, (width - self.attn.shape[1], 0)), F.pad(other.attn, (width - other.attn.shape[1], 0))])
        self.rows = self.rows + other.rows
        self.pos = torch.cat([self.pos, other.pos])
        self.last = torch.cat([self.last, other.last])
        return self

    def select(self, keep: list[int]) -> None:
        import torch

        idx = torch.tensor(keep)
        self.rows = [self.rows[i] for i in keep]
        self.attn, self.pos, self.last = self.attn[idx], self.pos[idx], self.last[idx]
        start = int((self.attn.sum(0) > 0).nonzero()[0])  # columns that are padding for every row left
        self.attn = self.attn[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx, :, start:]
            layer.values = layer.values[idx, :, start:]


def _pad_left(t, width: int, dim: int):
    import torch.nn.functional as F

    missing = width - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.dim() - dim - 1) + [missing, 0]
    return F.pad(t, pad)


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
