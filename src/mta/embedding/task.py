"""``task: embedding`` (TALAS) as a ``mta.task_registry.Task`` (registered by ``mta.tasks``): its
recipe schema, its run built and planned by ``mta.embedding.training_run``, and how the one
training loop runs it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mta.embedding.recipe import EmbeddingRecipe
from mta.task_registry import Task
from mta.training.lifecycle.model_card import CardFacts, base_metadata, describe_model, loss_terms

if TYPE_CHECKING:
    from mta.reporting import Reporter
    from mta.training.dry_run import RunPlan
    from mta.training.trainer import Run


class EmbeddingTask(Task):
    """``task: embedding``: distil a sentence encoder with TALAS."""

    name = "embedding"
    schema = EmbeddingRecipe
    # Uniformly random micro batches (SimCSE's and LASD's in-batch comparisons), as TALAS's
    # author's shuffled DataLoader.
    group_factor = 1
    samples_dev_prompts = False  # an encoder generates nothing
    reference_padding = False  # loss.reference_code is MTA's, an LLM recipe's
    global_reduction = False  # SimCSE's and LASD's in-batch comparisons are per micro batch

    def build_run(
        self, recipe: EmbeddingRecipe, reporter: Reporter, *, resume: str | None = None, overwrite: bool = False
    ) -> Run:
        from mta.embedding.training_run import build_embedding_run

        return build_embedding_run(recipe, reporter, self, resume=resume, overwrite=overwrite)

    def plan_run(self, recipe: EmbeddingRecipe, world_size: int = 1) -> RunPlan:
        from mta.embedding.training_run import plan_embedding_run

        return plan_embedding_run(recipe, world_size)

    def card(self, recipe: EmbeddingRecipe) -> CardFacts:
        return embedding_card_facts(recipe)


def embedding_card_facts(recipe: EmbeddingRecipe) -> CardFacts:
    """The model card of a sentence-embedding student (``mta.training.lifecycle.model_card``)."""
    loss = recipe.loss
    terms = (("SimCSE", loss.simcse_weight), ("TAMD", loss.tamd_weight), ("LASD", loss.lasd_weight))
    meta = base_metadata(recipe, library="sentence-transformers", pipeline="sentence-similarity")
    meta["tags"] = (
        ["mta", "knowledge-distillation", "sentence-transformers", "talas"]
        + [name.lower() for name, weight in terms if weight]
        + (["asam"] if recipe.train.asam else [])
    )
    return CardFacts(
        metadata=meta,
        intro="A sentence-embedding student distilled with mta (TALAS: teacher-anchored upper layers, "
        "layer-aligned self-distillation). It is a Hugging Face encoder "
        '(`AutoModel.from_pretrained("<this directory>")`) and a sentence-transformers model: '
        '`SentenceTransformer("<this directory>")`, with `trust_remote_code=True` when its '
        "pooling is cls_attention (the module is `cls_attention_pooling.py` here); "
        "`sha256sum -c checksums.sha256` verifies its files.",
        loss=loss_terms(terms) + (" with ASAM" if recipe.train.asam is not None else ""),
        teacher=describe_model(recipe.teacher, recipe)
        if recipe.teacher is not None
        else f"its stored embeddings in `{recipe.data.train}`",
        data_limits=f"at most {recipe.data.max_length} tokens",
    )
