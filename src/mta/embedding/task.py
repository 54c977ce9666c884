"""``task: embedding`` (TALAS) in the task registry (``mta.training.tasks``): its recipe schema,
its run built and planned by ``mta.embedding.training_run``, and how the one training loop runs it."""

from __future__ import annotations

from mta.embedding.recipe import EmbeddingRecipe
from mta.training.tasks import Task

EMBEDDING_TASK = Task(
    name="embedding",
    schema=EmbeddingRecipe,
    builder="mta.embedding.training_run:build_embedding_run",
    planner="mta.embedding.training_run:plan_embedding_run",
    # Uniformly random micro batches (SimCSE's and LASD's in-batch comparisons), as TALAS's
    # author's shuffled DataLoader.
    group_factor=1,
    samples_dev_prompts=False,  # an encoder generates nothing
    reference_padding=False,  # loss.reference_code is MTA's, an LLM recipe's
)
