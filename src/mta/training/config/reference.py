"""The recipe-key reference, generated from the schemas: every key of each task's recipe as a row.

``key_rows(task)`` walks the task's schema (``mta.task_registry``: ``Recipe`` for ``llm``,
``EmbeddingRecipe`` for ``embedding``) section by section and gives each key its type, default,
allowed values (a ``Literal``'s values, a number's bounds), the field's description and whether
a ``--resume`` may change it (``mta.training.config.resume_rules.MUTABLE_KEYS``; every other key
is fixed for the life of a run). ``mta recipes keys`` renders the rows; ``reference_markdown()``
is ``docs/recipe-keys.md`` (``mta recipes keys --markdown``), which a test keeps in step with the
schemas.

Only schemas are imported (no model code, no torch): ``mta recipes keys`` starts fast.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from mta.deprecation import RECIPE_KEYS, REMOVED_IN
from mta.errors import MtaError
from mta.task_registry import task_named, task_names
from mta.training.config.resume_rules import MUTABLE_KEYS

REQUIRED = "required"


@dataclass(frozen=True)
class KeyRow:
    """One key of a recipe schema, as ``mta recipes keys`` and ``docs/recipe-keys.md`` show it."""

    task: str  # "llm" or "embedding"
    key: str  # dotted: "train.lr"
    type: str  # "float", "str | null", "section", "list[str]"
    default: str  # as YAML writes it ("0.0001", "null", "[0.9, 0.999]"), "required", or "" for a section
    allowed: str  # a Literal's values ("cosine, linear, constant") or bounds ("> 0", "0 ≤ x ≤ 1"); "" for any
    description: str
    resumable: bool  # a --resume may change it (resume_rules.MUTABLE_KEYS)

    @property
    def section(self) -> str:
        """The top-level key the row is under (``train`` for ``train.asam.rho``; itself at the top)."""
        return self.key.split(".", 1)[0]


def key_rows(task: str) -> list[KeyRow]:
    """Every key of ``task``'s recipe schema, sections before the keys inside them, in schema order."""
    schema = task_named(task).schema
    # The shared train: keys a task does not read (its schema refuses them): EmbeddingRecipe's.
    unread = {f"train.{key}" for key in getattr(schema, "UNREAD_TRAIN_KEYS", ())}
    return [row for row in _walk(task, schema, "") if row.key not in unread]


def select_rows(section: str | None = None, task: str | None = None) -> list[KeyRow]:
    """The rows of ``task`` (default: every task, ``llm`` first) under ``section`` (a key such as
    ``train`` or ``train.asam``: it and the keys inside it; default: all). ``MtaError`` naming
    the sections when nothing matches."""
    tasks = list(task_names()) if task is None else [task_named(task).name]
    rows = [row for name in tasks for row in key_rows(name)]
    if section is None:
        return rows
    chosen = [row for row in rows if row.key == section or row.key.startswith(section + ".")]
    if not chosen:
        sections = sorted({row.section for row in rows if row.type.startswith("section")})
        where = f"task {task!r}" if task else "either task"
        raise MtaError(
            f"{section!r} is no recipe key of {where}; give a section ({', '.join(sections)}) "
            "or a dotted key such as train.lr"
        )
    return chosen


def reference_markdown() -> str:
    """``docs/recipe-keys.md``: a table per task, then the keys a resume may change and what each
    change does."""
    lines = [
        "# Recipe keys",
        "",
        "<!-- Generated from the recipe schemas by `mta recipes keys --markdown > docs/recipe-keys.md`"
        " (make docs); tests/test_recipe_keys.py fails when this file is stale. Do not edit by hand. -->",
        "",
        "Every key a recipe may set, per `task:` (`mta.training.config.schema.Recipe` for `task: llm`,",
        "`mta.embedding.recipe.EmbeddingRecipe` for `task: embedding`), with its type, default, allowed",
        "values and whether `mta distill --resume` may change it (`mta.training.config.resume_rules`;",
        "a key marked no is fixed for the life of a run, and a resume that changes it is refused).",
        "A section's keys follow it; a section that is null by default (`teacher.tiny`, `train.asam`)",
        "takes its keys' defaults once set. `mta recipes keys [SECTION]` prints the same in a terminal.",
        "",
    ]
    for task in task_names():
        lines += [
            f"## task: {task}",
            "",
            "| key | type | default | allowed | resume | description |",
            "|---|---|---|---|---|---|",
        ]
        for row in key_rows(task):
            cells = [
                f"`{row.key}`",
                row.type,
                f"`{row.default}`" if row.default and row.default != REQUIRED else row.default,
                row.allowed,
                "yes" if row.resumable else "no",
                row.description,
            ]
            lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
        lines.append("")
    lines += [
        "## What a resume may change",
        "",
        "Each change takes effect from the resumed step on and is logged; a new length",
        "(`train.max_steps`, `train.epochs`) may not end before the checkpoint's step.",
        "",
        "| key | the change |",
        "|---|---|",
    ]
    lines += [f"| `{key}` | {_cell(effect)} |" for key, effect in MUTABLE_KEYS.items()]
    lines += [
        "",
        "## Renamed keys",
        "",
        "An old key (and every key under it, overrides included) is still read, with a warning, until",
        f"mta {REMOVED_IN} (`mta.deprecation.RECIPE_KEYS`); a checkpoint's saved recipe with it resumes.",
        "",
        "| old key (deprecated) | new key |",
        "|---|---|",
    ]
    lines += [f"| `{'.'.join(old)}` | `{'.'.join(new)}` |" for old, new in RECIPE_KEYS.items()]
    return "\n".join(lines) + "\n"


# --- walking a schema ------------------------------------------------------------------------


def _walk(task: str, model: type[BaseModel], prefix: str) -> Iterator[KeyRow]:
    for name, info in model.model_fields.items():
        key = prefix + name
        section = _section(info.annotation)
        yield KeyRow(
            task=task,
            key=key,
            type=type_text(info.annotation),
            default=default_text(info),
            allowed=allowed_text(info),
            description=" ".join((info.description or "").split()),
            resumable=key in MUTABLE_KEYS,
        )
        if section is not None:
            yield from _walk(task, section, key + ".")


def _section(annotation: Any) -> type[BaseModel] | None:
    """The schema class of a section key (``LossSpec``, ``TinyModel | None``); None for a value,
    including a list of models (``loss.layers``: list items, not keys)."""
    members = [arg for arg in typing.get_args(annotation) if arg is not type(None)] if _is_union(annotation) else []
    target = members[0] if len(members) == 1 else annotation
    return target if isinstance(target, type) and issubclass(target, BaseModel) else None


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def type_text(annotation: Any) -> str:
    """A field's type as a recipe writes it: ``float``, ``str | null``, ``list[str]``, ``section``,
    ``[float, float]``, ``list[{student, teacher}]``, ``mapping``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_text(args[0])
    if annotation is type(None):
        return "null"
    if _is_union(annotation):
        return " | ".join(dict.fromkeys(type_text(arg) for arg in args))
    if origin is typing.Literal:
        return " | ".join(dict.fromkeys(_yaml_type(value) for value in args))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if origin is list:
        item = args[0] if args else Any
        if isinstance(item, type) and issubclass(item, BaseModel):
            return "list[{" + ", ".join(item.model_fields) + "}]"
        return f"list[{type_text(item)}]"
    if origin is tuple:
        return "[" + ", ".join(type_text(arg) for arg in args) + "]"
    if origin is dict:
        return "mapping" if args[1:] in ((), (Any,)) else f"mapping {type_text(args[0])} → {type_text(args[1])}"
    if annotation is Any:
        return "any"
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def _yaml_type(value: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(type(value), type(value).__name__)


def default_text(info: FieldInfo) -> str:
    """The default as YAML writes it (``0.0001``, ``null``, ``[0.9, 0.999]``, ``srkl``), ``required``,
    or empty for a section whose keys have the defaults."""
    if info.is_required():
        return REQUIRED
    default = info.get_default(call_default_factory=True)
    if isinstance(default, BaseModel):
        return ""
    if isinstance(default, str):
        return default or '""'
    return json.dumps(to_jsonable_python(default), ensure_ascii=False)


def allowed_text(info: FieldInfo) -> str:
    """A ``Literal``'s values, in order (``cosine, linear, constant``), else the number's bounds
    from the field's constraints (``≥ 1``, ``> 0``, ``0 ≤ x ≤ 1``); empty when anything of the type goes."""
    values = list(dict.fromkeys(_literal_values(info.annotation)))
    if values:
        return ", ".join(json.dumps(value) if not isinstance(value, str) else value for value in values)
    lower: tuple[str, bool] | None = None  # (bound, inclusive)
    upper: tuple[str, bool] | None = None
    for item in info.metadata:
        if isinstance(item, annotated_types.Ge):
            lower = (_number(item.ge), True)
        elif isinstance(item, annotated_types.Gt):
            lower = (_number(item.gt), False)
        elif isinstance(item, annotated_types.Le):
            upper = (_number(item.le), True)
        elif isinstance(item, annotated_types.Lt):
            upper = (_number(item.lt), False)
    if lower and upper:
        return f"{lower[0]} {'≤' if lower[1] else '<'} x {'≤' if upper[1] else '<'} {upper[0]}"
    if lower:
        return f"{'≥' if lower[1] else '>'} {lower[0]}"
    if upper:
        return f"{'≤' if upper[1] else '<'} {upper[0]}"
    return ""


def _literal_values(annotation: Any) -> Iterator[Any]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        yield from args
        return
    for arg in args:
        if arg is not type(None) and not (isinstance(arg, type) and issubclass(arg, BaseModel)):
            yield from _literal_values(arg)


def _number(value: Any) -> str:
    return json.dumps(to_jsonable_python(value))


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")
