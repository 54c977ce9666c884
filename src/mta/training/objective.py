"""The training objective: base loss + λ_DSA · DSA + λ_HRA · HRA (docs/method.md §3) + λ_FDD · FDD, as one module.

``DistillationModel`` holds the student and the objective (whose projectors train with it), so
one DeepSpeed engine owns every trainable parameter; the frozen teacher stays outside.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import PreTrainedModel

from mta.errors import MtaError
from mta.losses.contrastive import DistiLLM2Loss
from mta.losses.fdd import FeatureDynamicsLoss
from mta.losses.fused_head import (
    HeadTeacher,
    LogitsTeacher,
    OutputHead,
    TeacherSide,
    gathered,
    is_zero3_partitioned,
)
from mta.losses.importance import token_importance
from mta.losses.kd import BaseLoss, build_base_loss
from mta.losses.sra import SpanRepresentationLoss, last_token_attention
from mta.losses.teacher_sampled import SampledTeacher
from mta.losses.trajectory import HiddenStates, TrajectoryAlignmentLoss
from mta.training.batching import BOUNDARY, TrainBatch
from mta.training.config.schema import LayerIndexPair, LayerPair, LossSpec
from mta.training.logit_lens import LogitLens
from mta.training.teacher import TeacherOutput

log = logging.getLogger(__name__)

T = TypeVar("T")


class DistillationObjective(nn.Module):
    """Loss components for one micro batch, and their weighted total.

    same_tokenizer: teacher and student share a vocabulary (same fingerprint). Then the base
    loss may compare logits and HRA aligns tokens; otherwise the base loss is ``ce``, or ``uld`` /
    ``gold`` on the aligned units (docs/method.md §5b), and HRA aligns span representations (§3).
    vocab_size: the tokenizer's real vocabulary; padded embedding rows beyond it never count.
    teacher_vocab_size: the teacher tokenizer's (``uld``, ``gold``); shared_vocab: SRA's logit
    term's and ``gold``'s shared vocabulary. partitioned_heads: ZeRO-3 partitions an LM head, so
    SRA's span-logit term applies each head once per micro batch instead of a chunk at a time.
    fused_head: the base loss from hidden states and heads (default ``spec.uses_fused_head``; a
    run passes ``Recipe.fused_head_runs``).
    """

    def __init__(
        self,
        spec: LossSpec,
        layer_pairs: list[LayerPair],
        *,
        student_hidden_size: int,
        teacher_hidden_size: int | None,
        same_tokenizer: bool,
        vocab_size: int,
        fdd_pairs: Sequence[LayerIndexPair] = (),
        sra_pairs: Sequence[LayerIndexPair] = (),
        shared_vocab: tuple[torch.Tensor, torch.Tensor] | None = None,
        teacher_vocab_size: int | None = None,
        partitioned_heads: bool = False,
        fused_head: bool | None = None,
    ):
        super().__init__()
        # The base loss from hidden states and heads, a chunk of response positions at a time
        # (mta.losses.fused_head), instead of from the models' whole logits.
        self.fused_head = spec.uses_fused_head if fused_head is None else fused_head
        # A term whose weight is 0 is neither built nor computed.
        self.base = (
            build_base_loss(
                spec.base,
                temperature=spec.temperature,
                skew_alpha=spec.skew_alpha,
                jsd_beta=spec.jsd_beta,
                distillm2_beta=spec.distillm2_beta,
                vocab_size=vocab_size,
                chunk_size=spec.chunk_size,
                teacher_vocab_size=teacher_vocab_size,
                uld_weight=spec.uld_weight,
                uld_ce_weight=spec.uld_ce_weight,
                shared_kl_weight=spec.shared_kl_weight,
                shared_divergence=spec.shared_divergence,
                shared_vocab=shared_vocab if spec.base == "gold" else None,
            )
            if spec.base_weight
            else None
        )
        if self.needs_teacher_logits and not same_tokenizer and not self.needs_units:
            raise MtaError(
                f"loss.base={spec.base} compares teacher and student logits, but their tokenizers "
                "differ (different vocabulary fingerprints); set loss.base=ce, or uld / gold, which "
                "compare them on the units both tokenisations agree on: across tokenizers "
                "MTA aligns spans, not tokens"
            )
        self.weights = {
            "base": spec.base_weight,
            "dsa": spec.dsa_weight,
            "hra": spec.hra_weight,
            "fdd": spec.fdd_weight,
        }
        self.fdd: FeatureDynamicsLoss | None = None
        self.fdd_pairs = list(fdd_pairs) if spec.fdd_weight else []
        self.fdd_tokens = spec.fdd_tokens
        if spec.fdd_weight:
            if not same_tokenizer:
                raise MtaError(
                    "loss.fdd_weight > 0 compares teacher and student next-token distributions at "
                    "intermediate layers, but their tokenizers differ; set loss.fdd_weight=0"
                )
            if not self.fdd_pairs:
                raise MtaError("loss.fdd_weight > 0 needs at least one loss.fdd_layers pair")
            self.fdd = FeatureDynamicsLoss(
                temperature=spec.fdd_temperature, vocab_size=vocab_size, chunk_size=spec.chunk_size
            )
        self.weights["sra"] = spec.sra_weight
        self.sra: SpanRepresentationLoss | None = None
        self.sra_pairs = list(sra_pairs) if spec.sra_weight else []
        self.sra_centre, self.sra_scope = spec.sra_centre, spec.sra_scope
        self.sra_logits = bool(spec.sra_weight and spec.sra_logit_weight and shared_vocab is not None)
        if spec.sra_weight:
            if not self.sra_pairs:
                raise MtaError("loss.sra_weight > 0 needs at least one loss.sra_layers pair")
            self.sra = SpanRepresentationLoss(
                len(self.sra_pairs),
                student_hidden_size,
                _required(teacher_hidden_size, "loss.sra_weight > 0: the teacher's hidden size"),
                geometry_weight=spec.sra_geometry_weight,
                logit_weight=spec.sra_logit_weight if self.sra_logits else 0.0,
                temperature=spec.temperature,
                # ZeRO-3: one application of each (gathered) head per micro batch on every process.
                chunk_size=None if partitioned_heads else spec.chunk_size,
            )
            if self.sra_logits and shared_vocab is not None:  # buffers: they move to the device with the module
                self.register_buffer("sra_student_ids", shared_vocab[0].long(), persistent=False)
                self.register_buffer("sra_teacher_ids", shared_vocab[1].long(), persistent=False)
        self.trajectory: TrajectoryAlignmentLoss | None = None
        if spec.trajectory_terms:
            self.trajectory = TrajectoryAlignmentLoss(
                layer_pairs,
                student_hidden_size,
                _required(teacher_hidden_size, "loss.dsa_weight / loss.hra_weight > 0: the teacher's hidden size"),
                same_tokenizer=same_tokenizer,
                importance=spec.importance,
                terms=spec.trajectory_terms,
                reference_code=spec.reference_code,
            )
        self.register_load_state_dict_pre_hook(_renamed_trajectory_keys)

    @property
    def needs_teacher_logits(self) -> bool:
        return self.base is not None and bool(self.base.needs_teacher)

    @property
    def needs_units(self) -> bool:
        """The base loss compares logits on aligned units (``uld``, ``gold``): it reads the
        batch's boundary spans."""
        return bool(getattr(self.base, "needs_units", False))

    @property
    def student_layers(self) -> list[int]:
        return self.trajectory.student_layers if self.trajectory else []

    @property
    def teacher_layers(self) -> list[int]:
        """The teacher ``hidden_states`` entries the loss reads (MTA's pairs and FDD's)."""
        aligned = self.trajectory.teacher_layers if self.trajectory else []
        return sorted({*aligned, *(pair.teacher for pair in (*self.fdd_pairs, *self.sra_pairs))})

    @property
    def needs_student_hidden(self) -> bool:
        return self.trajectory is not None or self.fdd is not None or self.sra is not None

    @property
    def attention_layers(self) -> dict[str, tuple[int, ...]]:
        """The ``hidden_states`` indices whose block attention the loss reads, per side (SRA's
        last-token-attention centres: the last pair's)."""
        if self.sra is None or self.sra_centre != "last_token_attention":
            return {"student": (), "teacher": ()}
        return {"student": (self.sra_pairs[-1].student,), "teacher": (self.sra_pairs[-1].teacher,)}

    def counts(self, batch: TrainBatch) -> dict[str, float]:
        """What each term of ``batch`` averages over, counted from its labels and masks (no
        forward): ``tokens`` (the base loss's response targets), ``sequences`` (rows: DSA, HRA,
        SRA, DistiLLM-2's pairs are half of them) and ``fdd_positions``. Summed over an
        accumulation window and the ranks, they are ``forward``'s ``divisors`` under
        ``train.loss_reduction: global`` (docs/method.md §5)."""
        labels = batch.student.labels
        counts = {"tokens": float((labels[:, 1:] != -100).sum()), "sequences": float(labels.shape[0])}
        if self.fdd is not None:
            counts["fdd_positions"] = float(self._fdd_positions(batch).sum())
        return counts

    def forward(
        self,
        student_logits: torch.Tensor | None,
        student_hidden: tuple[torch.Tensor, ...] | None,
        teacher: TeacherOutput | None,
        batch: TrainBatch,
        student_lens: LogitLens | None = None,
        student_attentions: tuple[torch.Tensor, ...] | None = None,
        student_final: tuple[torch.Tensor, OutputHead] | None = None,
        divisors: Mapping[str, float] | None = None,
    ) -> dict[str, torch.Tensor]:
        """student_logits ``[batch, seq, vocab]`` (None on the fused path); student_hidden: HF
        ``hidden_states``; student_lens: the student's logit lens (FDD only); student_final: the
        fused path's ``(final hidden state [batch, seq, d], LM head)`` of the student, whose
        ``teacher.side`` is the teacher's (``mta.losses.fused_head``). divisors: None, each term
        the mean over this micro batch (``loss_reduction: micro_batch``); or ``{"tokens",
        "sequences", "fdd_positions"}`` as ``counts`` names them, each term then the sum over this
        micro batch divided by its divisor (``global``: micro batches add up to the window's mean;
        uld and gold, whose aligned units are not counted, stay the micro batch's mean).

        Returns fp32 scalars ``{"base", "dsa", "hra", "fdd", "total"}`` (only the terms in use).
        """
        losses: dict[str, torch.Tensor] = {}
        share = divisors or {}
        if self.base is not None:
            losses["base"] = self._base(student_logits, student_final, teacher, batch, share)
        if self.trajectory is not None:
            losses.update(
                self.trajectory(
                    _required(student_hidden, "the student's hidden states"),
                    _required(teacher, "the teacher's output").hidden_states,
                    batch.student.attention_mask,
                    _required(batch.teacher, "the batch's teacher tokens").attention_mask,
                    batch.spans,
                    share.get("sequences"),
                )
            )
        if self.fdd is not None:
            hidden = _required(student_hidden, "the student's hidden states")
            teacher_out = _required(teacher, "the teacher's output")
            lens = _required(student_lens, "the student's logit lens")
            teacher_lens = _required(teacher_out.lens, "the teacher's logit lens")
            losses["fdd"] = self.fdd(
                lens.states(hidden, [pair.student for pair in self.fdd_pairs]),
                teacher_lens.states(teacher_out.hidden_states, [pair.teacher for pair in self.fdd_pairs]),
                lens,
                teacher_lens,
                self._fdd_positions(batch),
                share.get("fdd_positions"),
            )["fdd"]
        if self.sra is not None:
            losses["sra"] = self._sra(
                self.sra,
                _required(student_hidden, "the student's hidden states"),
                student_attentions,
                _required(teacher, "the teacher's output"),
                batch,
                student_lens,
                share.get("sequences"),
            )
        losses["total"] = functools.reduce(operator.add, (self.weights[name] * value for name, value in losses.items()))
        return losses

    def _base(
        self,
        student_logits: torch.Tensor | None,
        student_final: tuple[torch.Tensor, OutputHead] | None,
        teacher: TeacherOutput | None,
        batch: TrainBatch,
        share: Mapping[str, float],
    ) -> torch.Tensor:
        """The base loss, from the whole logits or (``student_final``) a chunk at a time: the mean
        over the micro batch's response tokens (DistiLLM-2: its per-row means), or the sum over
        ``share["tokens"]`` (DistiLLM-2: the row means over ``share["sequences"] / 2`` pairs)."""
        assert self.base is not None, "the base term is computed only when it is built"
        # Position t predicts token t + 1: shift once here, the losses take aligned inputs.
        labels = batch.student.labels[:, 1:]
        if isinstance(self.base, DistiLLM2Loss):  # pairs: half the rows
            sequences = share.get("sequences")
            pairs: dict[str, Any] = {
                "chosen": _pair_roles(batch, self.training),
                "num_pairs": None if sequences is None else sequences / 2,
            }
            tokens = None
        else:
            pairs, tokens = {}, share.get("tokens")
        if self.needs_units:  # across vocabularies: unshifted, each side's own tokens, the aligned units
            return self.base(
                _required(student_logits, "the student's logits"),
                _required(teacher, "the teacher's output").logits,
                batch.student.labels,
                _required(batch.teacher, "the batch's teacher tokens").labels,
                batch.spans[BOUNDARY],
            )
        if student_final is None:
            logits = _required(student_logits, "the student's logits")
            teacher_logits = teacher.logits[:, :-1] if teacher is not None and teacher.logits is not None else None
            extra = pairs if pairs else {"num_items_in_batch": tokens}
            return self.base(logits[:, :-1], teacher_logits, labels, **extra)
        hidden, head = student_final
        assert isinstance(self.base, BaseLoss | DistiLLM2Loss), "build_base_loss builds these"
        # The teacher's side is read at the selected [batch, seq - 1] positions of its [batch, seq] layout.
        side: TeacherSide | None = None
        if teacher is not None:  # a teacher that gave its whole logits: their response rows are read
            if isinstance(teacher.logits, SampledTeacher):
                raise MtaError("a sampled teacher cache feeds the base loss whole logits (Recipe.fused_head_runs)")
            side = teacher.side if teacher.side is not None or teacher.logits is None else LogitsTeacher(teacher.logits)
        if side is None and self.base.needs_teacher:
            raise MtaError(
                "the fused base loss reads the teacher's side (its final hidden states and head, its top k, "
                "or its logits)"
            )
        # A ZeRO-3 teacher's head: whole for the fused loss, once per step (it takes no gradient).
        with gathered(side.head) if isinstance(side, HeadTeacher) else contextlib.nullcontext():
            reduced = self.base.from_hidden(hidden[:, :-1], head, side, labels, **pairs)
        return reduced.mean if tokens is None else reduced.total / tokens

    def _sra(
        self,
        sra: SpanRepresentationLoss,
        student_hidden: HiddenStates,
        student_attentions: Sequence[torch.Tensor] | None,
        teacher: TeacherOutput,
        batch: TrainBatch,
        student_lens: LogitLens | None,
        num_sequences: float | None = None,
    ) -> torch.Tensor:
        """SRA on the spans both tokenizers agree on (``batch.spans["boundary"]``)."""
        spans = batch.spans["boundary"]
        last = self.sra_pairs[-1]
        teacher_mask = _required(batch.teacher, "the batch's teacher tokens").attention_mask
        if self.sra_centre == "importance":
            student_weights = token_importance(student_hidden[last.student], batch.student.attention_mask)
            teacher_weights = token_importance(teacher.hidden_states[last.teacher], teacher_mask)
        else:  # attentions[i] is block i's, which produces hidden_states[i + 1]
            attentions = _required(student_attentions, "the student's attentions")
            student_weights = last_token_attention(attentions[last.student - 1], batch.student.attention_mask)
            teacher_weights = last_token_attention(teacher.attentions[last.teacher], teacher_mask)
        if self.sra_scope == "response":  # a span whose first student token is a target
            labels = batch.student.labels
            first = spans.student_start.clamp(max=labels.shape[1] - 1)
            scope = labels.gather(1, first) != -100
        else:
            scope = spans.mask.bool()
        heads: dict[str, Any] = {}
        if self.sra_logits:
            heads = dict(
                student_head=_required(student_lens, "the student's logit lens").for_layer(last.student),
                teacher_head=_required(teacher.lens, "the teacher's logit lens").for_layer(last.teacher),
                shared_vocab=(self.sra_student_ids, self.sra_teacher_ids),
            )
        return sra(
            [student_hidden[pair.student] for pair in self.sra_pairs],
            [teacher.hidden_states[pair.teacher] for pair in self.sra_pairs],
            student_weights,
            teacher_weights,
            spans,
            scope,
            **heads,
            num_sequences=num_sequences,
        )["sra"]

    def _fdd_positions(self, batch: TrainBatch) -> torch.Tensor:
        """``[batch, seq]`` bool: every real token (``fdd_tokens: all``, the authors') or the
        positions that predict a response token (``response``)."""
        if self.fdd_tokens == "all":
            return batch.student.attention_mask.bool()
        predicts = torch.zeros_like(batch.student.attention_mask, dtype=torch.bool)
        predicts[:, :-1] = batch.student.labels[:, 1:] != -100
        return predicts


def _required(value: T | None, what: str) -> T:
    """``value``, which a loss term in use reads; ``MtaError`` naming ``what`` when it was not given."""
    if value is None:
        raise MtaError(f"the objective's loss terms read {what}, which was not given")
    return value


def _pair_roles(batch: TrainBatch, training: bool) -> torch.Tensor:
    """``[batch]`` bool, True on the teacher's responses: what loss.base=distillm2 reads.

    Training needs pair rows. A dev set need not hold pairs (the published dev set is Dolly's):
    in eval mode a row that is no pair half is read as chosen, its reference response scored by
    the skew KL towards the teacher, as the teacher's own responses are."""
    if batch.chosen is None and not training:
        return torch.ones(len(batch.row_ids), dtype=torch.bool, device=batch.student.input_ids.device)
    if batch.chosen is None:
        raise MtaError(
            f"loss.base=distillm2 trains on pair rows (prompt, chosen, rejected), and the micro batch of "
            f"rows {batch.row_ids} has none: write pairs with `mta generate`, annotate that file and "
            "train on it"
        )
    return batch.chosen


class DistillationModel(nn.Module):
    """The student and the objective's projectors: everything the optimizer updates."""

    def __init__(self, student: PreTrainedModel, objective: DistillationObjective, *, fdd_final_norm: bool = False):
        super().__init__()
        self.student = student
        self.objective = objective
        # FDD reads the lens at intermediate layers as the recipe says; SRA's logit term applies
        # the final norm and head to span centres.
        self.lens = (
            LogitLens(
                student, final_norm=fdd_final_norm or objective.fdd is None, num_layers=student.config.num_hidden_layers
            )
            if objective.fdd is not None or objective.sra_logits
            else None
        )

    def forward(
        self, batch: TrainBatch, teacher: TeacherOutput | None, divisors: Mapping[str, float] | None = None
    ) -> dict[str, torch.Tensor]:
        """The objective's losses on ``batch`` (``divisors``: see ``DistillationObjective.forward``)."""
        want_hidden = self.objective.needs_student_hidden
        want_attentions = bool(self.objective.attention_layers["student"])
        fused = self.objective.fused_head
        # Fused: the student's body only; its head is applied by the base loss to the response
        # positions, a chunk at a time. Otherwise the whole model and its [batch, seq, vocab] logits.
        model = self.student.get_decoder() if fused else self.student
        out = model(
            input_ids=batch.student.input_ids,
            attention_mask=batch.student.attention_mask,
            output_hidden_states=want_hidden,
            **({"output_attentions": True} if want_attentions else {}),
        )
        final = (out.last_hidden_state, OutputHead.of(self.student)) if fused and self.objective.base else None
        # The losses compute in fp32 from the dtypes the models give; under a CPU bf16 run's
        # autocast (mta.training.engine.TrainingPrecision) their products would run in bf16.
        with torch.autocast(batch.student.input_ids.device.type, enabled=False):
            return self.objective(
                None if fused else out.logits,
                out.hidden_states if want_hidden else None,
                teacher,
                batch,
                self.lens,
                out.attentions if want_attentions else None,
                student_final=final,
                divisors=divisors,
            )

    def register_partitioned_head(self) -> None:
        """Under ZeRO-3 (after DeepSpeed partitioned the weights): the student's head weight, read by
        the fused base loss outside the head's own forward, is gathered for this module's forward
        and backward, once per step each (``deepspeed.zero.register_external_parameter``), not per
        chunk: one all-gather of the head instead of two per chunk. A no-op otherwise."""
        if not self.objective.fused_head:
            return
        head = OutputHead.of(self.student)
        partitioned = [p for p in (head.weight, head.bias) if p is not None and is_zero3_partitioned(p)]
        if partitioned:
            import deepspeed

            for parameter in partitioned:
                deepspeed.zero.register_external_parameter(self, parameter)

    def projector_parameters(self) -> list[nn.Parameter]:
        """The projectors (MTA's HRA, SRA's span projectors): the optimizer's projector_lr group."""
        alignment, sra = self.objective.trajectory, self.objective.sra
        found = [] if alignment is None or alignment.projectors is None else list(alignment.projectors.parameters())
        return found + ([] if sra is None else list(sra.projectors.parameters()))


OLD_TRAJECTORY_PREFIX = "alignment."  # the projectors' state-dict prefix before 0.3.0 (checkpoints of 0.2.0)


def _renamed_trajectory_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """A 0.2.0 checkpoint's ``objective.alignment.*`` keys loaded as ``objective.trajectory.*``."""
    old = prefix + OLD_TRAJECTORY_PREFIX
    for key in [key for key in state_dict if key.startswith(old)]:
        state_dict[prefix + "trajectory." + key[len(old) :]] = state_dict.pop(key)
