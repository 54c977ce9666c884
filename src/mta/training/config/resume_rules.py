"""What a resumed run's recipe may change (``MUTABLE_KEYS``, with the learning-rate rule
``LR_RULE``), and what it may not: the recipe given to ``--resume`` is compared key by key with the
checkpoint's resolved ``recipe.yaml`` (a key an older recipe lacks counts as its default), and a
change to a fixed key is refused naming its old and new value. The table of what may change and
why: docs/recipe-keys.md, "What a resume may change". Pure functions; the trainer applies them.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

from mta.deprecation import renamed_recipe_keys
from mta.errors import MtaError
from mta.training.config.loading import recipe_schema
from mta.training.config.schema import Recipe, models_in
from mta.training.config.yaml_reader import load_yaml, yaml_text

SAVED_RECIPE = "recipe.yaml"

LR_RULE = (
    "the schedule is re-planned for the new total: from the resumed step s on, the multiplier "
    "is lr_multiplier(s, new total, warmup_steps, schedule), the value a run planned for the new "
    "total from the start has at s (the rate steps at the resume: up for a longer run, down for "
    "a shorter one)"
)

# The keys a resume may change, with what the change does (logged when it happens).
MUTABLE_KEYS: dict[str, str] = {
    "name": "a label; the run keeps its run id",
    "source": "where the recipe was read from",
    "output_dir": "the run's directory, which may have been moved or be reached by another path",
    "data.train": (
        "read from the new path from here on; its annotations are checked against the recipe's "
        "tokenizers and lengths when they load, not against the earlier run's rows"
    ),
    "data.dev": "dev loss and samples only",
    "data.train_split": "as data.train: which rows of a Hub dataset id are read from here on",
    "data.dev_split": "as data.dev: dev loss and samples only",
    "data.subset": "as data.train: which rows of a Hub dataset id are read from here on",
    "data.revision": "as data.train: which commit of a Hub dataset id is read from here on",
    "student.config": "read by --dry-run only",
    "teacher.config": "read by --dry-run only",
    "student.license": "the licence the exported students' model cards name, from the next export on",
    "loss.chunk_size": "memory only: the same loss, summed in other chunks",
    "loss.fused_head": "memory only: the same loss, from hidden states and heads a chunk at a time",
    "teacher_cache.dir": (
        "where the teacher's outputs are read from (null: the online teacher); a cache is checked against the "
        "recipe's teacher, data, layers, logits, top_k, samples, states and storage when it loads, and differs from "
        "the online teacher only beyond its top_k tokens (sampled: by its draws' noise) and by its storage precision"
    ),
    "teacher_cache.states": (
        "the bytes of the states a cache is built with; a cache of the states in the storage's precision serves "
        "every choice, so a run resumed on the same cache reads the same states"
    ),
    "train.teacher_zero3": (
        "how the frozen teacher's weights are spread over the devices; the teacher is not in the checkpoint"
    ),
    "train.lr": "the student's base learning rate from the resumed step on; the schedule multiplier is unchanged",
    "train.projector_lr": (
        "the HRA projectors' base learning rate from the resumed step on; the schedule multiplier is unchanged"
    ),
    "train.max_steps": LR_RULE,
    "train.epochs": LR_RULE,
    "train.log_interval": "from the resumed step on",
    "train.eval_interval": "from the resumed step on",
    "train.save_interval": "from the resumed step on",
    "train.keep_checkpoints": "at the next save, which keeps this many of the newest checkpoints",
    "train.checkpoint_at_end": "whether the run's last step is checkpointed besides final/",
    "train.num_sample_generations": "dev samples only",
    "train.sample_max_new_tokens": "dev samples only",
    "train.save_generated": (
        "whether the rows the student generates are also written to generated/, from the resumed step on"
    ),
    "train.push_to_hub": "where final/ (and best/) are pushed when the run ends",
    "train.report_to": (
        "which experiment trackers get the records from the resumed step on; one the run "
        "reported to before continues its run there (OUT/tracking.json)"
    ),
    "off_policy.loss_eps": (
        "the dev-loss rise that raises the threshold, from the next dev evaluation on; the "
        "threshold and reference dev loss reached so far are kept"
    ),
    "off_policy.threshold_step": (
        "what a dev-loss rise adds to the threshold, from the next dev evaluation on; the "
        "threshold reached so far is kept"
    ),
}


class _Absent:
    """A key one of the two recipes does not have."""

    def __repr__(self) -> str:
        return "(not set)"


ABSENT = _Absent()


class Change(NamedTuple):
    key: str  # dotted, e.g. "train.lr"
    old: Any  # the checkpoint's value (ABSENT: it had none)
    new: Any  # the new recipe's value (ABSENT: it has none)


@dataclass
class ResumeChanges:
    """How a new recipe differs from a checkpoint's: changes that apply, and changes refused."""

    applied: list[Change] = field(default_factory=list)
    refused: list[Change] = field(default_factory=list)

    def log_lines(self) -> list[str]:
        """One line per applied change: ``train.lr: 0.0001 → 5e-05 (what it does)``."""
        return [
            f"resume changes {key}: {_text(old)} → {_text(new)} "
            f"({MUTABLE_KEYS.get(key, 'no longer a recipe key: ignored')})"
            for key, old, new in self.applied
        ]

    def raise_if_refused(self, checkpoint: Path | str) -> None:
        """``MtaError`` naming every refused key with its old and new value, and what works."""
        if not self.refused:
            return
        changes = "\n".join(f"  {key}: {_text(old)} → {_text(new)}" for key, old, new in self.refused)
        back = [_restoring(change) for change in self.refused]
        overrides = " ".join(item for item in back if not item.startswith("remove "))
        removals = [item.removeprefix("remove ") for item in back if item.startswith("remove ")]
        undo = []
        if overrides:
            undo.append(f"put the old values back (override {overrides})")
        if removals:
            undo.append(f"remove {', '.join(removals)} from the recipe")
        raise MtaError(
            f"{checkpoint}: cannot resume with this recipe: it changes what the run was trained "
            f"with (compared with {Path(checkpoint) / SAVED_RECIPE}):\n{changes}\n"
            f"Either {' and '.join(undo)}, or start a new run: --overwrite (removes this run's "
            "outputs) or another output_dir. A resume may change only "
            f"{', '.join(MUTABLE_KEYS)}."
        )


def read_saved_recipe(checkpoint: Path) -> dict[str, Any]:
    """The recipe mapping saved beside ``checkpoint`` (read as recipes are: bounded YAML)."""
    path = Path(checkpoint) / SAVED_RECIPE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as error:
        raise MtaError(
            f"{checkpoint}: no {SAVED_RECIPE}, so the recipe cannot be checked against the one the "
            "run was trained with; copy it from another checkpoint of the run (or final/), or "
            "start a new run: --overwrite or another output_dir"
        ) from error
    saved = load_yaml(text, str(path))
    if not isinstance(saved, dict):
        raise MtaError(f"{path}: a recipe is a YAML mapping, got {type(saved).__name__}")
    return renamed_recipe_keys(saved, source=str(path), quiet=True)  # an older mta's key names


def resume_changes(saved: dict[str, Any], new: Recipe) -> ResumeChanges:
    """Compare a checkpoint's saved recipe mapping with the recipe a resume was given."""
    changes = ResumeChanges()
    for change in _differences(_with_defaults(saved), to_jsonable_python(new), ()):
        mutable = change.key in MUTABLE_KEYS or not _known_to_schema(change.key.split("."), type(new))
        (changes.applied if mutable else changes.refused).append(change)
    return changes


def check_resume(checkpoint: Path, recipe: Recipe) -> ResumeChanges:
    """Read ``checkpoint``'s recipe, refuse what may not change, return what does (to log)."""
    changes = resume_changes(read_saved_recipe(checkpoint), recipe)
    changes.raise_if_refused(checkpoint)
    return changes


def check_resume_length(step: int, total_steps: int, recipe: Recipe, checkpoint: Path | str) -> None:
    """Refuse a checkpoint already past the run's (new) total: a run cannot go back."""
    if step <= total_steps:
        return
    length = (
        f"train.max_steps={recipe.train.max_steps}"
        if recipe.train.max_steps is not None
        else f"train.epochs={recipe.train.epochs:g}"
    )
    raise MtaError(
        f"{checkpoint} is at step {step:,}, past the {total_steps:,} steps this recipe trains "
        f"({length}); give a length of at least {step:,} steps to continue it, or start a new "
        "run: --overwrite or another output_dir"
    )


# --- comparison ------------------------------------------------------------------------------


# Keys added later whose default is not what a checkpoint without them trained with: such a
# checkpoint's recipe counts as holding this value (an LLM recipe's).
TRAINED_BEFORE_THE_KEY = {"loss_reduction": "micro_batch"}  # 0.2.0: each micro batch its own mean


def _with_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """The saved mapping as ``model_dump(mode="json")`` would give it today: keys it lacks take
    their defaults (``train:`` keys in ``TRAINED_BEFORE_THE_KEY`` the value they trained with).
    Validated when it still validates (paths are not checked there); otherwise (the schema has
    since tightened) each missing key takes its field's default as written."""
    schema = recipe_schema(saved)  # the checkpoint's task: llm (Recipe) or embedding
    if schema is Recipe and isinstance(saved.get("train"), dict):
        saved = {**saved, "train": TRAINED_BEFORE_THE_KEY | saved["train"]}
    try:
        return to_jsonable_python(schema.model_validate(saved))
    except ValidationError:
        return _fill_defaults(schema, saved)


def _fill_defaults(model: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    filled = dict(data)
    for name, info in model.model_fields.items():
        nested = models_in(info.annotation)
        if name in filled:
            if nested and isinstance(filled[name], dict):
                filled[name] = _fill_defaults(nested[0], filled[name])
        elif not info.is_required():
            default = info.get_default(call_default_factory=True)
            filled[name] = to_jsonable_python(default)  # a section's default: its model_dump(mode="json")
    return filled


def _differences(old: Any, new: Any, path: tuple[str, ...]) -> list[Change]:
    if isinstance(old, dict) and isinstance(new, dict):
        keys = list(new) + [key for key in old if key not in new]
        return [
            change
            for key in keys
            for change in _differences(old.get(key, ABSENT), new.get(key, ABSENT), path + (str(key),))
        ]
    return [] if _same(old, new) else [Change(".".join(path), old, new)]


def _same(old: Any, new: Any) -> bool:
    """Equal as recipe values: 5 and 5.0 are, 1 and true are not."""
    if isinstance(old, bool) or isinstance(new, bool):
        return type(old) is type(new) and old == new
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        return len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new, strict=True))
    if isinstance(old, dict) and isinstance(new, dict):
        return old.keys() == new.keys() and all(_same(old[key], new[key]) for key in old)
    return old == new  # JSON values of different types are unequal, but for numbers (5 == 5.0)


def _known_to_schema(parts: list[str], schema: type[BaseModel] = Recipe) -> bool:
    """Whether the schema still has this key (anything under ``deepspeed`` is free-form)."""
    model: type[BaseModel] | None = schema
    for part in parts:
        if model is None:
            return True  # inside a free-form mapping
        if part not in model.model_fields:
            return False
        nested = models_in(model.model_fields[part].annotation)
        model = nested[0] if nested else None
    return True


def _text(value: Any) -> str:
    if value is ABSENT:
        return repr(value)
    return yaml_text(value)


def _restoring(change: Change) -> str:
    """What puts the checkpoint's value back: ``key=old`` (shell-quoted) or ``remove key``."""
    if change.old is ABSENT:
        return f"remove {change.key}"
    return shlex.quote(f"{change.key}={_text(change.old)}")
