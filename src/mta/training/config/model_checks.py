"""The recipe against the models: what only their configs and tokenizers can tell.

``position_limit`` reads a Hugging Face config's positions, ``check_sequence_lengths`` refuses
``data.max_length`` (and the dev samples) beyond them, and ``check_off_policy_fits`` refuses
student generation where the loaded tokenizers leave no teacher logit loss. What a recipe can
check on its own is its schema's (``mta.training.config.schema``).
"""

from __future__ import annotations

from typing import Any

from mta.errors import MtaError
from mta.training.config.schema import ON_POLICY_NEEDS_LOGITS, DataSpec, Recipe

# Config keys that bound a model's positions, by the name the config itself uses.
POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions")


def position_limit(config: Any) -> tuple[int, str] | None:
    """``(positions, config key)`` a Hugging Face model config allows, or None if it has no limit
    (a model without ``max_position_embeddings`` / ``n_positions``)."""
    own = vars(config) if hasattr(config, "__dict__") else {}
    # The config's own key first: GPT-2's config also answers to max_position_embeddings.
    for read in (own.get, lambda attribute: getattr(config, attribute, None)):
        for attribute in POSITION_LIMIT_KEYS:
            value = read(attribute)
            if type(value) is int and value > 0:
                return value, attribute
    return None


def check_sequence_lengths(
    data: DataSpec,
    config: Any,
    role: str,
    *,
    model: str | None = None,
    sample_new_tokens: int = 0,
    source: str | None = None,
) -> None:
    """Refuse ``data.max_length`` beyond the positions ``config`` (the ``role`` model's) has.

    ``role`` is ``"student"`` or ``"teacher"``; ``model`` names it in the message (default: the
    config's ``name_or_path``). ``sample_new_tokens``: the dev samples the student generates
    (``Recipe.dev_sample_new_tokens``) extend a prompt of up to ``data.max_prompt_length``
    tokens, so those must fit too. ``source`` (the recipe file) starts the message. Raises
    ``MtaError`` naming the key, the model and its limit; a config without a limit passes.
    """
    found = position_limit(config)
    if found is None:
        return
    limit, attribute = found
    name = model or getattr(config, "name_or_path", "") or getattr(config, "model_type", "") or role
    what = f"the {role} ({name}) has {limit:,} positions ({attribute} in its config)"
    where = f"{source}: " if source else ""
    if data.max_length > limit:
        raise MtaError(
            f"{where}data.max_length={data.max_length:,} is longer than {what}; set data.max_length to at "
            f"most {limit:,} (and data.max_prompt_length below it)"
        )
    sampled = data.max_prompt_length + sample_new_tokens
    if sample_new_tokens and sampled > limit:
        raise MtaError(
            f"{where}dev samples need up to data.max_prompt_length + train.sample_max_new_tokens = "
            f"{data.max_prompt_length:,} + {sample_new_tokens:,} = {sampled:,} positions, more than "
            f"{what}; lower train.sample_max_new_tokens to at most "
            f"{max(limit - data.max_prompt_length, 0):,} (or train.num_sample_generations=0)"
        )


def check_off_policy_fits(recipe: Recipe, same_tokenizer: bool) -> None:
    """Refuse student generation where the loaded tokenizers leave no teacher logit loss.

    The trainer calls it once the tokenizers are loaded (``same_tokenizer``: the teacher's and the
    student's vocabulary fingerprints are equal). Across tokenizers the base loss can only be ce
    on the reference (docs/method.md §5), so generated text would have no teacher signal. Raises
    ``MtaError`` naming the keys; passes when ``off_policy.mode`` is off.
    """
    if recipe.off_policy.mode == "off" or same_tokenizer:
        return
    assert recipe.teacher is not None, "the schema refuses generation without a teacher (off_policy_problem)"
    where = f"{recipe.source}: " if recipe.source else ""
    raise MtaError(
        f"{where}off_policy.mode={recipe.off_policy.mode} needs the teacher and the student to share "
        f"a tokenizer, and these differ ({recipe.teacher.tokenizer_path} vs "
        f"{recipe.student.tokenizer_path}): across tokenizers there is no logit loss, and "
        f"{ON_POLICY_NEEDS_LOGITS}. Set off_policy.mode=off, or use a teacher with the student's tokenizer"
    )
