"""The training tasks a recipe's ``task:`` names: the interface the one training loop runs, and
the registry that maps a name to its task.

A task is a ``Task``: its recipe schema, how its run is built and planned for ``--dry-run``,
what an exported student's model card says, and the few things the loop
(``mta.training.trainer.Trainer``) does differently for it. The loop never asks which task it
runs: the builder puts the task on the ``Run`` once.

The registry is filled from above: ``mta.tasks`` (the layer above ``mta.training`` and
``mta.embedding``, imported by the ``mta`` package itself, so it has run before any lookup)
registers each task by name with a loader that imports it on first use. So ``mta.training``
never imports ``mta.embedding`` (TALAS is a wing on top of training), looking up a recipe's
schema loads no model code, and ``import mta`` stays light. The registry sits beside
``mta.errors`` at the foot of the layers, outside ``mta.training``, so that ``import mta`` loads
nothing of the training package.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from mta.errors import MtaError

if TYPE_CHECKING:
    from mta.reporting import Reporter


class Task(ABC):
    """One ``task:`` of a recipe."""

    name: ClassVar[str]
    schema: ClassVar[type]  # the recipe class load_recipe validates a file of this task with
    group_factor: ClassVar[int | None] = None  # micro batches per length-sorted pool; None: micro_batch_order's
    samples_dev_prompts: ClassVar[bool] = True  # each evaluation samples the student's continuations of dev prompts
    reference_padding: ClassVar[bool] = True  # loss.reference_code pads every micro batch to data.max_length
    # train.loss_reduction=global: the objective counts and divides by the window's units (its
    # engine module is a DistillationModel); False: every micro batch its own mean
    global_reduction: ClassVar[bool] = True

    # The interface sits below the training layer, so it cannot name the types a task returns
    # (mta.training.trainer.Run, mta.training.dry_run.RunPlan, mta.training.lifecycle.model_card.
    # CardFacts): each task's methods declare them, and the loop's callers annotate what they get.
    @abstractmethod
    def build_run(self, recipe: Any, reporter: Reporter, *, resume: str | None = None, overwrite: bool = False) -> Any:
        """The ``Run`` of ``recipe``: output directory claimed, models and data loaded, engine started."""

    @abstractmethod
    def plan_run(self, recipe: Any, world_size: int = 1) -> Any:
        """The ``RunPlan`` ``mta distill --dry-run`` shows for ``recipe``; no weights loaded."""

    @abstractmethod
    def card(self, recipe: Any) -> Any:
        """The ``CardFacts`` the model card of an exported student of ``recipe`` says for this task."""


_LOADERS: dict[str, Callable[[], Task]] = {}
_LOADED: dict[str, Task] = {}


def register(name: str, loader: Callable[[], Task]) -> None:
    """Register the task ``name``; ``loader`` imports and returns it on its first lookup."""
    _LOADERS[name] = loader
    _LOADED.pop(name, None)


def task_names() -> tuple[str, ...]:
    """Every registered task's name, in registration order."""
    return tuple(_LOADERS)


def task_named(name: str) -> Task:
    """The registered task ``name``; ``MtaError`` naming the tasks for any other."""
    if name not in _LOADERS:
        raise MtaError(f"task {name!r} is not a task; use one of {', '.join(map(repr, _LOADERS))}")
    if name not in _LOADED:
        _LOADED[name] = _LOADERS[name]()
    return _LOADED[name]


def task_of(recipe: Any) -> Task:
    """The task of a validated recipe (its ``task`` key)."""
    return task_named(recipe.task)
