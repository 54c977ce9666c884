"""From annotate rows to padded tensors, and the order in which a run visits them.

``AnnotatedExamples`` turns the Parquet table into flat numpy arrays once (values + row offsets
per list column), so building a batch is a handful of vectorised gathers and scatters: no
Python loop over rows, tokens or spans. ``micro_batch_order`` is a pure function of
``(seed, epoch)``, so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from mta.data.artefact_schema import (
    BOUNDARY_SPANS,
    ID,
    INPUT_IDS,
    PAIR_ID,
    PROMPT_LEN,
    ROLE,
    SPAN_COLUMNS,
    SPAN_TOKENS,
)
from mta.errors import MtaError
from mta.losses.span_masks import SpanBatch

IGNORE_INDEX = -100
SPAN_FIELDS = (*SPAN_TOKENS["student"], *SPAN_TOKENS["teacher"])
BOUNDARY = "boundary"  # the key of SRA's spans in TrainBatch.spans
GENERIC_REBUILD = "mta annotate DATA.jsonl --teacher TEACHER --student STUDENT -o NEW_DIR"


@dataclass
class TokenBatch:
    """One model's view of a batch, right-padded.

    input_ids, attention_mask, labels: ``[batch, seq]``; labels repeat ``input_ids`` on response
    tokens and hold ``-100`` on the prompt and on padding (not shifted: position t is token t).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device))

    def padded_to(self, width: int, pad_id: int) -> TokenBatch:
        """Right-padded to at least ``width`` positions (``pad_id``, mask 0, label ``-100``)."""
        extra = width - self.input_ids.shape[1]
        if extra <= 0:
            return self
        pad = torch.nn.functional.pad
        return TokenBatch(
            pad(self.input_ids, (0, extra), value=pad_id),
            pad(self.attention_mask, (0, extra)),
            pad(self.labels, (0, extra), value=IGNORE_INDEX),
        )


@dataclass
class TrainBatch:
    """A micro batch: the row ids it holds, both models' tokens and the spans per granularity.
    chosen: ``[batch]`` bool for pair rows (True: the teacher's response), None otherwise.
    pending_spans: set on a generated micro batch while the span workers parse its rows (its
    ``spans`` are empty until then): the handle ``OffPolicyBatches.with_spans`` (in
    ``mta.training.off_policy.micro_batches``) waits on; None otherwise. origin: where the rows
    come from (a teacher cache holds the teacher's side of gold rows only)."""

    row_ids: list[str]
    student: TokenBatch
    teacher: TokenBatch | None
    spans: Mapping[str, SpanBatch]
    chosen: torch.Tensor | None = None
    pending_spans: Any | None = None
    origin: str = "gold"  # "gold": annotated rows; "generated" / "buffer": the student's own (off-policy)

    def __len__(self) -> int:
        """The rows it holds."""
        return len(self.row_ids)

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` is one of its fields. A Hugging Face ``Trainer`` asks ``"labels" in
        batch`` of every batch (the labels are ``batch.student.labels``): the answer lets a
        ``TrainBatch`` pass through it whole (docs/python-api.md, "Inside a Hugging Face Trainer")."""
        return isinstance(name, str) and name in self.__dataclass_fields__

    def to(self, device: torch.device | str) -> TrainBatch:
        return replace(
            self,
            student=self.student.to(device),
            teacher=None if self.teacher is None else self.teacher.to(device),
            spans={name: spans.to(device) for name, spans in self.spans.items()},
            chosen=None if self.chosen is None else self.chosen.to(device),
        )

    def padded_to(self, width: int, pad_ids: Mapping[str, int]) -> TrainBatch:
        """Both sides right-padded to at least ``width`` positions, as the authors' collate pads
        every batch to ``max_length`` (``loss.reference_code``); spans keep their token ranges.
        pad_ids: ``{"student": id, "teacher": id}``."""
        return replace(
            self,
            student=self.student.padded_to(width, pad_ids["student"]),
            teacher=None if self.teacher is None else self.teacher.padded_to(width, pad_ids["teacher"]),
        )

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) student tokens: what tokens/s counts."""
        return int(self.student.attention_mask.sum())


class _Ragged:
    """A list column as flat ``values`` and ``offsets`` (row i is ``values[offsets[i]:offsets[i+1]]``)."""

    def __init__(self, column: pa.ChunkedArray | pa.Array):
        column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        self.lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.values = pc.list_flatten(column)

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat indices of the elements of ``rows``, with each element's row and position in it."""
        lengths = self.lengths[rows]
        starts = np.repeat(self.offsets[rows], lengths)
        row_of = np.repeat(np.arange(len(rows)), lengths)
        first = np.repeat(np.cumsum(lengths) - lengths, lengths)
        position = np.arange(int(lengths.sum())) - first
        return starts + position, row_of, position


def _padded(
    values: np.ndarray, rows: int, width: int, row_of: np.ndarray, position: np.ndarray, fill: int
) -> np.ndarray:
    out = np.full((rows, width), fill, dtype=values.dtype)
    out[row_of, position] = values
    return out


class AnnotatedExamples:
    """The rows of an annotate artefact, ready to be gathered into ``TrainBatch``es.

    table: the artefact's Parquet table (columns of ``mta annotate``).
    student_pad_id / teacher_pad_id: the id written into padding (masked out everywhere).
    with_teacher: False for SFT, where the teacher's columns are not turned into tensors.
    granularities: the span kinds the loss reads (``"word"``, ``"phrase"``).
    boundary: also gather ``boundary_spans`` (SRA) into ``batch.spans["boundary"]``; a table
    without them (the column absent, or null on a row: an artefact of schema version 1 or 2) is
    refused naming ``rebuild``, the command that builds them into a new directory (pass
    ``artefact_schema.reannotate_command(manifest, directory)``; default: a generic one).
    """

    def __init__(
        self,
        table: pa.Table,
        *,
        student_pad_id: int,
        teacher_pad_id: int = 0,
        with_teacher: bool = True,
        granularities: tuple[str, ...] = ("word", "phrase"),
        boundary: bool = False,
        rebuild: str | None = None,
    ):
        sides = ("student", "teacher") if with_teacher else ("student",)
        missing = {
            ID,
            *(INPUT_IDS[side] for side in sides),
            *(PROMPT_LEN[side] for side in sides),
            *(SPAN_COLUMNS[name] for name in granularities),
        } - set(table.column_names)
        if missing:
            raise MtaError(
                f"the annotations lack the column(s) {sorted(missing)}; annotate the data again "
                "with this version of mta into a new directory (`mta annotate DATA.jsonl -o NEW_DIR ...`)"
            )
        self.row_ids = [str(value) for value in table.column(ID).to_pylist()]
        self.with_teacher = with_teacher
        self.pad_ids = {"student": student_pad_id, "teacher": teacher_pad_id}
        self.ids = {side: _Ragged(table.column(INPUT_IDS[side])) for side in sides}
        for ragged in self.ids.values():
            ragged.values = ragged.values.to_numpy(zero_copy_only=False).astype(np.int64)
        self.prompt_len = {side: table.column(PROMPT_LEN[side]).to_numpy().astype(np.int64) for side in sides}
        self.pair_ids, self.chosen = _pairs(table)
        self.spans: dict[str, tuple[_Ragged, dict[str, np.ndarray]]] = {}
        for name in granularities:
            self.spans[name] = _span_fields(table.column(SPAN_COLUMNS[name]))
        if boundary:
            self.spans[BOUNDARY] = _boundary_spans(table, rebuild or GENERIC_REBUILD)

    def __len__(self) -> int:
        return len(self.row_ids)

    @property
    def student_lengths(self) -> np.ndarray:
        """``[rows]`` token count of each row on the student side."""
        return self.ids["student"].lengths

    def batch(self, rows: np.ndarray | list[int]) -> TrainBatch:
        """Gather ``rows`` (positions in the table) into a right-padded ``TrainBatch``."""
        rows = np.asarray(rows, dtype=np.int64)
        tokens = {side: self._tokens(side, rows) for side in self.ids}
        spans = {name: self._spans(name, rows) for name in self.spans}
        chosen = None if self.chosen is None else torch.from_numpy(self.chosen[rows])
        return TrainBatch([self.row_ids[row] for row in rows], tokens["student"], tokens.get("teacher"), spans, chosen)

    def _tokens(self, side: str, rows: np.ndarray) -> TokenBatch:
        ragged = self.ids[side]
        flat, row_of, position = ragged.gather(rows)
        lengths = ragged.lengths[rows]
        width = max(int(lengths.max(initial=0)), 1)
        input_ids = _padded(ragged.values[flat], len(rows), width, row_of, position, self.pad_ids[side])
        columns = np.arange(width)[None, :]
        real = columns < lengths[:, None]
        response = real & (columns >= self.prompt_len[side][rows][:, None])
        labels = np.where(response, input_ids, IGNORE_INDEX)
        return TokenBatch(
            torch.from_numpy(input_ids), torch.from_numpy(real.astype(np.int64)), torch.from_numpy(labels)
        )

    def _spans(self, name: str, rows: np.ndarray) -> SpanBatch:
        ragged, fields = self.spans[name]
        flat, row_of, position = ragged.gather(rows)
        width = int(ragged.lengths[rows].max(initial=0))
        # Padding spans are empty ranges [0, 0): they cover no token on either side.
        tensors = {
            field: torch.from_numpy(_padded(values[flat], len(rows), width, row_of, position, 0))
            for field, values in fields.items()
        }
        mask = np.zeros((len(rows), width), dtype=bool)
        mask[row_of, position] = True
        return SpanBatch(**tensors, mask=torch.from_numpy(mask))


def _span_fields(column: pa.ChunkedArray | pa.Array) -> tuple[_Ragged, dict[str, np.ndarray]]:
    ragged = _Ragged(column)
    fields = {
        field: ragged.values.field(field).to_numpy(zero_copy_only=False).astype(np.int64) for field in SPAN_FIELDS
    }
    return ragged, fields


def _boundary_spans(table: pa.Table, rebuild: str) -> tuple[_Ragged, dict[str, np.ndarray]]:
    """SRA's spans of every row; ``MtaError`` naming ``rebuild`` when any row lacks them."""
    column = table.column(BOUNDARY_SPANS) if BOUNDARY_SPANS in table.column_names else None
    if column is None or column.null_count:
        missing = (
            f"lack the column `{BOUNDARY_SPANS}`"
            if column is None
            else (
                f"have no `{BOUNDARY_SPANS}` on {column.null_count} of {table.num_rows} rows (null: "
                "not computed, as in an artefact of schema version 1 or 2)"
            )
        )
        raise MtaError(
            f"SRA reads the spans both tokenizers agree on, and the annotations {missing}; "
            f"annotate the data again with this mta into a new directory (the "
            f"existing one stays as it is): `{rebuild}`, then train on that one"
        )
    return _span_fields(column)


def _pairs(table: pa.Table) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(pair id [rows], chosen [rows] bool)`` of a table of pair rows (DistiLLM-2); ``(None,
    None)`` when it holds none. A table must be all pairs or none, each pair a chosen and a
    rejected row, the chosen one first (as ``mta annotate`` writes them)."""
    if PAIR_ID not in table.column_names or table.column(PAIR_ID).null_count == table.num_rows:
        return None, None
    pair_ids = table.column(PAIR_ID)
    roles = table.column(ROLE).to_pylist() if ROLE in table.column_names else [None] * table.num_rows
    if (
        pair_ids.null_count
        or len(roles) % 2
        or roles[0::2] != ["chosen"] * (len(roles) // 2)
        or roles[1::2] != ["rejected"] * (len(roles) // 2)
    ):
        raise MtaError(
            "the annotations mix pair rows (pair_id, role) with other rows, or a pair lacks its chosen "
            "or rejected half; annotate a file of pair rows only (`mta generate` writes one)"
        )
    pair_ids = pair_ids.to_numpy().astype(np.int64)
    if not np.array_equal(pair_ids[0::2], pair_ids[1::2]):
        raise MtaError("the annotations' pair rows are not in pairs (chosen then rejected, one pair_id)")
    return pair_ids, np.array([role == "chosen" for role in roles])


def micro_batch_order(
    lengths: np.ndarray,
    micro_batch_size: int,
    *,
    seed: int,
    epoch: int,
    group_factor: int = 32,
    paired: bool = False,
) -> list[np.ndarray]:
    """One epoch's micro batches (row positions), length-aware and reproducible.

    Rows are shuffled by ``(seed, epoch)``, cut into pools of ``group_factor`` micro batches,
    sorted by length inside each pool (so a micro batch pads little) and the micro batches are
    shuffled again, so long and short batches are interleaved over the epoch. The rows left over
    after the last full micro batch (a different few each epoch) are skipped.

    paired: rows 2k and 2k + 1 are a pair (DistiLLM-2's chosen and rejected) and stay together,
    in that order: pairs are ordered as rows are (by the longer half), ``micro_batch_size / 2``
    pairs to a micro batch.
    """
    if paired:
        if micro_batch_size % 2 or len(lengths) % 2:
            raise MtaError(
                f"pair rows train two to a pair in a micro batch: train.micro_batch_size must be even "
                f"(got {micro_batch_size})"
            )
        pair_lengths = np.maximum(lengths[0::2], lengths[1::2])
        pair_batches = micro_batch_order(
            pair_lengths, micro_batch_size // 2, seed=seed, epoch=epoch, group_factor=group_factor
        )
        return [np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1) for pairs in pair_batches]
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    pool = micro_batch_size * group_factor
    batches: list[np.ndarray] = []
    for begin in range(0, len(order), pool):
        members = order[begin : begin + pool]
        members = members[np.argsort(-lengths[members], kind="stable")]
        full = len(members) - len(members) % micro_batch_size
        if full:
            batches.extend(np.split(members[:full], range(micro_batch_size, full, micro_batch_size)))
    return [batches[index] for index in rng.permutation(len(batches))]


@dataclass(frozen=True)
class StepSchedule:
    """Which micro batches each process runs at each optimizer step.

    A global step takes ``accumulation * world_size`` consecutive micro batches of the epoch's
    order; process ``rank`` takes every ``world_size``-th of them. Incomplete trailing steps of
    an epoch are dropped so every step has the recipe's global batch.
    """

    num_rows: int
    micro_batch_size: int
    accumulation: int
    world_size: int

    @property
    def micro_batches_per_step(self) -> int:
        return self.accumulation * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        full_micro_batches = self.num_rows // self.micro_batch_size
        steps = full_micro_batches // self.micro_batches_per_step
        if steps == 0:
            raise MtaError(
                f"the training data has {self.num_rows} rows, fewer than one global batch of "
                f"{self.micro_batch_size * self.micro_batches_per_step}; lower train.batch_size"
            )
        return steps

    def total_steps(self, epochs: float | None, max_steps: int | None) -> int:
        if max_steps is not None:
            return max_steps
        if epochs is None:
            raise MtaError("give exactly one of train.epochs and train.max_steps")
        return max(1, int(round(epochs * self.steps_per_epoch)))

    def locate(self, step: int) -> tuple[int, int]:
        """``(epoch, step within the epoch)`` of global step ``step`` (0-based)."""
        return divmod(step, self.steps_per_epoch)

    def micro_batch_indices(self, step_in_epoch: int, rank: int) -> list[int]:
        first = step_in_epoch * self.micro_batches_per_step
        return [first + micro * self.world_size + rank for micro in range(self.accumulation)]
