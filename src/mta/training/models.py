"""Loading the student and the teacher, and running the teacher for only what the loss reads.

A recipe names each model by hub name or directory, or describes a ``tiny`` random model that is
built (with its tokenizer) at first use under the run's output directory. The teacher is frozen
and wrapped in ``FrozenTeacher``: without a logit loss it runs only up to the deepest aligned
layer, skipping the blocks above it, the final norm and the LM head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from mta.errors import MtaError
from mta.models.tiny import build_tiny_model, build_tiny_tokenizer
from mta.models.tokenizers import load_tokenizer
from mta.training.recipe import ModelSpec, Recipe

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_source(spec: ModelSpec, recipe: Recipe, role: str) -> tuple[str, str]:
    """``(model, tokenizer)`` as directories or hub names, building ``tiny`` models first.

    A ``tiny`` model is built at ``path`` (relative paths under ``output_dir``); its tokenizer is
    trained from ``tiny.tokenizer_corpus`` into ``output_dir/models/tokenizer-<vocab>`` unless
    ``tokenizer`` names one, so a tiny teacher and student of the same vocabulary share it.
    """
    if spec.tiny is None:
        model = recipe.resolve(spec.path, f"{role}.path")
        tokenizer = recipe.resolve(spec.tokenizer_path, f"{role}.tokenizer")
        return _existing_or_hub(model, spec.path), _existing_or_hub(tokenizer, spec.tokenizer_path)
    tiny = spec.tiny
    output_dir = recipe.resolve(recipe.output_dir, "output_dir")
    if spec.tokenizer:
        tokenizer_dir = recipe.resolve(spec.tokenizer, f"{role}.tokenizer")
    else:
        tokenizer_dir = output_dir / "models" / f"tokenizer-{tiny.vocab_size}"
        corpus = recipe.resolve(tiny.tokenizer_corpus, f"{role}.tiny.tokenizer_corpus")
        if not corpus.exists():
            raise MtaError(f"{role}.tiny.tokenizer_corpus: no such file {corpus}")
        build_tiny_tokenizer(corpus, tokenizer_dir, vocab_size=tiny.vocab_size)
    model_dir = Path(spec.path).expanduser()
    if not model_dir.is_absolute():
        model_dir = output_dir / model_dir
    build_tiny_model(
        tokenizer_dir, model_dir, model_type=tiny.model_type, num_layers=tiny.num_layers,
        hidden_size=tiny.hidden_size, num_heads=tiny.num_heads, seed=tiny.seed,
    )
    return str(model_dir), str(tokenizer_dir)


def _existing_or_hub(resolved: Path, written: str) -> str:
    return str(resolved) if resolved.exists() else written


@dataclass
class LoadedModel:
    """A model, its tokenizer, and where that tokenizer loads from (what annotate is given)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    tokenizer_source: str


def load_causal_lm(spec: ModelSpec, recipe: Recipe, role: str) -> LoadedModel:
    """The model (weights in ``spec.dtype``) and its tokenizer; errors name the recipe key."""
    model_path, tokenizer_path = model_source(spec, recipe, role)
    tokenizer = load_tokenizer(tokenizer_path)
    try:
        # Eager attention: the same maths on every backend, and the tiny models gain nothing
        # from fused kernels on CPU.
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=DTYPES[spec.dtype], attn_implementation="eager"
        )
    except Exception as error:  # OSError, ValueError, hub errors...
        raise MtaError(
            f"{role}.path: cannot load a causal LM from '{model_path}': {error}. Give a local "
            "model directory or a hub name that is in the Hugging Face cache."
        ) from error
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise MtaError(
            f"{role}: the tokenizer '{tokenizer_path}' has {len(tokenizer)} tokens but the model "
            f"'{model_path}' only {model.get_input_embeddings().num_embeddings} embedding rows; "
            f"set {role}.tokenizer to the model's own tokenizer"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model, tokenizer, tokenizer_path)


def num_layers(model: PreTrainedModel) -> int:
    """Transformer blocks: ``hidden_states`` indices run from 0 (embeddings) to this."""
    return model.config.get_text_config().num_hidden_layers


def hidden_size(model: PreTrainedModel) -> int:
    return model.config.get_text_config().hidden_size


@dataclass
class TeacherOutput:
    """hidden_states: ``{layer: [batch, seq, d_teacher]}`` for the layers asked for.
    logits: ``[batch, seq, vocab]`` or None when no logit loss reads them."""

    hidden_states: dict[int, torch.Tensor]
    logits: Optional[torch.Tensor]


# Where the blocks and the final norm live in the architectures mta knows; any other
# architecture runs in full (correct, just not truncated).
_BLOCKS_AND_NORM = {
    "llama": ("model.layers", "model.norm"),
    "qwen2": ("model.layers", "model.norm"),
    "mistral": ("model.layers", "model.norm"),
    "gpt2": ("transformer.h", "transformer.ln_f"),
    "opt": ("model.decoder.layers", "model.decoder.final_layer_norm"),
}


class FrozenTeacher(nn.Module):
    """The teacher in eval mode, without gradients, asked only for what the loss uses.

    layers: the ``hidden_states`` indices the alignment loss reads.
    need_logits: True when the base loss compares logits; then the whole model runs.
    Otherwise the blocks above the deepest aligned layer are dropped, and when that layer is
    below the last one the final norm is replaced by an identity: Hugging Face reports the
    last entry of ``hidden_states`` after the final norm and the others before it, and a
    truncated model must return what the full one would.
    """

    def __init__(self, model: PreTrainedModel, layers: list[int], need_logits: bool):
        super().__init__()
        model.eval().requires_grad_(False)
        self.model = model
        self.layers = sorted(set(layers))
        self.need_logits = need_logits
        self.truncated = False
        if not need_logits and self.layers:
            self.truncated = self._truncate(max(self.layers))

    def _truncate(self, deepest: int) -> bool:
        paths = _BLOCKS_AND_NORM.get(self.model.config.model_type)
        if paths is None:
            log.info("teacher architecture %s: running all layers", self.model.config.model_type)
            return False
        blocks_path, norm_path = paths
        blocks = self.model.get_submodule(blocks_path)
        if deepest < len(blocks):
            parent, _, name = norm_path.rpartition(".")
            setattr(self.model.get_submodule(parent), name, nn.Identity())
            parent, _, name = blocks_path.rpartition(".")
            setattr(self.model.get_submodule(parent), name, blocks[:deepest])
        return True

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TeacherOutput:
        """input_ids, attention_mask ``[batch, seq]`` -> the aligned layers (and logits)."""
        want_hidden = bool(self.layers)
        if self.need_logits:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=want_hidden)
            hidden, logits = out.hidden_states, out.logits
        else:
            body = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.base_model
            hidden = body(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
            logits = None
        return TeacherOutput({layer: hidden[layer] for layer in self.layers} if want_hidden else {}, logits)
