"""The engine's peft adapter slots: which slot serves each agent, and what becomes of replaced ones.

A replaced slot waits until no running request uses it, then becomes its agent's spare (one per
agent, while the agent stays loaded; the next swap with the same LoRA shape copies its weights in)
or is deleted. Everything here runs on the engine's worker thread, between decode steps; request
threads only read ``routes``.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from ..adapter_files import AdapterError
from .types import UnknownAdapter

# LoraConfig fields that do not change an adapter's modules: a spare slot with the same rest can take it.
_SLOT_FREE_FIELDS = {"base_model_name_or_path", "revision", "inference_mode"}


@dataclass
class Slot:
    name: str
    version: int | None
    internal: str
    path: str


class AdapterSlots:
    """The slots of one base model. ``in_use`` gives the slots the running batch's rows are bound
    to; ``stats`` is the engine's counters (``swaps_in_place`` is counted here)."""

    def __init__(self, base, in_use: Callable[[], set[str]], stats: dict):
        self.base = base
        self.peft = None  # becomes a PeftModel wrapping base at the first adapter load
        self.routes: dict[str, Slot] = {}  # read by request threads, replaced only by the worker
        # Slots out of service -> whether one may become its agent's spare (a replaced version may;
        # an unloaded agent's or a failed load's may not); handled once no running request uses them.
        self.retired: dict[str, bool] = {}
        self.spares: dict[str, str] = {}  # agent -> an unrouted, unused slot of its, ready for the next swap
        self._in_use = in_use
        self._stats = stats
        self._counter = itertools.count(1)

    def load(self, name: str, path: str, version: int | None, load_inplace: bool, config: Any,
             weights: dict) -> int | None:
        if name in self.routes and not load_inplace:
            raise AdapterError(f"adapter {name!r} is already loaded; pass load_inplace=true to replace it")
        internal = self._fill_spare(name, config, weights)
        if internal is None:
            internal = f"{name}#{next(self._counter)}"
            try:
                self._new_slot(internal, config, weights)
            except Exception as e:  # peft's own errors: report them as a refusal, keep serving the old one
                self._retire(internal)
                raise AdapterError(f"{path}: peft could not load the adapter ({type(e).__name__}: {e})") from None
        old = self.routes.get(name)
        routes = dict(self.routes)
        routes[name] = Slot(name, version, internal, path)
        self.routes = routes  # one assignment: request threads see the old or the new table
        if old is not None:
            self._retire(old.internal, spare=True)
        return version

    def _new_slot(self, internal: str, config: Any, weights: dict) -> None:
        """A new peft adapter slot holding ``weights`` (what ``PeftModel.load_adapter`` does, from the
        weights the engine read and checked rather than from the file again)."""
        from peft import PeftModel, set_peft_model_state_dict

        config.inference_mode = True  # frozen, as load_adapter(is_trainable=False) makes it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers deprecation noise from inside peft
            if self.peft is None:
                self.peft = PeftModel(self.base, config, adapter_name=internal)
            else:
                self.peft.add_adapter(internal, config)
            set_peft_model_state_dict(self.peft, weights, adapter_name=internal)
        self.peft.eval()

    def _fill_spare(self, name: str, config: Any, weights: dict) -> str | None:
        """Copy ``weights`` into ``name``'s spare slot when its LoRA shape matches; the slot, or None."""
        from peft import set_peft_model_state_dict

        spare = self.spares.pop(name, None)
        if spare is None:
            return None
        if _slot_shape(self.peft.peft_config[spare]) == _slot_shape(config):
            try:
                set_peft_model_state_dict(self.peft, weights, adapter_name=spare)
                self._stats["swaps_in_place"] += 1
                return spare
            except Exception:  # noqa: BLE001 - the spare may be half-written: drop it, load afresh
                pass
        self._retire(spare)  # another shape, or a failed copy: of no use
        return None

    def unload(self, name: str) -> None:
        routes = dict(self.routes)
        slot = routes.pop(name, None)
        if slot is None:
            raise UnknownAdapter(f"adapter {name!r} is not loaded")
        self.routes = routes
        spare = self.spares.pop(name, None)
        if spare is not None:
            self.retired[spare] = False
        self._retire(slot.internal)

    def _retire(self, internal: str, spare: bool = False) -> None:
        """Take a slot out of service; with ``spare`` it may be kept as its agent's spare."""
        if self.peft is None or internal not in self.peft.peft_config:
            return
        self.retired[internal] = spare
        self.collect_retired()

    def collect_retired(self) -> None:
        """Once no running request uses a replaced slot, keep it as its agent's spare (while the
        agent is loaded and has none) or delete it."""
        if not self.retired:
            return  # the engine calls this after every decode step
        live = {s.internal for s in self.routes.values()}
        if not live:
            return  # peft cannot lose its last adapter: keep it until another one arrives
        in_use = self._in_use()
        free = [old for old in self.retired if old not in in_use]
        if not free:
            return  # old rows still in flight
        # Point peft's "active" adapter at a live one first, so no deletion hits the active one.
        self.peft.base_model.set_adapter(sorted(live)[0])
        for old in free:
            may_spare = self.retired.pop(old)
            agent = old.rpartition("#")[0]
            if may_spare and agent in self.routes and agent not in self.spares:
                self.spares[agent] = old
            elif old in self.peft.peft_config:
                self.peft.delete_adapter(old)


def _slot_shape(config: Any) -> dict:
    """What of a LoraConfig shapes its modules (rank, targets, ...): equal shapes share a slot."""
    return {k: v for k, v in config.to_dict().items() if k not in _SLOT_FREE_FIELDS}
