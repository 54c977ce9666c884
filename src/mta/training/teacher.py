"""The frozen teacher, run for only what the loss reads.

``FrozenTeacher`` holds the teacher in eval mode without gradients: without a logit loss it runs
only up to the deepest aligned layer, skipping the blocks above it, the final norm and the LM head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import PreTrainedModel

log = logging.getLogger(__name__)


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
