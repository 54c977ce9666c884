"""``task: llm`` (a recipe's default) in the task registry (``mta.training.tasks``): distil a
causal LM, its run built by ``mta.training.trainer.build_llm_run`` and planned for ``--dry-run``
by ``mta.training.dry_run.plan_llm_run``."""

from __future__ import annotations

from mta.training.config.schema import Recipe
from mta.training.tasks import Task

LLM_TASK = Task(
    name="llm",
    schema=Recipe,
    builder="mta.training.trainer:build_llm_run",
    planner="mta.training.dry_run:plan_llm_run",
    card_facts="mta.training.lifecycle.model_card:llm_card_facts",
    group_factor=None,  # length-grouped pools: a micro batch pads little
    samples_dev_prompts=True,
    reference_padding=True,  # the authors pad every batch to max_length (loss.reference_code)
)
