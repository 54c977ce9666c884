"""``task: llm`` as a ``mta.task_registry.Task`` (registered by ``mta.tasks``): its run planned by
``mta.training.llm.plan`` and built by ``mta.training.llm.build``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mta.task_registry import Task
from mta.training.config.schema import Recipe

if TYPE_CHECKING:
    from mta.reporting import Reporter
    from mta.training.dry_run import RunPlan
    from mta.training.lifecycle.model_card import CardFacts
    from mta.training.trainer import Run


class LLMTask(Task):
    """``task: llm``: distil a causal LM (the default)."""

    name = "llm"
    schema = Recipe
    group_factor = None  # length-grouped pools: a micro batch pads little
    samples_dev_prompts = True
    reference_padding = True  # the authors pad every batch to max_length (loss.reference_code)

    def build_run(
        self, recipe: Recipe, reporter: Reporter, *, resume: str | None = None, overwrite: bool = False
    ) -> Run:
        from mta.training.llm.build import build_llm_run

        return build_llm_run(recipe, reporter, self, resume=resume, overwrite=overwrite)

    def plan_run(self, recipe: Recipe, world_size: int = 1) -> RunPlan:
        from mta.training.llm.plan import plan_llm_run

        return plan_llm_run(recipe, world_size)

    def card(self, recipe: Recipe) -> CardFacts:
        from mta.training.lifecycle.model_card import llm_card_facts

        return llm_card_facts(recipe)
