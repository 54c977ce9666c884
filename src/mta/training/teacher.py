"""The frozen teacher, run for only what the loss reads.

``FrozenTeacher`` holds the teacher in eval mode without gradients: without a logit loss it runs
only up to the deepest aligned layer, skipping the blocks above it, the final norm and the LM head.
With FDD it keeps them and hands the loss its ``LogitLens`` (``mta.training.logit_lens``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from transformers import PreTrainedModel

from mta.losses.fused_head import HeadTeacher, OutputHead, TeacherSide
from mta.losses.teacher_sampled import SampledTeacher
from mta.training.logit_lens import BLOCKS_AND_NORM, LogitLens

log = logging.getLogger(__name__)


@dataclass
class TeacherOutput:
    """hidden_states: ``{layer: [batch, seq, d_teacher]}`` for the layers asked for.
    logits: ``[batch, seq, vocab]`` or None when no logit loss reads them (from a sampled teacher
    cache: a :class:`~mta.losses.teacher_sampled.SampledTeacher`, which the base losses read in their place).
    lens: the teacher's logit lens (``LogitLens``) when FDD reads intermediate layers, else None.
    side: on the fused path (``loss.fused_head``) what the base loss reads in place of the logits:
    the final hidden states and head (``HeadTeacher``) or the cached top k (``TopKTeacher``),
    ``[batch, seq, ...]``."""

    hidden_states: dict[int, torch.Tensor]
    logits: torch.Tensor | SampledTeacher | None
    lens: LogitLens | None = None
    attentions: dict[int, torch.Tensor] = field(default_factory=dict)  # hidden_states index -> [b, heads, t, t]
    side: TeacherSide | None = None


class TeacherForward(Protocol):
    """What gives a run the teacher's side of a micro batch: ``FrozenTeacher``, or the ZeRO-3
    engine around it (``train.teacher_zero3``)."""

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TeacherOutput: ...


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
    fused: with ``need_logits``, return the final hidden states and the head (``TeacherOutput.side``)
    instead of the logits: the fused base loss applies the head to the response positions a chunk
    at a time (``loss.fused_head``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        layers: list[int],
        need_logits: bool,
        lens: LogitLens | None = None,
        attention_layers: tuple[int, ...] = (),
        fused: bool = False,
    ):
        super().__init__()
        model.eval().requires_grad_(False)
        self.model = model
        self.fused = fused and need_logits
        self.head = OutputHead.of(model) if self.fused else None
        self.attention_layers = tuple(attention_layers)  # hidden_states indices whose block's attention is read
        self.layers = sorted(set(layers))
        self.need_logits = need_logits
        self.lens = lens  # the lens reads the head (and norm): the model is then never truncated
        self.truncated = False
        if not need_logits and lens is None and self.layers:
            self.truncated = self._truncate(max(self.layers))

    def _truncate(self, deepest: int) -> bool:
        paths = BLOCKS_AND_NORM.get(self.model.config.model_type)
        if paths is None:
            log.info("teacher architecture %s: running all layers", self.model.config.model_type)
            return False
        blocks_path, norm_path = paths
        blocks = self.model.get_submodule(blocks_path)
        assert isinstance(blocks, nn.ModuleList), f"BLOCKS_AND_NORM names {blocks_path}, a ModuleList of blocks"
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
        side: TeacherSide | None = None
        if self.head is not None:  # fused: the body; the loss applies the head where it reads it
            out = self.model.get_decoder()(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=want_hidden, **extra
            )
            hidden, logits = out.hidden_states, None
            side = HeadTeacher(out.last_hidden_state, self.head)
        elif self.need_logits:
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=want_hidden, **extra
            )
            hidden, logits = out.hidden_states, out.logits
        else:
            body = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.base_model
            out = body(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **extra)
            hidden, logits = out.hidden_states, None
        hidden_states = {layer: hidden[layer] for layer in self.layers} if want_hidden else {}
        # attentions[i] is block i's, the block that produces hidden_states[i + 1].
        attentions = {layer: out.attentions[layer - 1] for layer in self.attention_layers}
        return TeacherOutput(hidden_states, logits, self.lens, attentions, side)
