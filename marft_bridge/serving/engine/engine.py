"""The generation engine: one base model, any number of LoRA adapters, batches across adapters.

A single worker thread owns the model and runs continuous batching: requests that arrive together
are prefilled as one left-padded group and merged into the running batch, and every decode step
runs all rows at once, each row with its own adapter (peft's mixed-batch ``adapter_names``).
Finished rows leave after each step.

A request's adapter version is bound when it joins the batch and never changes. Each loaded version
gets its own internal peft adapter slot (``<agent>#k``; ``adapter_slots.py`` keeps them): a swap,
applied between decode steps, loads the new version into a slot and flips the route, so later
requests get it, while requests in flight keep the old weights until they finish. A replaced slot
no request uses any more is kept as the agent's spare (one per agent): the next swap of that agent
with the same LoRA shape copies its weights into the spare instead of building new modules, so
decoding pauses for a weight copy rather than a full peft load (``benchmarks/hotswap.py`` times
both). Other replaced slots are deleted.

A request whose client has gone is cancelled (``cancel``): it leaves the queue, or the running batch
before the next decode step, so its slot is free for the next request. The queue of waiting requests
is bounded (``max_queued``); ``submit`` refuses past it with ``QueueFull``.

Faults stay with the request that caused them: a request whose setup, prefill, sampling or
detokenising fails gets its error and leaves; the other rows go on untouched (each samples with its
own generator). A fault in the loop itself (a decode step, a merge) fails the requests in flight and
the loop restarts; ``health()`` counts the restarts and keeps the last fault.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ...errors import MarftError
from ..adapter_files import AdapterError, base_fingerprint
from .adapter_slots import AdapterSlots, Slot
from .batching import Batch, Row, RowState
from .types import (DEFAULT_MAX_QUEUED, GenerationRequest, GenerationResult, QueueFull, RequestError, TokenEvent,
                    UnknownAdapter, WorkerFault)
from .validation import check_request, vet_adapter

if TYPE_CHECKING:
    from ..registry import AdapterRegistry

log = logging.getLogger(__name__)

BASE_ROW = "__base__"  # peft's name for "no adapter" in a mixed batch
_WAKE = object()  # queued with each swap so an idle worker wakes up to run it


class AdapterEngine:
    """A base model with hot-swappable LoRA adapters and a cross-adapter batching worker.

    Usable in-process (``generate``) and behind the HTTP server. ``registry`` confines loads to
    the registry root and supplies version numbers from the ``v<N>`` directory names.
    """

    def __init__(
        self,
        base_model: str | Path,
        *,
        registry: AdapterRegistry | None = None,
        max_lora_rank: int = 64,
        max_batch_size: int = 16,
        batch_wait_s: float = 0.005,
        max_tokens_limit: int = 1024,
        max_queued: int = DEFAULT_MAX_QUEUED,
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
        self.max_queued = max_queued
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_path)
        model = AutoModelForCausalLM.from_pretrained(self.base_path, dtype=getattr(torch, dtype))
        self._base = model.eval()
        self._base_modules = {
            n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
        }
        self._base_fp = base_fingerprint(self.base_path)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 2048))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_id = self.tokenizer.eos_token_id
        self._batch: Batch | None = None  # the running batch, owned by the worker thread
        self._pending: list[GenerationRequest] = []  # gathered, not yet admitted (failed too if the worker faults)
        self._last_fault: dict | None = None
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self._n_tokens = min(self.vocab_size, len(self.tokenizer))  # ids both the model and the tokenizer know
        self._queue: queue.Queue = queue.Queue()  # requests (and wake-ups); bounded by ``_waiting``
        self._waiting: set[int] = set()  # ids of the queued requests not cancelled yet
        self._lock = threading.Lock()  # ``_waiting`` and the cancellation count, shared with request threads
        self._ops: queue.Queue = queue.Queue()  # swaps: never stuck behind requests when the batch is full
        self._stop = threading.Event()
        self.stats = {"batches": 0, "rows": 0, "steps": 0, "tokens": 0, "swaps_in_place": 0, "request_failures": 0,
                      "worker_restarts": 0, "cancelled": 0}
        self._slots = AdapterSlots(self._base, self._slots_in_use, self.stats)
        self._worker = threading.Thread(target=self._run, name="marft-engine", daemon=True)
        self._worker.start()

    # -- adapters --------------------------------------------------------------------------------
    def adapters(self) -> dict[str, tuple[int | None, str]]:
        """Loaded adapters: name -> (version, path)."""
        return {n: (s.version, s.path) for n, s in dict(self._slots.routes).items()}

    def load_adapter(
        self, name: str, path: str | Path, *, version: int | None = None, load_inplace: bool = False
    ) -> int | None:
        """Vet and load an adapter under ``name``, replacing the current one when ``load_inplace``.
        Returns the version now serving. Raises ``AdapterError`` (and changes nothing) for a bad adapter."""
        from ...release_names import split_served_name
        from ..registry import check_agent_name

        try:  # ``planner@r12``: a team release's adapter, served beside the plain name (a canary)
            check_agent_name(split_served_name(name)[0])
        except ValueError as e:
            raise AdapterError(str(e)) from None
        if name == self.base_name:
            raise AdapterError(f"adapter name {name!r} is the base model's name; requests could not tell them apart")
        if self.registry is not None:
            _, version = self.registry.resolve(path)
        config, weights = vet_adapter(path, self.registry, self._base_modules, base_name=self.base_name,
                                      base_fp=self._base_fp, max_rank=self.max_lora_rank, dtype=self._base.dtype)
        if name in self._slots.routes and not load_inplace:
            raise AdapterError(f"adapter {name!r} is already loaded; pass load_inplace=true to replace it")
        return self._between_steps(lambda: self._slots.load(name, str(path), version, load_inplace, config, weights))

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
            except Exception as e:  # noqa: BLE001 - even an unforeseen fault stays with its agent
                reason = str(e) if isinstance(e, MarftError) else f"{type(e).__name__}: {e}"
                log.error("not serving %s v%s: %s", agent, version, reason)
                report[agent] = f"skipped v{version}: {reason}"
        return report

    def unload_adapter(self, name: str) -> None:
        if name not in self._slots.routes:
            raise UnknownAdapter(f"adapter {name!r} is not loaded")
        self._between_steps(lambda: self._slots.unload(name))

    def _between_steps(self, op: Callable[[], Any]) -> Any:
        """Run ``op`` on the worker thread between two decode steps and return its result."""
        fut: Future = Future()
        self._ops.put((op, fut))
        self._queue.put(_WAKE)  # an idle worker waits on the request queue
        return fut.result()

    def _slots_in_use(self) -> set[str]:
        """The adapter slots the running batch's rows are bound to."""
        return {r.slot.internal for r in self._batch.rows if r.slot} if self._batch else set()

    # -- generation ------------------------------------------------------------------------------
    @property
    def base_model(self):
        """The transformers model under the adapters (read-only use: inspection, forward hooks)."""
        return self._base

    def health(self) -> dict:
        """Whether the worker runs, how often it was restarted after a fault, and the last fault; the
        requests running and waiting, those cancelled, and the decode steps and tokens so far."""
        batch = self._batch
        return {"worker_alive": self._worker.is_alive(), "worker_restarts": self.stats["worker_restarts"],
                "last_worker_fault": self._last_fault, "request_failures": self.stats["request_failures"],
                "requests_running": len(batch.rows) if batch else 0, "requests_waiting": len(self._waiting),
                "requests_cancelled": self.stats["cancelled"], "decode_steps": self.stats["steps"],
                "tokens_generated": self.stats["tokens"]}

    def validate(self, req: GenerationRequest) -> None:
        """Refuse a request that cannot be served, before it is queued."""
        if req.adapter is not None and req.adapter != self.base_name and req.adapter not in self._slots.routes:
            raise UnknownAdapter(f"The model `{req.adapter}` does not exist.")
        check_request(req, max_tokens_limit=self.max_tokens_limit, max_positions=self.max_positions,
                      vocab_size=self.vocab_size, n_tokens=self._n_tokens)

    def submit(self, req: GenerationRequest) -> None:
        """Queue a request; its ``sink`` receives the events from the worker thread. Raises
        ``QueueFull`` when ``max_queued`` requests are already waiting."""
        self.validate(req)
        with self._lock:
            if len(self._waiting) >= self.max_queued:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (max_queued "
                                f"{self.max_queued}); try again shortly")
            self._waiting.add(id(req))
        self._queue.put(req)

    def cancel(self, req: GenerationRequest) -> None:
        """Give up on a request (its client has gone): a waiting one leaves the queue now, a running
        one the batch before the next decode step (its events end with the step in progress). A
        finished one is left alone."""
        with self._lock:
            req.cancelled = True
            if id(req) in self._waiting:
                self._waiting.discard(id(req))
                self.stats["cancelled"] += 1

    def generate(self, prompt_ids: list[int], **params) -> GenerationResult:
        """Generate synchronously (in-process use); concurrent callers are batched together."""
        done: Future = Future()

        def sink(kind, payload):
            if done.done():
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
        """The worker thread: runs the serving loop and restarts it after a fault in the loop itself,
        failing the requests in flight (their KV cache is no longer trustworthy)."""
        faults_in_a_row = 0
        while not self._stop.is_set():
            try:
                self._serve()
            except BaseException as e:  # noqa: BLE001 - the worker must outlive any fault
                faults_in_a_row += 1
                self.stats["worker_restarts"] += 1
                self._last_fault = {"error": f"{type(e).__name__}: {e}", "at": time.time()}
                log.exception("engine worker fault; failing %d in-flight requests and restarting",
                              len(self._batch.rows if self._batch else []) + len(self._pending))
                fault = WorkerFault(f"the engine's worker failed ({type(e).__name__}: {e}) and was restarted")
                for req in [r.req for r in self._batch.rows] if self._batch else []:
                    _emit(req, "error", fault)
                for req in self._pending:
                    _emit(req, "error", fault)
                self._batch, self._pending = None, []
                time.sleep(min(1.0, 0.01 * 2**faults_in_a_row))  # a fault that repeats must not spin
            else:
                faults_in_a_row = 0

    def _serve(self) -> None:
        import torch

        with torch.inference_mode():
            while not self._stop.is_set():
                self._pending = self._gather()
                while not self._ops.empty():  # swaps happen here, between decode steps
                    op, fut = self._ops.get()
                    try:
                        fut.set_result(op())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
                self._drop_cancelled()
                if self._batch is not None:
                    self._decode_step()
                if self._pending:
                    self._admit(self._pending)
                self._pending = []
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
                with self._lock:  # a request cancelled while it waited was counted by ``cancel``
                    self._waiting.discard(id(item))
                    live = not item.cancelled
                if live:
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

    def _bind(self, req: GenerationRequest) -> Slot | None:
        if req.adapter is None or req.adapter == self.base_name:
            return None
        slot = self._slots.routes.get(req.adapter)
        if slot is None:
            raise UnknownAdapter(f"The model `{req.adapter}` does not exist.")
        return slot

    def _forward(self, rows: list[Row], **inputs):
        model, kwargs = self._base, {}
        if self._slots.peft is not None:
            model = self._slots.peft
            kwargs["adapter_names"] = [r.slot.internal if r.slot else BASE_ROW for r in rows]
        return model(use_cache=True, **inputs, **kwargs)

    def _fail(self, req: GenerationRequest, e: Exception) -> None:
        """One request fails alone: its error to its client, nothing to anyone else."""
        self.stats["request_failures"] += 1
        if not isinstance(e, (UnknownAdapter, RequestError)):
            log.warning("request failed in the engine (%s: %s); the other rows continue", type(e).__name__, e)
        _emit(req, "error", e)

    def _setup(self, req: GenerationRequest) -> Row | None:
        """A request's row: adapter version bound (for its whole life), its own sampling generator
        (so what else is batched never changes what a seed samples) and decoding state."""
        import torch

        if req.cancelled:  # after it left the queue, before its prefill
            self._count_cancelled()
            return None
        try:
            slot = self._bind(req)
            seed = req.seed if req.seed is not None else random.getrandbits(63)
            allowed = torch.tensor(req.allowed_token_ids, dtype=torch.long) if req.allowed_token_ids else None
            row = Row(req, slot, RowState(self.tokenizer, req.stop), torch.Generator().manual_seed(seed), allowed)
        except Exception as e:  # noqa: BLE001 - e.g. unloaded after it was queued, or settings that do not work
            self._fail(req, e)
            return None
        # A release's served name reports its adapter: ``planner@r12`` is planner at the release's version.
        _emit(req, "start", (slot.name.partition("@")[0], slot.version) if slot else (self.base_name, None))
        return row

    def _admit(self, new: list[GenerationRequest]) -> None:
        """Prefill newly arrived requests together (left-padded), sample their first tokens and merge
        them into the running batch. A group whose prefill fails is retried one request at a time,
        so only the request that cannot be prefilled fails; the running batch is not touched."""
        rows = [row for row in map(self._setup, new) if row is not None]
        if not rows:
            return
        try:
            groups = [self._prefill(rows)]
        except Exception as e:  # noqa: BLE001 - find the culprit by prefilling alone
            if len(rows) == 1:
                self._fail(rows[0].req, e)
                return
            groups = []
            for row in rows:
                try:
                    groups.append(self._prefill([row]))
                except Exception as e1:  # noqa: BLE001 - this one fails alone
                    self._fail(row.req, e1)
        for group in groups:
            self._batch = group if self._batch is None else self._batch.merge(group)

    def _prefill(self, rows: list[Row]) -> Batch:
        import torch

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
        return Batch(rows, out.past_key_values, attn, pos[:, -1] + 1, self._sample(rows, out.logits[:, -1, :]))

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

    def _drop_cancelled(self) -> None:
        """Rows whose request was cancelled leave the batch now, before the next decode step."""
        gone = [r for r in self._batch.rows if r.req.cancelled and not r.state.finish] if self._batch else []
        for row in gone:
            row.state.finish = "abort"
            self._count_cancelled()
        if gone:
            self._retire_finished()

    def _count_cancelled(self) -> None:
        with self._lock:
            self.stats["cancelled"] += 1

    def _sample(self, rows: list[Row], logits):
        """Sample one token per row with its own settings, emit it, and mark finished rows. A row
        whose sampling or detokenising fails is finished with its error; the others go on."""
        import torch

        from .sampling import allowed_mask, finite, processed_logprobs, sample_row

        temps = torch.tensor([r.req.temperature for r in rows], dtype=torch.float32)
        top_k = torch.tensor([r.req.top_k for r in rows], dtype=torch.long)
        top_p = torch.tensor([r.req.top_p for r in rows], dtype=torch.float32)
        allowed = allowed_mask([r.allowed for r in rows], logits.shape)
        logprobs = processed_logprobs(logits, temps, top_k, top_p, allowed)  # row-wise: one row cannot spoil another
        tokens = torch.full((len(rows),), self.pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            st, req = row.state, row.req
            try:
                tok = sample_row(logprobs[i], req.temperature <= 0, row.gen)
                top = []
                if req.top_logprobs:
                    vals, idx = logprobs[i].topk(req.top_logprobs)
                    top = [(int(t), finite(float(v))) for v, t in zip(vals, idx)]
                lp = float(logprobs[i, tok])
                delta = st.add(tok, lp, top, tok == self.eos_id, len(st.token_ids) + 1 >= req.max_tokens)
                result = self._result(row) if st.finish else None
            except Exception as e:  # noqa: BLE001 - this row fails alone; its slot is dropped after the step
                st.finish = "error"
                self._fail(req, e)
                continue
            tokens[i] = tok
            self.stats["tokens"] += 1
            _emit(req, "token", TokenEvent(tok, lp, top, delta))
            if result is not None:
                _emit(req, "done", result)
        return tokens

    def _result(self, row: Row) -> GenerationResult:
        st, slot = row.state, row.slot
        return GenerationResult(
            prompt_ids=list(row.req.prompt_ids), token_ids=list(st.token_ids), logprobs=list(st.logprobs),
            top_logprobs=list(st.top), text=st.text, finish_reason=st.finish or "length",
            adapter=slot.name.partition("@")[0] if slot else self.base_name, version=slot.version if slot else None,
        )

    def _retire_finished(self) -> None:
        """Drop finished rows from the running batch, then delete adapter versions no row uses."""
        b = self._batch
        if b is not None:
            keep = [i for i, r in enumerate(b.rows) if not r.state.finish]
            if not keep:
                self._batch = None
            elif len(keep) < len(b.rows):
                b.select(keep)
        self._slots.collect_retired()


def _emit(req: GenerationRequest, kind: str, payload: Any) -> None:
    if req.sink is None:
        return
    try:
        req.sink(kind, payload)
    except Exception:  # noqa: BLE001 - a gone client (closed event loop) must not stop the other rows
        req.sink = None
