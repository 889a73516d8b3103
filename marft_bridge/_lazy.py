"""Lazy public names: a package's ``__getattr__`` that imports a name's module on first use, so
importing the package (and ``marft --help``) pulls in no heavy dependency."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Callable


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """``exports`` maps a public name to its module (absolute, or relative to ``package``)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        imported = importlib.import_module(module, package)
        # a name that is a subpackage of its own (``capture``) is the subpackage
        value = imported if imported.__name__ == f"{package}.{name}" else getattr(imported, name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    return __getattr__


def call_through(package: str, module: str, name: str) -> None:
    """Make the module ``package`` callable as ``module.name``: a wing that shares its name with a
    public entry point (``marft_bridge.capture``, the package, is also ``marft_bridge.capture(...)``,
    the block) stays that entry point once the package is imported. ``module`` is imported on the
    first call, as ``lazy_getattr`` does."""

    class CallThrough(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(importlib.import_module(module), name)(*args, **kwargs)

    sys.modules[package].__class__ = CallThrough
