"""Loading the student and the teacher a recipe names.

A recipe names each model by hub name or directory, or describes a ``tiny`` random model that is
built (with its tokenizer) at first use under the run's output directory. The loaded teacher is
then wrapped in ``mta.training.teacher.FrozenTeacher``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from mta.dtypes import torch_dtype
from mta.errors import MtaError
from mta.hashing import file_sha256, json_sha256
from mta.models.hub import load_pretrained
from mta.models.tiny import build_tiny_model, build_tiny_tokenizer
from mta.models.tokenizers import load_tokenizer, tokenizer_fingerprint
from mta.training.config.schema import ModelSpec, Recipe, RecipeChecks

log = logging.getLogger(__name__)

KEY_LENGTH = 12  # hex digits of the content key in a built model's directory name


class TinyTokenizerSource(Protocol):
    """What a ``tiny`` description trains its tokenizer from (``TinyModel``, ``mta.embedding``'s
    ``TinyEncoder``)."""

    @property
    def tokenizer_corpus(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...


class NamedModel(Protocol):
    """A recipe's model entry as the source helpers read it (``ModelSpec``, ``mta.embedding``'s
    ``EncoderSpec``)."""

    @property
    def path(self) -> str: ...

    @property
    def tokenizer_path(self) -> str: ...

    @property
    def tiny(self) -> TinyTokenizerSource | None: ...


def model_source(spec: ModelSpec, recipe: Recipe, role: str) -> tuple[str, str]:
    """``(model, tokenizer)`` as directories or hub names, building ``tiny`` models first.

    Built models are keyed on what they are built from, so a changed description builds a new
    one instead of reusing (or overwriting) the old: a ``tiny`` model lives at
    ``<path>-<key>`` (relative paths under ``output_dir``), the key a hash of its description
    and its tokenizer's fingerprint; its tokenizer, unless ``tokenizer`` names one, is trained
    from ``tiny.tokenizer_corpus`` into ``output_dir/models/tokenizer-<vocab>-<key>``, the key a
    hash of the corpus bytes, so a tiny teacher and student of the same vocabulary share it.
    """
    if spec.tiny is None:
        return local_or_hub_sources(spec, recipe, role)
    tiny = spec.tiny
    output_dir = recipe.resolve(recipe.output_dir, "output_dir")
    if spec.tokenizer:
        tokenizer_dir = recipe.resolve(spec.tokenizer, f"{role}.tokenizer")
    else:
        corpus, key = tiny_tokenizer_corpus(spec, recipe, role)
        tokenizer_dir = output_dir / "models" / f"tokenizer-{tiny.vocab_size}-{key}"
        build_tiny_tokenizer(corpus, tokenizer_dir, vocab_size=tiny.vocab_size)
    description = tiny.model_dump(exclude={"tokenizer_corpus", "vocab_size"})
    key = json_sha256({"tiny": description, "tokenizer": tokenizer_fingerprint(load_tokenizer(tokenizer_dir))})
    model_dir = Path(spec.path).expanduser()
    if not model_dir.is_absolute():
        model_dir = output_dir / model_dir
    model_dir = model_dir.with_name(f"{model_dir.name}-{key[:KEY_LENGTH]}")
    build_tiny_model(
        tokenizer_dir,
        model_dir,
        model_type=tiny.model_type,
        num_layers=tiny.num_layers,
        hidden_size=tiny.hidden_size,
        num_heads=tiny.num_heads,
        seed=tiny.seed,
    )
    return str(model_dir), str(tokenizer_dir)


def local_or_hub_sources(spec: NamedModel, recipe: RecipeChecks, role: str) -> tuple[str, str]:
    """``(model, tokenizer)`` of a spec that names them: a directory when it exists (beside the
    recipe or from the working directory), else the name as written (a Hub name)."""
    model = recipe.resolve(spec.path, f"{role}.path")
    tokenizer = recipe.resolve(spec.tokenizer_path, f"{role}.tokenizer")
    return _existing_or_hub(model, spec.path), _existing_or_hub(tokenizer, spec.tokenizer_path)


def tiny_tokenizer_corpus(spec: NamedModel, recipe: RecipeChecks, role: str) -> tuple[Path, str]:
    """The corpus a ``tiny`` model's tokenizer trains on, and the cache key of what it is built
    from (the corpus bytes and the vocabulary size): one key rule for causal LMs and encoders."""
    tiny = spec.tiny
    if tiny is None:
        raise MtaError(f"{role}.tiny is not set: {role} names a model, no tokenizer is built for it")
    corpus = recipe.resolve(tiny.tokenizer_corpus, f"{role}.tiny.tokenizer_corpus")
    if not corpus.is_file():
        raise MtaError(f"{role}.tiny.tokenizer_corpus: no such file {corpus}")
    return corpus, json_sha256({"corpus": file_sha256(corpus), "vocab_size": tiny.vocab_size})[:KEY_LENGTH]


def tokenizer_sources(recipe: Recipe) -> dict[str, str]:
    """``{"teacher": …, "student": …}``: where each side's tokenizer loads from, as training loads
    it (a ``tiny:`` model and its tokenizer are built at first use, under ``output_dir``), so an
    artefact annotated with them is the one training accepts. Without a teacher (plain SFT) the
    student's tokenizer stands on both sides."""
    student = model_source(recipe.student, recipe, "student")[1]
    teacher = model_source(recipe.teacher, recipe, "teacher")[1] if recipe.teacher else student
    return {"teacher": teacher, "student": student}


def _existing_or_hub(resolved: Path, written: str) -> str:
    return str(resolved) if resolved.exists() else written


@dataclass
class LoadedModel:
    """A model, its tokenizer, and where that tokenizer loads from (what annotate is given)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    tokenizer_source: str
    path: str = ""  # where the model loaded from: a directory or a hub name


@dataclass
class LoadedConfig:
    """A model's config and tokenizer without its weights (a cached teacher's side), and where
    each loads from."""

    path: str
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    tokenizer_source: str


def load_config_and_tokenizer(spec: ModelSpec, recipe: Recipe, role: str) -> LoadedConfig:
    """The config and tokenizer ``load_causal_lm`` would load, without reading a weight file."""
    model_path, tokenizer_path = model_source(spec, recipe, role)
    config = load_pretrained(
        AutoConfig.from_pretrained,
        model_path,
        what=f"{role}.path",
        otherwise=f"{role}.path: cannot read a model config from '{model_path}' (give a local model "
        "directory or a hub name that is in the Hugging Face cache)",
    )
    return LoadedConfig(model_path, config, _padded_tokenizer(tokenizer_path), tokenizer_path)


def _padded_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer at ``path``, padding with EOS when it names no pad token."""
    tokenizer = load_tokenizer(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(spec: ModelSpec, recipe: Recipe, role: str) -> LoadedModel:
    """The model (weights in ``spec.dtype``) and its tokenizer; errors name the recipe key.
    With ``spec.lora`` the model comes with its LoRA adapters, all else frozen (``mta.training.lora``)."""
    model_path, tokenizer_path = model_source(spec, recipe, role)
    tokenizer = _padded_tokenizer(tokenizer_path)
    # Attention as transformers chooses it (SDPA where the model has it): its memory is linear in
    # the sequence, where eager attention keeps a [heads, seq, seq] matrix a layer (at 4,096
    # tokens, 14 heads: 0.9 GB a row in fp32). SRA's attention centres switch to eager (build).
    model = load_pretrained(
        AutoModelForCausalLM.from_pretrained,
        model_path,
        what=f"{role}.path",
        otherwise=f"{role}.path: cannot load a causal LM from '{model_path}' (give a local model "
        "directory or a hub name that is in the Hugging Face cache)",
        dtype=torch_dtype(spec.dtype),
    )
    if len(tokenizer) > embedding_rows(model):
        raise MtaError(
            f"{role}: the tokenizer '{tokenizer_path}' has {len(tokenizer)} tokens but the model "
            f"'{model_path}' only {embedding_rows(model)} embedding rows; "
            f"set {role}.tokenizer to the model's own tokenizer"
        )
    if spec.lora is not None:  # the student's adapters (the schema refuses teacher.lora)
        from mta.training import lora

        model = lora.wrap(model, spec.lora, seed=recipe.seed)
    return LoadedModel(model, tokenizer, tokenizer_path, model_path)


def num_layers(model: PreTrainedModel | PretrainedConfig) -> int:
    """Transformer blocks of a model (or its config): ``hidden_states`` indices run from 0
    (embeddings) to this."""
    config = model if isinstance(model, PretrainedConfig) else model.config
    return config.get_text_config().num_hidden_layers


def hidden_size(model: PreTrainedModel | PretrainedConfig) -> int:
    config = model if isinstance(model, PretrainedConfig) else model.config
    return config.get_text_config().hidden_size


def embedding_rows(model: PreTrainedModel) -> int:
    """Rows of the model's input embedding: the token ids it takes (padding rows included)."""
    embeddings = model.get_input_embeddings()
    if not isinstance(embeddings, nn.Embedding):
        raise MtaError(
            f"{type(model).__name__}'s input embedding is a {type(embeddings).__name__}, not an nn.Embedding "
            "(a Hugging Face model's token embedding): mta cannot count its rows"
        )
    return embeddings.num_embeddings
