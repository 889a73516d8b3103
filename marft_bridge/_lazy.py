"""Lazy public names: a package's ``__getattr__`` that imports a name's module on first use, so
importing the package (and ``marft --help``) pulls in no heavy dependency."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """``exports`` maps a public name to its module (absolute, or relative to ``package``)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    return __getattr__
