"""TALAS's objective (task: embedding): λ1·SimCSE + λ2·TAMD + λ3·LASD, as one module.

``EmbeddingDistillationModel`` holds the encoder student and the objective (whose TAMD
projections train with it), so one DeepSpeed engine owns every trainable parameter, as
``mta.training.objective.DistillationModel`` does for LLMs. The teacher is not a model here: its
sentence embedding of each row comes with the batch (``EmbeddingBatch.teacher``, stored by
``mta embed``).

Per batch (../shared/docs/TALAS.md §2-6): the student runs once with every layer's hidden
states (TAMD and LASD read this pass) and, when SimCSE is on, a second time on the same inputs
with other dropout (only its last layer is pooled). Each layer l = 1..L (``hidden_states[l]``;
index 0, the embeddings, is never used) is pooled with the student's pooling into e_l.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from mta.embedding.pooling import pool
from mta.embedding.recipe import EmbeddingLossSpec
from mta.embedding.training_data import EmbeddingBatch
from mta.errors import MtaError
from mta.losses.talas import TeacherAnchor, lasd_loss, simcse_loss


class EmbeddingObjective(nn.Module):
    """The loss components of one micro batch and their weighted total.

    num_layers: the student's L; student_dim / teacher_dim: d_S and d_T; pooling: the student's
    mode (``cls_attention``, ``mean``, ``cls``). A term whose weight is 0 is neither built nor
    computed; with LASD off only the layers the other terms read are pooled.
    """

    def __init__(self, spec: EmbeddingLossSpec, *, num_layers: int, student_dim: int, teacher_dim: int, pooling: str):
        super().__init__()
        if spec.tamd_weight and spec.tamd_layers > num_layers:
            raise MtaError(
                f"loss.tamd_layers={spec.tamd_layers} anchors more layers than the student has ({num_layers}); "
                f"use at most {num_layers}"
            )
        if spec.lasd_weight and num_layers < 2:
            raise MtaError(
                "loss.lasd_weight > 0 needs a student of at least 2 layers (LASD pairs adjacent "
                "layers); set loss.lasd_weight=0"
            )
        self.weights = {"simcse": spec.simcse_weight, "tamd": spec.tamd_weight, "lasd": spec.lasd_weight}
        self.num_layers, self.pooling = num_layers, pooling
        self.anchored = spec.tamd_layers if spec.tamd_weight else 0
        self.reference_code = spec.reference_code
        drawn_for = num_layers if spec.reference_code else None  # the author draws one per layer
        self.anchor = (
            TeacherAnchor(self.anchored, student_dim, teacher_dim, drawn_for=drawn_for) if spec.tamd_weight else None
        )
        self.temperature = spec.simcse_temperature
        self.lasd_detach, self.lasd_reduction = spec.lasd_detach, spec.lasd_reduction

    @property
    def needs_second_pass(self) -> bool:
        return bool(self.weights["simcse"])

    @property
    def pooled_layers(self) -> range:
        """The ``hidden_states`` indices pooled from the first pass (bottom to top): 1..L for LASD,
        else the top K (TAMD) or L alone (SimCSE)."""
        first = 1 if self.weights["lasd"] else self.num_layers - max(self.anchored, 1) + 1
        return range(first, self.num_layers + 1)

    def forward(
        self,
        hidden_states: tuple[torch.Tensor, ...],
        attention_mask: torch.Tensor,
        teacher: torch.Tensor,
        second_pass: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """hidden_states: the first pass's ``L + 1`` tensors ``[B, T, d_S]``; attention_mask
        ``[B, T]``; teacher ``[B, d_T]``; second_pass: the second pass's last layer ``[B, T, d_S]``
        (SimCSE). Returns fp32 scalars ``{"simcse", "tamd", "lasd", "total"}`` (the terms in use)."""
        layers = torch.stack([hidden_states[index] for index in self.pooled_layers])  # [n, B, T, d]
        n, b, t, d = layers.shape
        pooled = pool(layers.reshape(n * b, t, d), attention_mask.repeat(n, 1), self.pooling).view(n, b, d)
        losses: dict[str, torch.Tensor] = {}
        if self.weights["simcse"]:
            losses["simcse"] = simcse_loss(
                pooled[-1], pool(second_pass, attention_mask, self.pooling), self.temperature
            )
        if self.anchor is not None:
            losses["tamd"] = self.anchor(pooled[-self.anchored :], teacher)
        if self.weights["lasd"]:
            losses["lasd"] = lasd_loss(pooled, detach_upper=self.lasd_detach, reduction=self.lasd_reduction)
        losses["total"] = sum(self.weights[name] * value for name, value in losses.items())
        return losses


class EmbeddingDistillationModel(nn.Module):
    """The encoder student and the TAMD projections: everything the optimizer updates.

    The student's own pooler (BERT's dense + tanh over CLS, unused by TALAS) is frozen, so it
    stays as loaded and ``AutoModel`` still finds every weight in the exported directory.

    The terms are computed with autocast off (the student's forwards stay under the training
    autocast), as ``mta.training.objective.DistillationModel`` computes its losses, unless
    ``loss.reference_code``: the author's loop runs them under autocast. ``student_gradient_clip``
    (> 0 with ``loss.reference_code``, set by ``mta.embedding.training_run``): ASAM clips the
    student's part of its first gradient to that norm, as the optimizer's step clips the second.
    """

    def __init__(self, student: nn.Module, objective: EmbeddingObjective, *, max_seq_length: int):
        super().__init__()
        self.student = student
        self.objective = objective
        self.max_seq_length = max_seq_length
        self.student_gradient_clip = 0.0
        pooler = getattr(student, "pooler", None)
        if isinstance(pooler, nn.Module):
            pooler.requires_grad_(False)

    def forward(self, batch: EmbeddingBatch, teacher=None) -> dict[str, torch.Tensor]:
        """``teacher`` is unused (the trainer's teacher output is None): the batch carries the
        stored teacher embeddings."""
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        first = self.student(**inputs, output_hidden_states=True)
        second = self.student(**inputs).last_hidden_state if self.objective.needs_second_pass else None
        device = batch.input_ids.device.type
        terms = contextlib.nullcontext() if self.objective.reference_code else torch.autocast(device, enabled=False)
        with terms:
            return self.objective(first.hidden_states, batch.attention_mask, batch.teacher, second)

    def projector_parameters(self) -> list[nn.Parameter]:
        """TAMD's projections: the optimizer's projector_lr group."""
        return [] if self.objective.anchor is None else list(self.objective.anchor.parameters())

    def export_files(self, directory: Path) -> None:
        """The sentence-transformers files beside the exported weights (``mta.embedding.export``)."""
        from mta.embedding.export import write_sentence_transformers_files

        write_sentence_transformers_files(
            directory,
            pooling=self.objective.pooling,
            hidden=int(self.student.config.hidden_size),
            max_seq_length=self.max_seq_length,
        )
