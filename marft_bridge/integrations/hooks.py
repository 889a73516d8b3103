"""Hooks on another library's callables: pass-through, version-gated, restorable.

``Hooks(distribution, supported, targets)`` is the one way a capture integration patches a library
it does not control (LangGraph's Pregel loop, the ``openai`` client's ``request``, MCP's
``ClientSession``). ``targets()`` returns ``(owner, attribute, hook)`` triples, resolved when
installing; each callable is replaced by a ``wrapt.FunctionWrapper`` calling ``hook(wrapped,
instance, args, kwargs)`` (wrapt's signature: an upstream signature change cannot raise from
binding, and the wrapper looks like the original to introspection). ``install()`` applies every
hook or none: outside the ``supported`` range ``[low, high)`` of the distribution's version, or when
a target is missing, it logs once and returns False. ``uninstall()`` puts the originals back
(``owner.attribute is original`` again).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

log = logging.getLogger("marft_bridge.capture")

Target = tuple[Any, str, Callable[..., Any]]


def arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    """A hooked call's argument ``name``, passed at position ``i`` or by keyword."""
    return args[i] if len(args) > i else kwargs.get(name)


def parse_version(v: str) -> tuple[int, ...]:
    """``"1.2.24"`` -> ``(1, 2, 24)``; a pre-release part keeps its leading number (``"2.0rc1"`` -> ``(2, 0)``)."""
    out = []
    for p in v.split(".")[:3]:
        m = re.match(r"\d+", p)
        if m is None:
            break
        out.append(int(m.group()))
        if m.end() < len(p):
            break
    return tuple(out)


@functools.lru_cache(maxsize=None)
def installed_version(distribution: str) -> tuple[int, ...] | None:
    """The installed version of a distribution, read once (an ``episode()`` block instruments on entry)."""
    try:
        return parse_version(version(distribution))
    except PackageNotFoundError:
        return None


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


class Hooks:
    """The hooks of one integration on one library (see the module docstring)."""

    def __init__(self, distribution: str, supported: tuple[tuple[int, ...], tuple[int, ...]],
                 targets: Callable[[], Iterable[Target]], what: str):
        self.distribution = distribution
        self.supported_range = supported
        self._targets = targets
        self.what = what  # said in the warning: what capture does without these hooks
        self._originals: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()
        self._warned = False

    def supported(self, v: tuple[int, ...] | None = None) -> bool:
        v = installed_version(self.distribution) if v is None else v
        low, high = self.supported_range
        return v is not None and low <= v < high

    @property
    def installed(self) -> bool:
        return bool(self._originals)

    def install(self) -> bool:
        """Apply the hooks once (True when they are in place); see the module docstring."""
        with self._lock:
            if self._originals:
                return True
            try:
                v = installed_version(self.distribution)
                if not self.supported(v):
                    low, high = self.supported_range
                    raise RuntimeError(f"{self.distribution} {_dotted(v) if v else '(not installed)'} is outside "
                                       f"the supported range {_dotted(low)} <= v < {_dotted(high)}")
                import wrapt

                resolved = []
                for owner, attr, hook in self._targets():
                    original = (owner.__dict__ if isinstance(owner, type) else vars(owner))[attr]
                    resolved.append((owner, attr, original, hook))
            except Exception as e:  # noqa: BLE001 - no hooks: capture of this library stays off
                if not self._warned:
                    self._warned = True
                    log.warning("marft capture: %s (%s)", self.what, e)
                return False
            for owner, attr, original, hook in resolved:
                self._originals.append((owner, attr, original))
                setattr(owner, attr, wrapt.FunctionWrapper(original, hook))
            return True

    def uninstall(self) -> None:
        """Put every hooked callable back (the objects found at install)."""
        with self._lock:
            while self._originals:
                owner, attr, original = self._originals.pop()
                setattr(owner, attr, original)


__all__ = ["Hooks", "installed_version", "parse_version"]
