"""The training objective: base loss + λ_DSA · DSA + λ_HRA · HRA (docs/method.md §3), as one module.

``DistillationModel`` holds the student and the objective (whose projectors train with it), so
one DeepSpeed engine owns every trainable parameter; the frozen teacher stays outside.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn
from transformers import PreTrainedModel

from mta.errors import MtaError
from mta.losses.trajectory import TrajectoryAlignmentLoss
from mta.losses.contrastive import DistiLLM2Loss
from mta.losses.kd import build_base_loss
from mta.training.batching import TrainBatch
from mta.training.teacher import TeacherOutput
from mta.training.recipe import LayerPair, LossSpec

log = logging.getLogger(__name__)


class DistillationObjective(nn.Module):
    """Loss components for one micro batch, and their weighted total.

    same_tokenizer: teacher and student share a vocabulary (same fingerprint). Then the base
    loss may compare logits and HRA aligns tokens; otherwise only ``ce`` is allowed as the
    base loss and HRA aligns span representations (docs/method.md §3).
    vocab_size: the tokenizer's real vocabulary; padded embedding rows beyond it never count.
    """

    def __init__(
        self,
        spec: LossSpec,
        layer_pairs: list[LayerPair],
        *,
        student_hidden_size: int,
        teacher_hidden_size: Optional[int],
        same_tokenizer: bool,
        vocab_size: int,
    ):
        super().__init__()
        # A term whose weight is 0 is neither built nor computed.
        self.base = build_base_loss(
            spec.base, temperature=spec.temperature, skew_alpha=spec.skew_alpha, jsd_beta=spec.jsd_beta,
            distillm2_beta=spec.distillm2_beta, vocab_size=vocab_size, chunk_size=spec.chunk_size,
        ) if spec.base_weight else None
        if self.needs_teacher_logits and not same_tokenizer:
            raise MtaError(
                f"loss.base={spec.base} compares teacher and student logits, but their tokenizers "
                "differ (different vocabulary fingerprints); set loss.base=ce: across tokenizers "
                "MTA aligns spans, not tokens"
            )
        self.weights = {"base": spec.base_weight, "dsa": spec.dsa_weight, "hra": spec.hra_weight}
        self.alignment: Optional[TrajectoryAlignmentLoss] = None
        if spec.alignment_terms:
            self.alignment = TrajectoryAlignmentLoss(
                layer_pairs, student_hidden_size, teacher_hidden_size,
                same_tokenizer=same_tokenizer, importance=spec.importance, terms=spec.alignment_terms,
            )

    @property
    def needs_teacher_logits(self) -> bool:
        return self.base is not None and self.base.needs_teacher

    @property
    def student_layers(self) -> list[int]:
        return self.alignment.student_layers if self.alignment else []

    @property
    def teacher_layers(self) -> list[int]:
        return self.alignment.teacher_layers if self.alignment else []

    def forward(
        self,
        student_logits: torch.Tensor,
        student_hidden: Optional[tuple[torch.Tensor, ...]],
        teacher: Optional[TeacherOutput],
        batch: TrainBatch,
    ) -> dict[str, torch.Tensor]:
        """student_logits ``[batch, seq, vocab]``; student_hidden: HF ``hidden_states``.

        Returns fp32 scalars ``{"base", "dsa", "hra", "total"}`` (only the terms in use).
        """
        losses: dict[str, torch.Tensor] = {}
        if self.base is not None:
            # Position t predicts token t + 1: shift once here, the losses take aligned inputs.
            teacher_logits = teacher.logits[:, :-1] if teacher is not None and teacher.logits is not None else None
            pairs = {} if not isinstance(self.base, DistiLLM2Loss) else {"chosen": _pair_roles(batch)}
            losses["base"] = self.base(student_logits[:, :-1], teacher_logits, batch.student.labels[:, 1:], **pairs)
        if self.alignment is not None:
            losses.update(self.alignment(
                student_hidden, teacher.hidden_states,
                batch.student.attention_mask, batch.teacher.attention_mask, batch.spans,
            ))
        losses["total"] = sum(self.weights[name] * value for name, value in losses.items())
        return losses


def _pair_roles(batch: TrainBatch) -> torch.Tensor:
    """``[batch]`` bool, True on the teacher's responses: what loss.base=distillm2 reads."""
    if batch.chosen is None:
        raise MtaError(
            f"loss.base=distillm2 trains on pair rows (prompt, chosen, rejected), and the micro batch of "
            f"rows {batch.row_ids} has none: write pairs with `mta generate`, annotate that file and "
            "train on it"
        )
    return batch.chosen


class DistillationModel(nn.Module):
    """The student and the objective's projectors: everything the optimizer updates."""

    def __init__(self, student: PreTrainedModel, objective: DistillationObjective):
        super().__init__()
        self.student = student
        self.objective = objective

    def forward(self, batch: TrainBatch, teacher: Optional[TeacherOutput]) -> dict[str, torch.Tensor]:
        want_hidden = self.objective.alignment is not None
        out = self.student(
            input_ids=batch.student.input_ids,
            attention_mask=batch.student.attention_mask,
            output_hidden_states=want_hidden,
        )
        return self.objective(out.logits, out.hidden_states if want_hidden else None, teacher, batch)

    def projector_parameters(self) -> list[nn.Parameter]:
        alignment = self.objective.alignment
        if alignment is None or alignment.projectors is None:
            return []
        return list(alignment.projectors.parameters())
