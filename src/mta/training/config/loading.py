"""Reading a recipe file: ``load_recipe`` (the file and the parents it ``extends``, the
overrides, the schema its ``task`` picks, validation), ``recipe_to_yaml`` (the resolved recipe
saved beside every checkpoint), and the validation errors as one line per problem.

Unknown keys are errors, and every error names the file, the line, the key and what is allowed.
YAML is read by ``mta.training.config.yaml_reader`` (hostile documents refused before anything
is built). The schema of each ``task`` is found through ``mta.task_registry``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from mta.deprecation import new_key_paths, renamed_key_path, renamed_recipe_keys
from mta.errors import MtaError, close_match
from mta.task_registry import task_named, task_names
from mta.training.config.extends import key_locations, merged_recipe, recipe_chain
from mta.training.config.overrides import apply_overrides
from mta.training.config.schema import Recipe, RecipeChecks, models_in
from mta.training.config.yaml_reader import BoundedLoader, Refused, yaml_text


class _TaskOnly(BaseModel):
    """A recipe's ``task`` alone, checked first: against the wrong schema every other key would
    be an error too."""

    model_config = ConfigDict(extra="ignore")
    task: Literal["llm", "embedding"] = Field(
        Recipe.model_fields["task"].default, description=Recipe.model_fields["task"].description
    )


def recipe_schema(raw: Any) -> type[RecipeChecks]:
    """The schema a recipe mapping is read with: by its ``task`` (default llm; a value that is no
    task is reported by ``Recipe``'s own check of the key)."""
    task = raw.get("task", "llm") if isinstance(raw, dict) else "llm"
    return task_named(task).schema if isinstance(task, str) and task in task_names() else Recipe


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, saved: bool = False) -> RecipeChecks:
    """Read (with the parents it ``extends``), override and validate a recipe (a ``Recipe``, or
    its task's schema: ``recipe_schema``); raise ``MtaError`` naming the file, line and key on any
    problem. saved: a recipe mta wrote (a checkpoint's ``recipe.yaml``): old key spellings are read
    without a warning."""
    path = Path(path)
    chain = recipe_chain(path)
    for file in chain:  # old key spellings (mta.deprecation.RECIPE_KEYS), each with a warning
        renamed_recipe_keys(file.raw, source=str(file.path), quiet=saved)
    overrides = [_renamed_override(item) for item in overrides]
    raw = apply_overrides(merged_recipe(chain), overrides)
    raw.setdefault("source", str(path))
    overridden = {item.partition("=")[0].strip(): item for item in overrides}
    schema = recipe_schema(raw)  # by task (mta.task_registry): task: embedding -> EmbeddingRecipe
    try:
        _TaskOnly.model_validate(raw)
        return schema.model_validate(raw)
    except ValidationError as error:
        locations = new_key_paths(key_locations(chain, _key_lines))
        raise MtaError(
            _format_validation_error(str(path), error, "", overridden, raw, locations, schema=schema)
        ) from error


def _renamed_override(item: str) -> str:
    key, sep, value = item.partition("=")
    renamed = renamed_key_path(key.strip(), source="override ") if sep else key
    return f"{renamed}{sep}{value}" if renamed != key.strip() else item


def recipe_to_yaml(recipe: RecipeChecks) -> str:
    """The fully resolved recipe (defaults filled in), as saved beside every checkpoint."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


# --- validation errors, one line per problem ------------------------------------------------


def _section_model(path: tuple[str | int, ...], root: type[BaseModel] | None = None) -> type[BaseModel] | None:
    """The schema class that a (pydantic) error location points into, for listing its keys
    (``root``: the recipe schema, default ``Recipe``)."""
    model: type[BaseModel] = root or Recipe
    for part in path:
        if isinstance(part, int) or part not in model.model_fields:
            continue
        nested = models_in(model.model_fields[part].annotation)
        if not nested:
            return None
        model = nested[0]
    return model


def _field_description(path: tuple[str | int, ...], root: type[BaseModel] | None = None) -> str | None:
    model = _section_model(path[:-1], root) if path else None
    field = model.model_fields.get(str(path[-1])) if model else None
    return field.description if field else None


def _key_lines(text: str) -> dict[tuple[Any, ...], int]:
    """1-based line of every key and list item of a YAML document, by its key path.

    Keys are taken as YAML reads them (``1:`` is the int 1, as in the loaded mapping); a node
    reached again through an alias is not walked twice.
    """
    lines: dict[tuple[Any, ...], int] = {}
    walked: set[int] = set()
    try:
        loader = BoundedLoader(text)  # PyYAML's reader checks the characters here already
    except yaml.YAMLError:
        return lines

    def walk(node: yaml.Node, path: tuple[Any, ...]) -> None:
        if id(node) in walked:
            return
        walked.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                try:
                    key = loader.construct_object(key_node)
                except yaml.YAMLError:
                    key = key_node.value
                child = path + (key,)
                lines[child] = key_node.start_mark.line + 1
                walk(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                lines[path + (index,)] = item.start_mark.line + 1
                walk(item, path + (index,))

    try:
        root = loader.get_single_node()
        if root is not None:
            walk(root, ())
    except (yaml.YAMLError, Refused, RecursionError):
        pass
    finally:
        loader.dispose()
    return lines


def _file_path(item: ErrorDetails, raw: Any) -> tuple[Any, ...]:
    """The key path of an error in the file's terms: pydantic's location without the parts that
    are not keys of the file (union branch tags such as ``list[LayerPair]``, ``[key]``), plus
    the path inside a free-form mapping that a validator reported (``ctx['within']``)."""
    loc = tuple(item["loc"]) + tuple((item.get("ctx") or {}).get("within", ()))
    path: list[Any] = []
    node = raw
    for position, part in enumerate(loc):
        if part == "[key]":
            continue
        if isinstance(node, dict) and part not in node:
            # pydantic spells some keys as text (a `null:` key is located as "None").
            part = next((key for key in node if not isinstance(key, str) and str(key) == part), part)
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and type(part) is int and 0 <= part < len(node):
            node = node[part]
        elif (
            (isinstance(part, str) and part.isidentifier())
            or type(part) is int
            or (
                # The key an unknown-key error is about is always a key of the file.
                position == len(loc) - 1 and item["type"] in ("extra_forbidden", "invalid_key")
            )
        ):
            node = None  # a schema key the file does not have (a missing key)
        else:
            continue
        path.append(part)
    return tuple(path)


def _key_text(path: tuple[Any, ...]) -> str:
    """``train.lr``; a key that is not a plain name is quoted (``'train lr'``) or spelt as YAML
    (``null``, ``true``), so the reader sees exactly what the file says."""

    def part_text(part: Any) -> str:
        if part is None or isinstance(part, bool):
            return yaml_text(part)
        if isinstance(part, str) and re.fullmatch(r"[\w-]+", part) or type(part) is int:
            return str(part)
        return repr(part)

    return ".".join(part_text(part) for part in path)


def _unknown_key(path: tuple[Any, ...], root: type[BaseModel] | None = None) -> str:
    model = _section_model(path[:-1], root)
    if model is None:
        return "unknown key (check its spelling and the section it is in)"
    allowed = ", ".join(model.model_fields)
    key = str(path[-1])
    other_task = _other_task_with_key(path, root or Recipe)
    if other_task:
        this_task = next(task for task, schema in _task_schemas().items() if schema is (root or Recipe))
        return (
            f"unknown key in a task: {this_task} recipe: {key} is a key of task: {other_task} recipes "
            f"(allowed here: {allowed})"
        )
    match = close_match(key, model.model_fields)
    if match:
        return f"unknown key: did you mean {match}? (allowed here: {allowed})"
    elsewhere = _sections_with_key(key, root)
    if elsewhere:
        return f"unknown key here: {key} is a key of {' and '.join(elsewhere)} (allowed here: {allowed})"
    return f"unknown key (check its spelling and the section it is in); allowed here: {allowed}"


def _other_task_with_key(path: tuple[Any, ...], root: type[BaseModel]) -> str | None:
    """The other task whose schema has the key at ``path`` (``loss.dsa_weight`` in an embedding
    recipe: llm), or None."""
    for task, schema in _task_schemas().items():
        if schema is root:
            continue
        model = _section_model(path[:-1], schema)
        if (
            model is not None
            and str(path[-1]) in model.model_fields
            and (len(path) == 1 or str(path[0]) in schema.model_fields)
        ):
            return task
    return None


def _task_schemas() -> dict[str, type[BaseModel]]:
    """Every registered task's recipe schema, by task name (``mta.task_registry``)."""
    return {task: task_named(task).schema for task in task_names()}


def _sections_with_key(key: str, root: type[BaseModel] | None = None) -> list[str]:
    found = []

    def search(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            if name == key and prefix:
                found.append(prefix.rstrip("."))
            for nested in models_in(field.annotation):
                search(nested, f"{prefix}{name}.")

    search(root or Recipe, "")
    return found


def _describe(item: ErrorDetails, path: tuple[Any, ...], root: type[BaseModel] | None = None) -> str:
    kind, given = item["type"], item.get("input")
    if kind == "extra_forbidden" or (kind == "invalid_key" and _section_model(path[:-1], root)):
        return _unknown_key(path, root)
    if kind == "invalid_key" or tuple(item["loc"][-1:]) == ("[key]",):
        return f"a key must be a name (got {given!r}); quote it if it is one"
    if kind == "literal_error":
        hint = _field_description(path, root)
        return f"{given!r} is not allowed; use one of {item['ctx']['expected']}" + (f" ({hint})" if hint else "")
    if kind == "missing":
        return "required key is missing"
    if kind == "finite_number":
        return f"must be a finite number (got {given!r})"
    message = item["msg"].removeprefix("Value error, ")
    if kind.endswith(("_type", "_parsing")) or kind.startswith(("greater", "less")):
        message += f" (got {given!r})"
    if kind == "string_type" and isinstance(given, (int, float)) and not isinstance(given, bool):
        # YAML read digits (a commit id's, a revision's) as a number: quoted, they stay a string.
        message += f"; quote it to keep it a string: '{given}' in YAML, key='\"{given}\"' as an override"
    return message


def _format_validation_error(
    source: str,
    error: ValidationError,
    text: str = "",
    overridden: dict[str, str] | None = None,
    raw: Any = None,
    locations: dict[tuple[Any, ...], str] | None = None,
    *,
    schema: type[BaseModel] | None = None,
) -> str:
    """One line per problem: ``line N: key: what is wrong and what is allowed``.

    ``text`` (the file) gives the line numbers, ``overridden`` (``key -> 'key=value'``) names the
    override a key came from instead, ``raw`` (the mapping that was validated) keeps keys that
    are not names, such as ``train lr`` or ``1``. ``locations`` (``{key path: "line N"}``, or
    ``"PARENT.yaml line N"`` for a key an extended recipe set) replaces ``text``'s lines.
    ``schema``: the recipe class validated (default ``Recipe``; ``recipe_schema``).
    """
    if locations is None:
        locations = {path: f"line {line}" for path, line in (_key_lines(text) if text else {}).items()}
    overridden = overridden or {}
    lines = [f"{source}: invalid recipe"]
    for item in error.errors():
        path = _file_path(item, raw)
        key = _key_text(path)
        parts = tuple(str(part) for part in path)
        origin = next(
            (
                f" (from override {override!r})"
                for name, override in overridden.items()
                if _override_covers(tuple(name.split(".")), parts)
            ),
            "",
        )
        location = next(
            (locations[path[:depth]] for depth in range(len(path), 0, -1) if path[:depth] in locations),
            None,
        )
        where = f"{location}: " if location and not origin else ""
        # Whole-recipe checks (loc empty) name their keys in the message itself.
        named = f"{key}: " if key else ""
        lines.append(f"  {where}{named}{_describe(item, path, schema)}{origin}")
    return "\n".join(lines)


def _override_covers(override: tuple[str, ...], key: tuple[str, ...]) -> bool:
    """Whether an error at ``key`` comes from the override of ``override``: the override set
    the key or a mapping above it, or (inside the free-form deepspeed: mapping, where whole
    sections are refused) a key below it."""
    if key[: len(override)] == override:
        return True
    return len(key) > 1 and key[0] == "deepspeed" and override[: len(key)] == key
