"""Recipes that share a common part: ``extends: PARENT`` at the top of a recipe.

A recipe may name one parent, another recipe file, with ``extends:``: the recipe is the parent
with the child's keys laid over it. Mappings merge key by key, all the way down; any other value
(a list, a scalar, ``null``) replaces the parent's. So ``gpt2-fdd.yaml`` can say

    extends: gpt2        # the pair's common part: models, data, optimizer, layer map
    name: gpt2-1.5b-to-120m-fdd-mta
    loss: {base: fkl, fdd_weight: 1.0}   # merged into gpt2's loss: section
    off_policy: null                    # gpt2's off-policy sampling, switched off

``PARENT`` is a file beside the recipe (``.yaml`` optional), else the name of a shipped recipe.
A parent may extend another (up to ``MAX_DEPTH`` files); a cycle is refused. A parent's relative
input paths (``INPUT_PATH_KEYS``: models, configs, data) keep naming the files beside the
parent, wherever the child lives. Validation errors name the file and line each key came from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mta.errors import MtaError
from mta.training.config.catalog import INPUT_PATH_KEYS, SHIPPED_DIR
from mta.training.config.yaml_reader import MAX_RECIPE_BYTES, load_yaml

EXTENDS = "extends"
MAX_DEPTH = 4


@dataclass(frozen=True)
class RecipeFile:
    """One file of a recipe's chain: where it is, its text, and its mapping (``extends`` removed)."""

    path: Path
    text: str
    raw: dict[str, Any]


def read_recipe_file(path: Path) -> tuple[str, dict[str, Any]]:
    """The text and mapping of one recipe file; ``MtaError`` naming the file otherwise."""
    try:
        size = path.stat().st_size
        if size > MAX_RECIPE_BYTES:
            raise MtaError(
                f"{path}: {size:,} bytes is not a recipe (a recipe is a few KB; the limit is {MAX_RECIPE_BYTES:,})"
            )
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as error:
        raise MtaError(f"recipe file not found: {path}") from error
    except UnicodeDecodeError as error:
        raise MtaError(f"{path}: not a UTF-8 text file ({error})") from error
    raw = load_yaml(text, str(path))
    if not isinstance(raw, dict):
        raise MtaError(f"{path}: a recipe is a YAML mapping, got {type(raw).__name__}")
    return text, raw


def recipe_chain(path: Path) -> list[RecipeFile]:
    """The recipe at ``path`` and the parents it extends, the recipe first."""
    chain: list[RecipeFile] = []
    seen: list[Path] = []
    while True:
        text, raw = read_recipe_file(path)
        seen.append(path.resolve())
        parent = raw.pop(EXTENDS, None)
        chain.append(RecipeFile(path, text, raw))
        if parent is None:
            return chain
        if not isinstance(parent, str) or not parent.strip():
            raise MtaError(
                f"{path}: {EXTENDS}: names one recipe (a file beside it or a shipped recipe's name), got {parent!r}"
            )
        path = parent_path(parent, path)
        if path.resolve() in seen:
            cycle = " -> ".join(p.name for p in [*seen, path.resolve()])
            raise MtaError(
                f"{chain[-1].path}: {EXTENDS}: {parent} makes a cycle ({cycle}); a recipe cannot extend itself"
            )
        if len(seen) >= MAX_DEPTH:
            raise MtaError(
                f"{chain[0].path}: more than {MAX_DEPTH} recipes extend each other; "
                f"write the shared part into fewer files"
            )


def parent_path(written: str, child: Path) -> Path:
    """What ``extends: written`` in ``child`` names: a file beside it, else a shipped recipe."""
    here = child.parent
    name = Path(os.path.expandvars(written)).expanduser()
    for candidate in (here / name, here / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    shipped = SHIPPED_DIR / f"{written.removesuffix('.yaml')}.yaml"
    if "/" not in written and shipped.is_file():
        return shipped
    raise MtaError(
        f"{child}: {EXTENDS}: {written!r}: no such recipe beside it ({here}) and no shipped "
        f"recipe of that name (`mta recipes list`)"
    )


def merged_recipe(chain: list[RecipeFile]) -> dict[str, Any]:
    """The chain's mappings laid over each other, the first (the recipe itself) on top."""
    merged: dict[str, Any] = {}
    child_dir = chain[0].path.parent.resolve()
    for file in reversed(chain):
        raw = file.raw
        if file.path.parent.resolve() != child_dir:
            raw = _inputs_beside(raw, file.path.parent)
        merged = _laid_over(merged, raw)
    return merged


def _laid_over(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _laid_over(out[key], value)
        else:
            out[key] = value
    return out


def _inputs_beside(raw: dict[str, Any], directory: Path) -> dict[str, Any]:
    """``raw`` with each relative input path that names a file beside ``directory`` made absolute,
    so it keeps naming that file from a child recipe elsewhere."""
    raw = _copy_mappings(raw)
    for key in INPUT_PATH_KEYS:
        node: Any = raw
        for part in key[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        written = node.get(key[-1])
        if (
            isinstance(written, str)
            and written
            and not os.path.isabs(written)
            and "$" not in written
            and not written.startswith("~")
            and (directory / written).exists()
        ):
            node[key[-1]] = str((directory / written).resolve())
    return raw


def _copy_mappings(value: Any) -> Any:
    return {key: _copy_mappings(item) for key, item in value.items()} if isinstance(value, dict) else value


def key_locations(
    chain: list[RecipeFile], key_lines: Callable[[str], Mapping[tuple[Any, ...], int]]
) -> dict[tuple[Any, ...], str]:
    """``{key path: "line N"}`` for the recipe's own keys and ``"PARENT.yaml line N"`` for the
    keys only a parent sets (``key_lines(text)`` gives a text's key lines), nearest file first."""
    locations: dict[tuple[Any, ...], str] = {}
    for position, file in enumerate(chain):
        prefix = "" if position == 0 else f"{file.path.name} "
        for path, line in key_lines(file.text).items():
            if path and path[0] == EXTENDS:
                continue
            locations.setdefault(path, f"{prefix}line {line}")
    return locations
