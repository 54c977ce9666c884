"""A model's LM head read on intermediate hidden states (the "logit lens"), for either model.

``LogitLens`` serves FDD (each model's intermediate layers through its own final norm and head)
and SRA's logit term (span centres through the head, at the shared vocabulary's rows only); the
student's lens is built by ``objective.DistillationModel``, the teacher's is handed to the loss
by ``teacher.FrozenTeacher``. ``BLOCKS_AND_NORM`` says where the architectures mta knows keep
their blocks and final norm (``final_norm``; the teacher's truncation reads it too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from mta.errors import MtaError
from mta.losses.fused_head import is_zero3_partitioned
from mta.losses.trajectory import HiddenStates

# Where the blocks and the final norm live in the architectures mta knows; a teacher of any
# other architecture runs in full (correct, just not truncated: teacher.FrozenTeacher).
BLOCKS_AND_NORM = {
    "llama": ("model.layers", "model.norm"),
    "qwen2": ("model.layers", "model.norm"),
    "mistral": ("model.layers", "model.norm"),
    "gpt2": ("transformer.h", "transformer.ln_f"),
    "opt": ("model.decoder.layers", "model.decoder.final_layer_norm"),
}


def final_norm(model: PreTrainedModel) -> nn.Module | None:
    """The norm a model applies after its last block (before the LM head), or None for an
    architecture mta does not know."""
    paths = BLOCKS_AND_NORM.get(model.config.model_type)
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

    def states(self, hidden_states: HiddenStates, layers: list[int]) -> list[torch.Tensor]:
        return [
            self.norm(hidden_states[layer])
            if self.norm is not None and layer < self.num_layers
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

        def lens(hidden: torch.Tensor, vocab_rows: torch.Tensor | None = None) -> torch.Tensor:
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


def _final_norm_or_refuse(model: PreTrainedModel) -> nn.Module:
    norm = final_norm(model)
    if norm is None:
        raise MtaError(
            f"loss.fdd_final_norm=true: mta does not know where a {model.config.model_type} model keeps its "
            f"final norm (it knows {', '.join(sorted(BLOCKS_AND_NORM))}); use loss.fdd_final_norm=false"
        )
    return norm
