"""What ``mta inspect`` checks and decides before it streams: whether the rows are held out, which
granularities the annotations give, and where the layer map comes from."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mta.data.annotations import Annotations, read_annotations
from mta.errors import MtaError

SPAN_GRANULARITIES = ("word", "phrase")
RECIPE_FILE = "recipe.yaml"  # what `mta distill` saves beside final/, best/ and every checkpoint


def held_out_problem(student: str, data: Path, annotations: Annotations) -> str | None:
    """Why ``data`` looks like rows ``student`` was trained on (from its ``recipe.yaml``), or None."""
    recipe_path = Path(student) / RECIPE_FILE
    if not recipe_path.is_file():
        return None
    from mta.training.config.loading import load_recipe

    try:
        recipe = load_recipe(recipe_path, saved=True)
    except MtaError:
        return None  # not a recipe this mta reads: nothing to compare
    written = recipe.data.train  # type: ignore[attr-defined]
    train = Path(recipe.resolve(written, "data.train"))
    same = _same_path(train, data) or _same_path(Path(recipe.output_dir) / "data" / "train", data)  # type: ignore[attr-defined]
    if not same and train.is_dir():
        try:
            theirs = read_annotations(train).manifest.get("input", {}).get("sha256")
        except MtaError:
            theirs = None
        same = theirs is not None and theirs == annotations.manifest.get("input", {}).get("sha256")
    if same:
        return f"{student} was trained on {train} (its {RECIPE_FILE}: data.train), the rows of {data}"
    return None


def _same_path(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def held_out_statement(students: Sequence[str], data: Path, annotations: Annotations, *, allow: bool) -> str:
    """What the results say about the rows: held out as far as the students' ``recipe.yaml``
    tell, or not checkable; training rows of a student are refused unless ``allow``."""
    problems = [p for p in (held_out_problem(s, data, annotations) for s in students) if p]
    if problems and not allow:
        raise MtaError(
            "; ".join(problems) + ". Inspect on held-out rows (e.g. the dev annotations), or pass "
            "--allow-training-rows to measure on training rows anyway"
        )
    if problems:
        return "training rows, measured with --allow-training-rows: " + "; ".join(problems)
    if any((Path(s) / RECIPE_FILE).is_file() for s in students):
        return "held out as far as the students' recipe.yaml tell (their data.train is another set)"
    return "not checked: no student carries a recipe.yaml naming its training rows"


def granularities_of(annotations: Annotations, same_tokenizer: bool, notes: list[str]) -> list[str]:
    """``token`` (one tokenizer) or ``boundary`` (two, when the annotations hold boundary spans),
    then ``word`` and ``phrase``; a note says which across tokenizers."""
    if same_tokenizer:
        return ["token", *SPAN_GRANULARITIES]
    table = annotations.table
    boundary = "boundary_spans" in table.column_names and table.column("boundary_spans").null_count == 0
    notes.append(
        "the tokenizers differ: no token-level CKA; "
        + (
            "boundary spans (both tokenisations agree on them) instead"
            if boundary
            else "the annotations hold no boundary spans"
        )
    )
    return (["boundary"] if boundary else []) + list(SPAN_GRANULARITIES)


def layer_map_source(
    layers: Sequence[tuple[int, int, str]] | None, recipe_name: str | None, students: Sequence[str]
) -> tuple[Any, str]:
    """The layer map (``"auto"`` or [LayerPair]) and where it came from: ``layers`` (--layers),
    ``recipe_name``'s (--recipe), the first student's recipe.yaml, or ``auto``."""
    from mta.training.config.schema import LayerPair

    if layers:
        return [LayerPair(student=s, teacher=t, granularity=g) for s, t, g in layers], "--layers"
    from mta.training.config.loading import load_recipe

    if recipe_name:
        from mta.training.config.catalog import find_recipe

        recipe = load_recipe(find_recipe(recipe_name).path)
        return recipe.loss.layers, f"recipe {recipe_name} (loss.layers)"  # type: ignore[attr-defined]
    for student in students:
        path = Path(student) / RECIPE_FILE
        if path.is_file():
            recipe = load_recipe(path, saved=True)
            return recipe.loss.layers, f"{path} (loss.layers)"  # type: ignore[attr-defined]
    return "auto", "auto (no recipe: the docs/method.md §4 rule)"


__all__ = [
    "RECIPE_FILE",
    "SPAN_GRANULARITIES",
    "granularities_of",
    "held_out_problem",
    "held_out_statement",
    "layer_map_source",
]
