"""The frozen teacher, run for only what the loss reads.

``FrozenTeacher`` holds the teacher in eval mode without gradients: without a logit loss it runs
only up to the deepest aligned layer, skipping the blocks above it, the final norm and the LM head.
With FDD it keeps them and hands the loss its ``LogitLens``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from mta.errors import MtaError

log = logging.getLogger(__name__)


@dataclass
class TeacherOutput:
    """hidden_states: ``{layer: [batch, seq, d_teacher]}`` for the layers asked for.
    logits: ``[batch, seq, vocab]`` or None when no logit loss reads them.
    lens: the teacher's logit lens (``LogitLens``) when FDD reads intermediate layers, else None."""

    hidden_states: dict[int, torch.Tensor]
    logits: Optional[torch.Tensor]
    lens: Optional["LogitLens"] = None
    attentions: dict[int, torch.Tensor] = field(default_factory=dict)  # hidden_states index -> [b, heads, t, t]


# Where the blocks and the final norm live in the architectures mta knows; any other
# architecture runs in full (correct, just not truncated).
_BLOCKS_AND_NORM = {
    "llama": ("model.layers", "model.norm"),
    "qwen2": ("model.layers", "model.norm"),
    "mistral": ("model.layers", "model.norm"),
    "gpt2": ("transformer.h", "transformer.ln_f"),
    "opt": ("model.decoder.layers", "model.decoder.final_layer_norm"),
}


def final_norm(model: PreTrainedModel) -> Optional[nn.Module]:
    """The norm a model applies after its last block (before the LM head), or None for an
    architecture mta does not know."""
    paths = _BLOCKS_AND_NORM.get(model.config.model_type)
    return model.get_submodule(paths[1]) if paths is not None else None


class LogitLens:
    """A model's LM head read on intermediate hidden states (FDD's "logit lens").

    ``states(hidden_states, layers)``: the entries ``layers`` of a model's ``hidden_states``, each
    ``[batch, seq, d]``, ready for the head: with ``final_norm`` the model's final norm applied,
    except on the last layer, whose entry Hugging Face already reports after that norm.
    ``lens(hidden)``: ``[n, d]`` -> logits ``[n, vocab rows]``. The modules are called as modules,
    so DeepSpeed ZeRO-3 gathers their weights.
    """

    def __init__(self, model: PreTrainedModel, *, final_norm: bool, num_layers: int):
        self.head = model.get_output_embeddings()
        self.norm = _final_norm_or_refuse(model) if final_norm else None
        self.num_layers = num_layers

    def states(self, hidden_states, layers: list[int]) -> list[torch.Tensor]:
        return [
            self.norm(hidden_states[layer]) if self.norm is not None and layer < self.num_layers
            else hidden_states[layer]
            for layer in layers
        ]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def for_layer(self, layer: int) -> Callable[..., torch.Tensor]:
        """``lens(hidden, vocab_rows=None)``: hidden ``[n, d]`` of ``hidden_states`` index ``layer``
        (or a mean of such states, e.g. SRA's span centres), the norm applied as ``states`` applies
        it, -> logits ``[n, vocab rows]``, or ``[n, k]`` over the rows ``vocab_rows`` ``[k]`` only,
        in that order. Those rows of the head are gathered before the product, so the columns
        nobody reads are never computed; under ZeRO-3, whose head holds a shard outside its own
        forward, the whole head runs and the columns are selected."""
        norm = self.norm if self.norm is not None and layer < self.num_layers else None
        head = self.head

        def lens(hidden: torch.Tensor, vocab_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
            if norm is not None:
                hidden = norm(hidden)
            if vocab_rows is None:
                return head(hidden)
            if is_zero3_partitioned(head.weight):
                return head(hidden).index_select(-1, vocab_rows)
            bias = None if head.bias is None else head.bias.index_select(0, vocab_rows)
            # index_select, not advanced indexing: its backward is an index_add, not an index_put.
            return F.linear(hidden, head.weight.index_select(0, vocab_rows), bias)

        return lens


def is_zero3_partitioned(parameter: torch.Tensor) -> bool:
    """True for a parameter DeepSpeed ZeRO-3 partitions (its data is a shard between forwards)."""
    return hasattr(parameter, "ds_id")


def _final_norm_or_refuse(model: PreTrainedModel) -> nn.Module:
    norm = final_norm(model)
    if norm is None:
        raise MtaError(
            f"loss.fdd_final_norm=true: mta does not know where a {model.config.model_type} model keeps its "
            f"final norm (it knows {', '.join(sorted(_BLOCKS_AND_NORM))}); use loss.fdd_final_norm=false"
        )
    return norm


class FrozenTeacher(nn.Module):
    """The teacher in eval mode, without gradients, asked only for what the loss uses.

    layers: the ``hidden_states`` indices the alignment loss reads.
    need_logits: True when the base loss compares logits; then the whole model runs.
    Otherwise the blocks above the deepest aligned layer are dropped, and when that layer is
    below the last one the final norm is replaced by an identity: Hugging Face reports the
    last entry of ``hidden_states`` after the final norm and the others before it, and a
    truncated model must return what the full one would.
    lens: FDD's / SRA's logit lens: the blocks, final norm and head are kept (the lens applies the
    head itself, to what it needs), but without ``need_logits`` no logits are computed.
    """

    def __init__(self, model: PreTrainedModel, layers: list[int], need_logits: bool,
                 lens: Optional[LogitLens] = None, attention_layers: tuple[int, ...] = ()):
        super().__init__()
        model.eval().requires_grad_(False)
        self.model = model
        self.attention_layers = tuple(attention_layers)  # hidden_states indices whose block's attention is read
        self.layers = sorted(set(layers))
        self.need_logits = need_logits
        self.lens = lens  # the lens reads the head (and norm): the model is then never truncated
        self.truncated = False
        if not need_logits and lens is None and self.layers:
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
        extra = {"output_attentions": True} if self.attention_layers else {}
        if self.need_logits:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=want_hidden,
                             **extra)
            hidden, logits = out.hidden_states, out.logits
        else:
            body = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.base_model
            out = body(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **extra)
            hidden, logits = out.hidden_states, None
        hidden_states = {layer: hidden[layer] for layer in self.layers} if want_hidden else {}
        # attentions[i] is block i's, the block that produces hidden_states[i + 1].
        attentions = {layer: out.attentions[layer - 1] for layer in self.attention_layers}
        return TeacherOutput(hidden_states, logits, self.lens, attentions)
