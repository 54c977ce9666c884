"""Old spellings that keep working until ``REMOVED_IN``, each with a warning naming the new one.

The one home for every kind of rename (CHANGELOG's rename table lists them all): command-line
options (``mta_cli.options.deprecated_alias``), recipe keys (``RECIPE_KEYS``, applied by the recipe
loader to each file, each override and a checkpoint's saved recipe) and public Python names
(``renamed_names``: a module's ``__getattr__``; ``renamed_attribute``: a class's method or
property; ``moved_modules``: a module's old import path).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

REMOVED_IN = "0.4.0"  # an old spelling still works in every release before this one

# Recipe key paths renamed: old -> new (a section, or a key inside one).
RECIPE_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("generation",): ("off_policy",),  # DistiLLM's off-policy sampling (0.3.0)
}


class MtaDeprecationWarning(FutureWarning):
    """An old spelling of a recipe key or option: shown to users by default (a FutureWarning),
    unlike Python's DeprecationWarning, which is for a library's own callers."""


def message(old: str, new: str) -> str:
    """The one sentence every deprecation says."""
    return f"{old} is deprecated and goes in mta {REMOVED_IN}; use {new}"


def warn(old: str, new: str, *, category: type[Warning] = MtaDeprecationWarning, stacklevel: int = 2) -> None:
    """Warn that ``old`` is deprecated in favour of ``new``."""
    warnings.warn(message(old, new), category, stacklevel=stacklevel + 1)


def renamed_names(namespace: dict[str, Any], renames: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` (PEP 562) of the module whose ``globals()`` is ``namespace``, for public
    names renamed or moved: ``renames`` maps each old name to ``"new.module:new_name"``; the old
    name gives the new one's value with a ``DeprecationWarning`` naming it (once: then cached)."""
    module = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name not in renames:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        target, _, new = renames[name].partition(":")
        warn(f"{module}.{name}", f"{target}.{new}", category=DeprecationWarning)
        value = namespace[name] = getattr(importlib.import_module(target), new)
        return value

    return __getattr__


# Modules moved: old dotted path -> new (filled by the mta package through ``moved_modules``).
MODULES_MOVED: dict[str, str] = {}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import old.module`` (and its submodules) as the module it moved to, the same object, with
    a ``DeprecationWarning`` naming the new path (``MODULES_MOVED``)."""

    def new_name(self, fullname: str) -> str | None:
        for old, new in MODULES_MOVED.items():
            if fullname == old or fullname.startswith(old + "."):
                return new + fullname[len(old) :]
        return None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if self.new_name(fullname) else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = self.new_name(spec.name)
        assert new is not None
        warn(
            spec.name, new, category=DeprecationWarning, stacklevel=2
        )  # warnings skips importlib's frames: the import line
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module ran when it was imported


def moved_modules(moves: Mapping[str, str]) -> None:
    """Old module paths (``moves``: old -> new dotted name) imported as their new modules until
    ``REMOVED_IN``; installed once, by the ``mta`` package."""
    MODULES_MOVED.update(moves)
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())


class renamed_attribute:  # noqa: N801 (used like a decorator-free ``property``)
    """A class attribute (a method, a property) renamed: ``old = renamed_attribute("new")`` in the
    class body returns the new attribute with a ``DeprecationWarning`` naming it."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.old = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.old, self.owner = name, owner.__name__

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        warn(f"{self.owner}.{self.old}", f"{self.owner}.{self.new}", category=DeprecationWarning)
        return getattr(instance if instance is not None else owner, self.new)


def renamed_recipe_keys(raw: Any, *, source: str = "", quiet: bool = False) -> Any:
    """``raw`` (a recipe mapping) with each old key path of ``RECIPE_KEYS`` moved to its new path,
    a warning naming both (none when ``quiet``: a checkpoint's saved recipe). Both spellings in
    one mapping is an error naming them."""
    from mta.errors import MtaError  # here: the bottom layer imports nothing at load time

    if not isinstance(raw, dict):
        return raw
    for old, new in RECIPE_KEYS.items():
        parent = _mapping_at(raw, old[:-1])
        if parent is None or old[-1] not in parent:
            continue
        old_text, new_text = ".".join(old), ".".join(new)
        target = _mapping_at(raw, new[:-1], create=True)
        assert target is not None  # create=True makes each mapping on the way
        if new[-1] in target:
            raise MtaError(f"{source}: {old_text} is the old spelling of {new_text}: give one of them")
        target[new[-1]] = parent.pop(old[-1])
        if not quiet:
            where = f"{source}: " if source else ""
            warn(f"{where}recipe key {old_text}", new_text, stacklevel=2)
    return raw


def renamed_key_path(path: str, *, source: str = "") -> str:
    """A dotted key path (an override's ``a.b.c``) with an old prefix of ``RECIPE_KEYS`` renamed,
    with a warning; any other path as given."""
    parts = tuple(path.split("."))
    for old, new in RECIPE_KEYS.items():
        if parts[: len(old)] == old:
            renamed = ".".join(new + parts[len(old) :])
            warn(f"{source}{path}", renamed, stacklevel=2)
            return renamed
    return path


def new_key_paths(paths: Mapping[tuple[Any, ...], Any]) -> dict[tuple[Any, ...], Any]:
    """``paths`` (keyed by key path, as written in a file) with each path under an old key also
    under its new spelling, so an error at the new key still names the line of the old one."""
    out = dict(paths)
    for path, value in paths.items():
        for old, new in RECIPE_KEYS.items():
            if tuple(path[: len(old)]) == old:
                out.setdefault(new + tuple(path[len(old) :]), value)
    return out


def _mapping_at(raw: dict[str, Any], path: tuple[str, ...], *, create: bool = False) -> dict[str, Any] | None:
    node: Any = raw
    for part in path:
        if not isinstance(node, dict):
            return None
        if create and not isinstance(node.get(part), dict):
            node[part] = {}
        node = node.get(part)
    return node if isinstance(node, dict) else None
