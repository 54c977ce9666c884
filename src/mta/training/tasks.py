"""The training tasks a recipe's ``task:`` names, and what each one decides.

A task is a ``Task``: its recipe schema, the functions that build its run and plan it for
``--dry-run``, and the few things the one training loop (``mta.training.trainer.Trainer``) does
differently for it. ``TASKS`` registers each by name as ``"module:NAME"`` of its ``Task``, imported
on first use (``importlib``), so ``mta.training`` never imports a task's package: the embedding
wing (``mta.embedding``, TALAS) imports training, never the reverse. A task's builder and planner
are named the same way, so picking a recipe's schema loads no model code.

A new task is a ``Task`` in its own module and one entry in ``TASKS``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from mta.errors import MtaError

TASKS: dict[str, str] = {
    "llm": "mta.training.llm_task:LLM_TASK",
    "embedding": "mta.embedding.task:EMBEDDING_TASK",
}


@dataclass(frozen=True)
class Task:
    """One ``task:`` of a recipe, registered in ``TASKS``."""

    name: str
    schema: type  # the recipe class load_recipe validates a file of this task with
    builder: str  # "module:function" (recipe, reporter, *, resume, overwrite) -> trainer.Run
    planner: str  # "module:function" (recipe, world_size) -> dry_run.RunPlan
    card_facts: str  # "module:function" (recipe) -> lifecycle.model_card.CardFacts of its exports
    group_factor: int | None = None  # micro batches per length-sorted pool; None: micro_batch_order's
    samples_dev_prompts: bool = True  # each evaluation samples the student's continuations of dev prompts
    reference_padding: bool = True  # loss.reference_code pads every micro batch to data.max_length
    # train.loss_reduction=global: the objective counts and divides by the window's units (its
    # engine module is a DistillationModel); False: every micro batch its own mean
    global_reduction: bool = True

    def build_run(self, recipe: Any, reporter: Any, *, resume: str | None = None, overwrite: bool = False) -> Any:
        """The ``Run`` of ``recipe``: output directory claimed, models and data loaded, engine started."""
        return _named_object(self.builder)(recipe, reporter, resume=resume, overwrite=overwrite)

    def plan_run(self, recipe: Any, world_size: int = 1) -> Any:
        """The ``RunPlan`` ``mta distill --dry-run`` shows for ``recipe``; no weights loaded."""
        return _named_object(self.planner)(recipe, world_size)

    def card(self, recipe: Any) -> Any:
        """What the model card of an exported student of ``recipe`` says for this task."""
        return _named_object(self.card_facts)(recipe)


def task_named(name: str) -> Task:
    """The registered task ``name``; ``MtaError`` naming the tasks for any other."""
    if name not in TASKS:
        raise MtaError(f"task {name!r} is not a task; use one of {', '.join(map(repr, TASKS))}")
    return _named_object(TASKS[name])


def task_of(recipe: Any) -> Task:
    """The task of a validated recipe (its ``task`` key)."""
    return task_named(recipe.task)


def _named_object(reference: str) -> Any:
    """The object ``"package.module:name"`` names, its module imported on first use."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)
