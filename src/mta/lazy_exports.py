"""A package's public names, imported from their modules on first use (PEP 562).

A package whose ``__init__`` would otherwise import torch, transformers or a scorer for every
caller of one light module declares ``EXPORTS`` (name -> module) and sets
``__getattr__, __dir__ = lazy_exports(globals(), EXPORTS)``; the first access of a name imports
its module and caches the value in the package's namespace.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is ``namespace``."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value  # the next access is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
