"""The public Python API: MTA as a loss any training loop can call. Its names are ``mta.__all__``,
each described in docs/python-api.md. Everything here wraps the code the pipeline runs, so a custom
loop computes what ``mta distill`` computes; the losses take model outputs in the Hugging Face
convention (unshifted logits and labels, ``-100`` ignored), the shifted form an option.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pydantic
import torch
from torch import nn
from transformers import PreTrainedModel

# The names of mta.__all__ are re-exported from here ("X as X"); the rest is private to the API.
from mta.data.annotate import CHUNK_ROWS, AnnotateSettings, build_annotator, example_chunks, map_chunks, run_annotate
from mta.data.artefact_schema import INPUT_IDS, SCHEMA, SPAN_COLUMNS
from mta.data.example_annotator import ChunkResult
from mta.data.example_annotator import GeneratedRow as GeneratedRow
from mta.data.online_spans import SpanParser as SpanParser
from mta.data.online_spans import load_sides, merge_results, online_annotator
from mta.data.prompts import prompt_style
from mta.data.rows import Example, RowProblem, is_pair_record, map_fields, record_rows
from mta.data.sources import HubDataset as HubDataset
from mta.data.span_extraction import resolve_spacy_model
from mta.deprecation import renamed_attribute
from mta.errors import MtaError
from mta.inspection import LinearCKA as LinearCKA
from mta.inspection import inspect as inspect
from mta.losses.contrastive import DistiLLM2Loss
from mta.losses.fused_head import HeadTeacher, LogitsTeacher, OutputHead, TeacherSide
from mta.losses.kd import IGNORE_INDEX, UNIT_LOSSES, build_base_loss
from mta.losses.span_masks import SpanBatch
from mta.training.batching import AnnotatedExamples, TrainBatch
from mta.training.batching import TokenBatch as TokenBatch
from mta.training.config.layers import resolve_layer_map
from mta.training.config.schema import LayerPair, LossSpec
from mta.training.model_loading import hidden_size, num_layers
from mta.training.objective import DistillationObjective
from mta.training.teacher import TeacherOutput

# The recipe's loss defaults (LossSpec), the one place KDLoss's and MTALoss's keyword defaults come from.
_LOSS_DEFAULTS = LossSpec()

# Why a Hugging Face Trainer's rows reach the collator without their columns.
TRAINER_COLUMNS = (
    "it removes the dataset columns the model's forward does not take before the collator sees "
    "them: TrainingArguments(remove_unused_columns=False) keeps them"
)
HF_CONVENTION = (
    "the Hugging Face convention: logits [B, T, V] as the model returns them and labels [B, T] "
    "(input ids, -100 where no loss), position t predicting label t + 1"
)
SHIFTED_CONVENTION = (
    "labels_shifted=True: logits [B, T-1, V] and labels [B, T-1] already aligned (logits[:, :-1] with "
    "labels[:, 1:]), position t predicting label t"
)


# --------------------------------------------------------------------------- rows


class Annotator:
    """In-memory rows -> the rows ``mta annotate`` writes for them, with the same spans and token
    ranges: the same row formats, prompt template, length limits, spaCy phrases and word spans.

    settings: tokenizers (hub names or directories; one or two), lengths and span options,
    as for ``mta annotate``. The tokenizers and spaCy are loaded here, once.
    """

    def __init__(self, settings: AnnotateSettings) -> None:
        self.settings = settings
        self._sides = load_sides(settings)
        self._annotator = online_annotator(settings, *self._sides)
        # One text for both sides: a chat prompt is rendered with the student's template.
        self._style = prompt_style(settings.template, settings.student, rendered_by="student")

    def annotate(self, rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The annotate rows of ``rows`` (dicts in any format ``mta annotate`` reads), in order:
        dicts with the artefact's columns (``id`` = the row's position; a pair row gives two
        rows). A row ``mta annotate`` would skip (a prompt over the limit; a malformed row with
        ``on_error="skip"``) is left out; a malformed row with ``on_error="fail"`` is an error."""
        return self._annotate(rows).batch.to_pylist()

    def _annotate(self, rows: Iterable[Mapping[str, Any]]) -> ChunkResult:
        fields = dict(self.settings.fields)
        records = [
            (index, map_fields(dict(row) if isinstance(row, Mapping) else row, fields))
            for index, row in enumerate(rows)
        ]
        if not records:
            return merge_results([])
        examples: list[Example] = []
        for row in record_rows(records, pairs=is_pair_record(records[0][1]), style=self._style):
            if isinstance(row, RowProblem):
                if self.settings.on_error == "fail":
                    raise MtaError(f"row {row.line}: {row.message} (fix the row, or use on_error='skip')")
                continue
            examples.append(row)
        chunks = list(example_chunks(examples, CHUNK_ROWS))
        workers = min(self.settings.worker_count, len(chunks))
        if workers <= 1:
            return merge_results([self._annotator.annotate(chunk) for chunk in chunks])
        spacy_name = resolve_spacy_model(self.settings.spacy_model)[0]
        build = functools.partial(build_annotator, self.settings, *self._sides, spacy_name)  # as annotate's pool
        return merge_results(list(map_chunks(build, iter(chunks), workers)))


def annotate(data: Any, out_dir: str | Path, settings: AnnotateSettings, *, force: bool = False) -> Path:
    """Annotate ``data`` into the directory ``out_dir`` as ``mta annotate`` does, and return it.

    data: a path (JSONL, Parquet, CSV, a save_to_disk directory), a :class:`HubDataset` (one split
    of a Hub dataset at one commit, through the Hugging Face cache), or an in-memory
    ``datasets.Dataset`` (keyed on its rows' content). An artefact of the same input and settings
    already there is reused unless ``force``."""
    return run_annotate(data, out_dir, settings, force=force).directory


class Collator:
    """Rows -> the :class:`TrainBatch` the losses read: right-padded ids, attention masks, labels in
    the Hugging Face convention (the ids on response tokens, -100 on the prompt and padding,
    unshifted), and the spans of each granularity as token ranges (:class:`SpanBatch`).

    rows: annotate rows (from :meth:`Annotator.annotate`, :class:`SpanParser`, or an ``mta annotate``
    directory's table), or raw rows when ``annotator`` is given (annotated at each call).
    student_pad_id / teacher_pad_id: the id written into padding (masked out everywhere).
    granularities: the span kinds to gather (``MTALoss.granularities``); with_teacher: False
    when no teacher reads the batch; boundary: also gather SRA's ``boundary_spans``.
    Pair rows (``pair_id``, ``role``: DistiLLM-2) set ``batch.chosen``, chosen row first.
    """

    def __init__(
        self,
        *,
        student_pad_id: int = 0,
        teacher_pad_id: int = 0,
        annotator: Annotator | None = None,
        granularities: Sequence[str] = ("word", "phrase"),
        with_teacher: bool = True,
        boundary: bool = False,
    ) -> None:
        unknown = [name for name in granularities if name not in SPAN_COLUMNS]
        if isinstance(granularities, str) or unknown:
            raise MtaError(
                f"Collator(granularities={granularities!r}): the span kinds are {', '.join(map(repr, SPAN_COLUMNS))} "
                "(a tuple of them; SRA's boundary spans: boundary=True); pass MTALoss.granularities, "
                "or () for a base loss alone"
            )
        self.student_pad_id = student_pad_id
        self.teacher_pad_id = teacher_pad_id
        self.annotator = annotator
        self.granularities = tuple(granularities)
        self.with_teacher = with_teacher
        self.boundary = boundary

    def __call__(self, rows: Sequence[Mapping[str, Any]] | pa.Table | pa.RecordBatch) -> TrainBatch:
        table = self._table(rows)
        if table.num_rows == 0:
            raise MtaError("the batch has no rows (the annotator may have skipped every one)")
        examples = AnnotatedExamples(
            table,
            student_pad_id=self.student_pad_id,
            teacher_pad_id=self.teacher_pad_id,
            with_teacher=self.with_teacher,
            granularities=self.granularities,
            boundary=self.boundary,
        )
        return examples.batch(list(range(len(examples))))

    def _table(self, rows: Sequence[Mapping[str, Any]] | pa.Table | pa.RecordBatch) -> pa.Table:
        if isinstance(rows, pa.RecordBatch):
            return pa.Table.from_batches([rows])
        if isinstance(rows, pa.Table):
            return rows
        rows = list(rows)
        annotated = [INPUT_IDS["student"] in row for row in rows]
        if all(annotated):
            self._check_span_columns(rows)
            return pa.Table.from_pylist([dict(row) for row in rows], schema=SCHEMA)
        if any(annotated):
            raise MtaError(
                "the batch mixes annotated rows (with student_input_ids) and raw rows; give one kind per batch"
            )
        if self.annotator is None:
            raise MtaError(
                f"the rows have no {INPUT_IDS['student']} (they are not annotated): annotate them with "
                "mta.Annotator(settings).annotate(rows), or pass Collator(annotator=mta.Annotator(settings)). "
                f"Under a Hugging Face Trainer: {TRAINER_COLUMNS}"
            )
        return pa.Table.from_batches([self.annotator._annotate(rows).batch])

    def _check_span_columns(self, rows: list[Mapping[str, Any]]) -> None:
        """Annotated rows must carry the spans the loss reads: without them DSA and HRA would
        see no span and give 0, the method off without a word."""
        for name in self.granularities:
            column = SPAN_COLUMNS[name]
            if any(column not in row for row in rows):
                raise MtaError(
                    f"the rows have {INPUT_IDS['student']} but no {column} (the {name} spans DSA and HRA read): "
                    "give the rows mta.Annotator or `mta annotate` writes, whole. Under a Hugging Face "
                    f"Trainer: {TRAINER_COLUMNS}; for a base loss alone: Collator(granularities=())"
                )


# --------------------------------------------------------------------------- losses


def _shape(tensor: torch.Tensor) -> str:
    return "[" + ", ".join(str(size) for size in tensor.shape) + "]"


def _check_positions(
    logits: torch.Tensor, labels: torch.Tensor, labels_shifted: bool, what: str = "student logits"
) -> None:
    """``MtaError`` naming the expected convention when ``logits [B, T, V]`` and ``labels`` cannot be
    inputs of that convention."""
    if logits.dim() != 3:
        raise MtaError(f"{what} must be [batch, positions, vocabulary], got {_shape(logits)}")
    if labels.dim() != 2 or labels.shape[0] != logits.shape[0]:
        raise MtaError(f"labels must be [batch, positions] for {what} {_shape(logits)}, got {_shape(labels)}")
    positions, targets = logits.shape[1], labels.shape[1]
    if positions == targets:
        if not labels_shifted and positions < 2:
            raise MtaError(f"{what} {_shape(logits)} hold one position: nothing predicts a next token")
        return
    if labels_shifted:
        hint = (
            " (logits over every position with shifted labels: drop the logits' last position, or pass "
            "the unshifted labels with labels_shifted=False)"
            if positions == targets + 1
            else ""
        )
        raise MtaError(
            f"{what} {_shape(logits)} and labels {_shape(labels)} cover different positions; expected "
            f"{SHIFTED_CONVENTION}{hint}"
        )
    if positions == targets + 1:
        hint = (
            " The labels are one position shorter: they look shifted already. Pass the unshifted labels, "
            "or shift both sides yourself and say so: labels_shifted=True with logits[:, :-1] and labels[:, 1:]."
        )
    elif targets == positions + 1:
        hint = " The logits are one position shorter: they look shifted already; pass them as the model returns them."
    else:
        hint = ""
    raise MtaError(
        f"{what} {_shape(logits)} and labels {_shape(labels)} cover different positions; expected "
        f"{HF_CONVENTION}.{hint}"
    )


def _check_label_values(labels: torch.Tensor, where: str) -> None:
    """Labels are token ids (an integer tensor, -100 where no loss): ``MtaError`` for floats or
    bools, a warning when no position is left to learn from (the loss is then 0)."""
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise MtaError(
            f"{where}: labels are {labels.dtype}, not token ids: give an integer tensor (torch.long) of the "
            "input ids with -100 where no loss is taken, e.g. input_ids.masked_fill(attention_mask == 0, -100)"
        )
    if labels.numel() and bool((labels == IGNORE_INDEX).all()):
        warnings.warn(
            f"{where}: every label is -100, so no position is learnt and the loss is 0: the labels "
            "should hold the response tokens' ids (-100 on the prompt and padding only)",
            stacklevel=3,
        )


def _check_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    if teacher_logits.dim() != 3 or teacher_logits.shape[:2] != student_logits.shape[:2]:
        raise MtaError(
            f"teacher logits {_shape(teacher_logits)} and student logits {_shape(student_logits)} do not "
            "cover the same positions; give both in the same convention (both as the models return "
            "them, or both shifted)"
        )


class KDLoss(nn.Module):
    """One base loss (``loss.base``: ce, fkl, rkl, skl, srkl, jsd, tvd, distillm2) on logits in the
    Hugging Face convention: ``student_logits`` / ``teacher_logits [B, T, V]`` as the models return
    them, ``labels [B, T]`` the input ids with -100 where no loss is taken; position t predicts
    label t + 1 (the shift happens here). ``labels_shifted=True`` takes the shifted form instead:
    logits ``[B, T-1, V]`` and labels ``[B, T-1]`` already aligned.

    The value is the mean over target tokens (docs/method.md §5); ``vocab_size``: the tokenizer's
    real vocabulary (default: the narrower logits width), so padded embedding rows never count.
    ``num_items_in_batch`` (Hugging Face's name): the target tokens of the whole global batch
    (for ``distillm2`` its pairs); the sum over this batch is divided by it instead, so losses of
    micro batches, each backpropagated, add up to the global batch's gradient (docs/python-api.md,
    "Accumulating").
    """

    def __init__(
        self,
        name: str,
        *,
        labels_shifted: bool = False,
        temperature: float = _LOSS_DEFAULTS.temperature,
        skew_alpha: float = _LOSS_DEFAULTS.skew_alpha,
        jsd_beta: float = _LOSS_DEFAULTS.jsd_beta,
        distillm2_beta: float = _LOSS_DEFAULTS.distillm2_beta,
        vocab_size: int | None = None,
        chunk_size: int = _LOSS_DEFAULTS.chunk_size,
    ) -> None:
        super().__init__()
        if name in UNIT_LOSSES:
            raise MtaError(
                f"KDLoss compares two models on one vocabulary; loss.base={name} compares two vocabularies on "
                "aligned units: use mta.losses.cross_tokenizer (UniversalLogitDistillation, SharedVocabularyHybrid)"
            )
        self.name = name
        self.labels_shifted = labels_shifted
        self.loss = build_base_loss(
            name,
            temperature=temperature,
            skew_alpha=skew_alpha,
            jsd_beta=jsd_beta,
            distillm2_beta=distillm2_beta,
            vocab_size=vocab_size,
            chunk_size=chunk_size,
        )

    @property
    def needs_teacher(self) -> bool:
        """False for ``ce`` (teacher_logits may be None), True for every divergence."""
        return bool(self.loss.needs_teacher)

    def forward(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor | None,
        labels: torch.Tensor,
        *,
        chosen: torch.Tensor | None = None,
        num_items_in_batch: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """An fp32 scalar. chosen: ``[B]`` bool, distillm2 only (True: the teacher's response).
        num_items_in_batch: the global batch's target tokens (distillm2: pairs), or None (this
        batch's mean)."""
        _check_positions(student_logits, labels, self.labels_shifted)
        _check_label_values(labels, f"KDLoss({self.name!r})")
        if not self.needs_teacher:
            teacher_logits = None
        elif teacher_logits is None:
            raise MtaError(f"the base loss {self.name} compares with the teacher; teacher_logits is None")
        else:
            _check_teacher(student_logits, teacher_logits)
        if not self.labels_shifted:
            student_logits, labels = student_logits[:, :-1], labels[:, 1:]
            teacher_logits = None if teacher_logits is None else teacher_logits[:, :-1]
        if isinstance(self.loss, DistiLLM2Loss):
            if chosen is None:
                raise MtaError("the base loss distillm2 reads chosen: [B] bool, True on the teacher's responses")
            return self.loss(student_logits, teacher_logits, labels, chosen, num_pairs=num_items_in_batch)
        if chosen is not None:
            raise MtaError(f"chosen is read by the base loss distillm2 only, not by {self.name}")
        result: torch.Tensor = self.loss(student_logits, teacher_logits, labels, num_items_in_batch=num_items_in_batch)
        return result

    def from_hidden(
        self,
        student_hidden: torch.Tensor,
        student_head: nn.Module,
        labels: torch.Tensor,
        *,
        teacher_hidden: torch.Tensor | None = None,
        teacher_head: nn.Module | None = None,
        teacher_logits: torch.Tensor | None = None,
        chosen: torch.Tensor | None = None,
        reduction: Literal["mean", "sum"] = "mean",
    ) -> torch.Tensor:
        """The same loss from the models' final hidden states and LM heads, the logits formed
        ``chunk_size`` response positions at a time and never whole (``mta.losses.fused_head``):
        the value and gradients of :meth:`forward` on ``head(hidden)``, without its memory.

        student_hidden ``[B, T, d]``: the student's last hidden state (``outputs.hidden_states[-1]``
        or ``last_hidden_state`` of its body, ``model.get_decoder()``), in this loss's convention
        like the logits of :meth:`forward`; student_head: the model (its ``get_output_embeddings()``)
        or its ``nn.Linear`` head (tied or not; rows past ``vocab_size`` are never read). The
        teacher: ``teacher_hidden [B, T, d_t]`` with ``teacher_head``, or its ``teacher_logits``
        (only the response rows are read); neither for ``ce``. reduction: ``mean`` over the target
        tokens (:meth:`forward`'s value) or their ``sum`` (divide by your own token count, e.g. the
        global batch's; distillm2 is per-row means, ``mean`` only)."""
        if student_hidden.dim() != 3 or labels.dim() != 2 or student_hidden.shape[:2] != labels.shape:
            raise MtaError(
                f"student hidden states {_shape(student_hidden)} and labels {_shape(labels)} cover different "
                f"positions; expected {SHIFTED_CONVENTION if self.labels_shifted else HF_CONVENTION}, with the "
                "hidden states in place of the logits"
            )
        side = (
            _teacher_side(teacher_hidden, teacher_head, teacher_logits, student_hidden) if self.needs_teacher else None
        )
        if self.needs_teacher and side is None:
            raise MtaError(
                f"the base loss {self.name} compares with the teacher: give teacher_hidden and teacher_head, "
                "or teacher_logits"
            )
        if not self.labels_shifted:  # position t predicts label t + 1; the teacher's side is read at t
            student_hidden, labels = student_hidden[:, :-1], labels[:, 1:]
        head = _as_head(student_head, "student_head")
        if isinstance(self.loss, DistiLLM2Loss):
            if chosen is None:
                raise MtaError("the base loss distillm2 reads chosen: [B] bool, True on the teacher's responses")
            if reduction != "mean":
                raise MtaError("distillm2 is a mean of per-row means: reduction='mean' only")
            return self.loss.from_hidden(student_hidden, head, side, labels, chosen).mean
        if chosen is not None:
            raise MtaError(f"chosen is read by the base loss distillm2 only, not by {self.name}")
        reduced = self.loss.from_hidden(student_hidden, head, side, labels)
        return reduced.mean if reduction == "mean" else reduced.total


def _as_head(head: nn.Module, what: str) -> OutputHead:
    """An ``nn.Linear`` head, or a model's ``get_output_embeddings()``, as the fused loss reads it."""
    if hasattr(head, "get_output_embeddings"):
        return OutputHead.of(head)
    if type(head) is not nn.Linear:
        raise MtaError(
            f"{what} must be the model (its get_output_embeddings()) or its nn.Linear head, got {type(head).__name__}"
        )
    return OutputHead(head.weight, head.bias)


def _teacher_side(
    hidden: torch.Tensor | None, head: nn.Module | None, logits: torch.Tensor | None, student_hidden: torch.Tensor
) -> TeacherSide | None:
    """The teacher's side of the fused loss: its hidden states and head, or its logits."""
    if (hidden is None) != (head is None):
        raise MtaError("give the teacher's hidden states and its head together (teacher_hidden, teacher_head)")
    if hidden is not None and logits is not None:
        raise MtaError("give the teacher's hidden states and head, or its logits, not both")
    given = hidden if hidden is not None else logits
    if given is None:
        return None
    if given.dim() != 3 or given.shape[:2] != student_hidden.shape[:2]:
        raise MtaError(
            f"the teacher's {'hidden states' if hidden is not None else 'logits'} {_shape(given)} and the student's "
            f"hidden states {_shape(student_hidden)} do not cover the same positions"
        )
    if hidden is not None and head is not None:
        return HeadTeacher(hidden.detach(), _as_head(head, "teacher_head"))
    return LogitsTeacher(given.detach())


def layer_map(
    student_layers: int,
    teacher_layers: int,
    layers: Literal["auto"] | Sequence[LayerPair | Sequence[Any] | Mapping[str, Any]] = "auto",
) -> list[LayerPair]:
    """The aligned layer pairs (``loss.layers``) for models of these depths (transformer blocks;
    ``hidden_states`` indices run from 0, the embeddings, to the depth). ``auto``: docs/method.md
    §4 (a word pair below two phrase pairs); else ``(student, teacher, "word" | "phrase")`` triples
    (or ``LayerPair``s), checked against both depths."""
    if layers == "auto":
        return resolve_layer_map("auto", student_layers, teacher_layers)
    return resolve_layer_map(
        [_layer_pair(pair, index) for index, pair in enumerate(layers)], student_layers, teacher_layers
    )


def _layer_pair(value: Any, index: int) -> LayerPair:
    if isinstance(value, LayerPair):
        return value
    try:
        return LayerPair.model_validate(value)
    except pydantic.ValidationError as error:
        raise MtaError(f"layers[{index}]: {_problems(error)}") from None


def _problems(error: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in problem['loc']) or 'value'}: {problem['msg']}" for problem in error.errors()
    )


class MTALoss(nn.Module):
    """``base_weight·base + dsa_weight·DSA + hra_weight·HRA`` (docs/method.md §3), what ``mta
    distill`` computes, on the outputs of a student and a teacher run on a :class:`TrainBatch`.

    layer_pairs: :func:`layer_map`'s pairs (or triples). same_tokenizer: both models share the
    vocabulary; otherwise only ``base="ce"`` (or None) applies and HRA compares spans.
    vocab_size: the tokenizer's real vocabulary (``len(tokenizer)``). base=None: DSA and HRA only.
    The HRA projectors are parameters of this module: give them to the optimizer
    (``mta distill`` trains them at ``train.projector_lr``).
    """

    def __init__(
        self,
        layer_pairs: Sequence[LayerPair | Sequence[Any] | Mapping[str, Any]],
        *,
        student_hidden_size: int,
        teacher_hidden_size: int,
        vocab_size: int,
        same_tokenizer: bool,
        base: str | None = _LOSS_DEFAULTS.base,
        base_weight: float = _LOSS_DEFAULTS.base_weight,
        dsa_weight: float = _LOSS_DEFAULTS.dsa_weight,
        hra_weight: float = _LOSS_DEFAULTS.hra_weight,
        temperature: float = _LOSS_DEFAULTS.temperature,
        skew_alpha: float = _LOSS_DEFAULTS.skew_alpha,
        jsd_beta: float = _LOSS_DEFAULTS.jsd_beta,
        distillm2_beta: float = _LOSS_DEFAULTS.distillm2_beta,
        importance: Literal["attention", "uniform"] = _LOSS_DEFAULTS.importance,
        chunk_size: int = _LOSS_DEFAULTS.chunk_size,
        labels_shifted: bool = False,
    ) -> None:
        super().__init__()
        options = dict(
            base=base or "ce",
            base_weight=base_weight if base is not None else 0.0,
            dsa_weight=dsa_weight,
            hra_weight=hra_weight,
            temperature=temperature,
            skew_alpha=skew_alpha,
            jsd_beta=jsd_beta,
            distillm2_beta=distillm2_beta,
            importance=importance,
            chunk_size=chunk_size,
        )
        try:
            spec = LossSpec.model_validate(options)
        except pydantic.ValidationError as error:
            raise MtaError(f"MTALoss: {_problems(error)}") from None
        pairs = [_layer_pair(pair, index) for index, pair in enumerate(layer_pairs)] if spec.trajectory_terms else []
        self.labels_shifted = labels_shifted
        # What the HRA projectors are made for (saved with them: a resume onto another map is refused).
        self.layout = {
            "layers": [[pair.student, pair.teacher, pair.granularity] for pair in pairs],
            "student_hidden_size": student_hidden_size,
            "teacher_hidden_size": teacher_hidden_size,
        }
        self.objective = DistillationObjective(
            spec,
            pairs,
            student_hidden_size=student_hidden_size,
            teacher_hidden_size=teacher_hidden_size,
            same_tokenizer=same_tokenizer,
            vocab_size=vocab_size,
        )

    @classmethod
    def for_models(
        cls,
        student: PreTrainedModel,
        teacher: PreTrainedModel,
        *,
        vocab_size: int,
        same_tokenizer: bool,
        layers: Literal["auto"] | Sequence[LayerPair | Sequence[Any] | Mapping[str, Any]] = "auto",
        **options: Any,
    ) -> MTALoss:
        """The loss for two Hugging Face models: their depths give :func:`layer_map`'s pairs, their
        widths the projectors; ``options`` as the constructor's."""
        return cls(
            layer_map(num_layers(student), num_layers(teacher), layers),
            student_hidden_size=hidden_size(student),
            teacher_hidden_size=hidden_size(teacher),
            vocab_size=vocab_size,
            same_tokenizer=same_tokenizer,
            **options,
        )

    @property
    def student_layers(self) -> list[int]:
        """The student ``hidden_states`` indices the loss reads."""
        return self.objective.student_layers

    @property
    def teacher_layers(self) -> list[int]:
        """The teacher ``hidden_states`` indices the loss reads."""
        return self.objective.teacher_layers

    @property
    def granularities(self) -> tuple[str, ...]:
        """The span kinds the batch must carry (``Collator(granularities=...)``)."""
        trajectory = self.objective.trajectory
        return tuple(trajectory.granularities) if trajectory is not None else ()

    @property
    def needs_teacher_logits(self) -> bool:
        """Whether the base loss reads the teacher's logits (every base but ``ce``)."""
        return self.objective.needs_teacher_logits

    def counts(self, batch: TrainBatch, *, labels: torch.Tensor | None = None) -> dict[str, float]:
        """What each term of ``batch`` averages over: ``{"tokens": the base loss's targets,
        "sequences": rows}`` (labels: as :meth:`forward` takes them). Sum them over the micro
        batches of a global batch (and the processes) and pass the sums as ``global_counts``."""
        if labels is not None:
            _check_labels(labels, batch.student.input_ids, self.labels_shifted)
            if self.labels_shifted:
                labels = torch.nn.functional.pad(labels, (1, 0), value=IGNORE_INDEX)
            batch = dataclasses.replace(batch, student=dataclasses.replace(batch.student, labels=labels))
        return self.objective.counts(batch)

    def forward(
        self,
        student_outputs: Any,
        teacher_outputs: Any,
        batch: TrainBatch,
        *,
        labels: torch.Tensor | None = None,
        student_head: nn.Module | None = None,
        teacher_head: nn.Module | None = None,
        global_counts: Mapping[str, float] | None = None,
    ) -> dict[str, torch.Tensor]:
        """fp32 scalars ``{"base", "dsa", "hra", "total"}`` (the terms in use).

        student_outputs / teacher_outputs: what the models return for ``batch.student`` /
        ``batch.teacher`` ids and masks (``.logits``, and ``.hidden_states`` from
        ``output_hidden_states=True``), unshifted; teacher_outputs may be None when no term reads
        it. labels: default ``batch.student.labels``; others in this loss's convention.

        student_head (the model, or its ``nn.Linear`` head): the base loss from the student's last
        hidden state (``student_outputs.hidden_states[-1]``) and this head, ``chunk_size`` response
        positions at a time, never the whole logits (``mta.losses.fused_head``): run the model's body
        (``model.get_decoder()``) with ``output_hidden_states=True``, which computes no logits.
        teacher_head likewise for the teacher (else its ``.logits`` are read, at the response rows only).

        global_counts: :meth:`counts` summed over every micro batch of the global batch: each term
        is then this batch's sum over that count, and the micro batches' losses, each
        backpropagated, add up to the global batch's gradient (``train.loss_reduction: global``).
        Under DDP, which averages gradients, divide the counts by the number of processes.
        """
        objective = self.objective
        if not isinstance(batch, TrainBatch):
            raise MtaError(
                f"MTALoss reads the spans and both models' tokens from a mta.TrainBatch, got a "
                f"{type(batch).__name__}: collate the rows with mta.Collator(granularities=loss_fn.granularities) "
                "and run the models on batch.student / batch.teacher (a tokenizer's output holds no spans)"
            )
        missing = [name for name in self.granularities if name not in batch.spans]
        if missing:
            raise MtaError(
                f"the batch has no {', '.join(missing)} spans, which DSA and HRA read: collate with "
                "mta.Collator(granularities=loss_fn.granularities)"
            )
        ids = batch.student.input_ids
        student_logits, final = None, None
        if student_head is not None:
            states = _output(student_outputs, "hidden_states", "the student's outputs")
            last = states[-1]
            if last.dim() != 3 or last.shape[:2] != ids.shape:
                raise MtaError(
                    f"the student's last hidden state {_shape(last)} does not cover the batch's student tokens "
                    f"{_shape(ids)}: pass the outputs of the student run on batch.student.input_ids"
                )
            final = (last, _as_head(student_head, "student_head"))
        else:
            student_logits = _output(student_outputs, "logits", "the student's outputs")
            if student_logits.dim() != 3 or student_logits.shape[:2] != ids.shape:
                raise MtaError(
                    f"the student's logits {_shape(student_logits)} do not cover the batch's student tokens "
                    f"{_shape(ids)}: pass the outputs of the student run on batch.student.input_ids, as the "
                    f"model returns them ({HF_CONVENTION})"
                )
        student_hidden = None
        if objective.needs_student_hidden:
            student_hidden = tuple(_output(student_outputs, "hidden_states", "the student's outputs"))
        teacher = self._teacher(teacher_outputs, batch, teacher_head if final is not None else None)
        _check_label_values(batch.student.labels if labels is None else labels, "MTALoss")
        if labels is not None:
            _check_labels(labels, ids, self.labels_shifted)
            if self.labels_shifted:  # back to the batch's own convention: position t is token t
                labels = torch.nn.functional.pad(labels, (1, 0), value=IGNORE_INDEX)
            batch = dataclasses.replace(batch, student=dataclasses.replace(batch.student, labels=labels))
        # fp32 from the dtypes the models give, as mta.training.objective.DistillationModel runs it.
        with torch.autocast(ids.device.type, enabled=False):
            losses: dict[str, torch.Tensor] = objective(
                student_logits, student_hidden, teacher, batch, student_final=final, divisors=global_counts
            )
        return losses

    def trajectory(
        self,
        student_hidden_states: Sequence[torch.Tensor],
        teacher_hidden_states: Sequence[torch.Tensor],
        student_attention_mask: torch.Tensor,
        teacher_attention_mask: torch.Tensor,
        spans: Mapping[str, SpanBatch],
        num_sequences: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """DSA and HRA alone, on hidden states of any padding layout (a trainer that left-pads
        its prompts, as TRL's do): fp32 scalars ``{"dsa", "hra", "total"}`` (the terms in use;
        ``total`` weighted by ``dsa_weight`` / ``hra_weight``), what :meth:`forward` adds to the base.
        num_sequences: the sequences of the global batch (each term the sum over this batch's
        sequences divided by it), or None (the mean over this batch's).

        student_hidden_states / teacher_hidden_states: the models' ``hidden_states`` (every index
        :attr:`student_layers` / :attr:`teacher_layers` names), ``[B, T_s, d_s]`` / ``[B, T_t, d_t]``;
        the attention masks ``[B, T]`` 1 on real tokens; spans: ``{granularity: SpanBatch}`` as token
        ranges in those same positions."""
        objective = self.objective
        if objective.trajectory is None:
            raise MtaError("MTALoss.trajectory: dsa_weight and hra_weight are both 0; there is nothing to align")
        teacher = {layer: teacher_hidden_states[layer] for layer in objective.teacher_layers}
        with torch.autocast(student_attention_mask.device.type, enabled=False):
            terms = objective.trajectory(
                tuple(student_hidden_states),
                teacher,
                student_attention_mask,
                teacher_attention_mask,
                spans,
                num_sequences,
            )
        weighted = (objective.weights[name] * value for name, value in terms.items())
        terms["total"] = functools.reduce(operator.add, weighted)
        return terms

    alignment = renamed_attribute("trajectory")  # the old name, until mta.deprecation.REMOVED_IN

    def _teacher(self, outputs: Any, batch: TrainBatch, head: nn.Module | None = None) -> TeacherOutput | None:
        objective = self.objective
        layers = objective.teacher_layers
        if not layers and not objective.needs_teacher_logits:
            return None
        if outputs is None:
            raise MtaError("the loss reads the teacher's outputs (hidden states or logits); teacher_outputs is None")
        hidden: dict[int, torch.Tensor] = {}
        if layers:
            states = _output(outputs, "hidden_states", "the teacher's outputs")
            if max(layers) >= len(states):
                raise MtaError(
                    f"the loss reads teacher hidden_states {layers}, and the teacher's outputs hold "
                    f"{len(states)} (indices 0..{len(states) - 1}); check the layer map against the teacher"
                )
            hidden = {layer: states[layer] for layer in layers}
        logits, side = None, None
        width = batch.teacher.input_ids.shape if batch.teacher is not None else batch.student.input_ids.shape
        if objective.needs_teacher_logits and head is not None:  # fused: its last hidden state and head
            last = _output(outputs, "hidden_states", "the teacher's outputs")[-1]
            if last.dim() != 3 or last.shape[:2] != width:
                raise MtaError(
                    f"the teacher's last hidden state {_shape(last)} does not cover the batch's teacher tokens "
                    f"[{', '.join(map(str, width))}]: pass the outputs of the teacher run on batch.teacher.input_ids"
                )
            side = HeadTeacher(last.detach(), _as_head(head, "teacher_head"))
        elif objective.needs_teacher_logits:
            logits = _output(outputs, "logits", "the teacher's outputs")
            if logits.dim() != 3 or logits.shape[:2] != width:
                raise MtaError(
                    f"the teacher's logits {_shape(logits)} do not cover the batch's teacher tokens "
                    f"[{', '.join(map(str, width))}]: pass the outputs of the teacher run on "
                    f"batch.teacher.input_ids, as the model returns them ({HF_CONVENTION})"
                )
        return TeacherOutput(hidden_states=hidden, logits=logits, side=side)


def _check_labels(labels: torch.Tensor, ids: torch.Tensor, labels_shifted: bool) -> None:
    """``MtaError`` naming the convention when ``labels`` do not fit the batch's ``ids [B, T]``."""
    batch, positions = ids.shape
    expected = (batch, positions - 1) if labels_shifted else (batch, positions)
    if tuple(labels.shape) == expected:
        return
    convention = SHIFTED_CONVENTION if labels_shifted else HF_CONVENTION
    hint = ""
    if not labels_shifted and tuple(labels.shape) == (batch, positions - 1):
        hint = " The labels are one position shorter: they look shifted already (labels_shifted=True takes them)."
    elif labels_shifted and tuple(labels.shape) == (batch, positions):
        hint = " The labels cover every position: they look unshifted (labels_shifted=False takes them)."
    raise MtaError(
        f"labels {_shape(labels)} do not fit the batch's student tokens {_shape(ids)}; expected "
        f"[{', '.join(map(str, expected))}], {convention}.{hint}"
    )


def _output(outputs: Any, name: str, what: str) -> Any:
    """``outputs.name`` (a Hugging Face ``ModelOutput`` or a mapping); ``MtaError`` when absent."""
    value = outputs.get(name) if isinstance(outputs, Mapping) else getattr(outputs, name, None)
    if value is None:
        hint = " (run the model with output_hidden_states=True)" if name == "hidden_states" else ""
        raise MtaError(f"the loss reads {name} from {what}, which hold none{hint}")
    return value
