"""Turn a chunk of examples into artefact rows: fit to the limits, parse, align, build Arrow.

One :class:`ExampleAnnotator` lives in each worker process; it is the only place where spaCy and
the tokenizers meet.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pyarrow as pa

from mta.data.token_ranges import member_ranges, prompt_token_count, visible_ranges
from mta.data.artefact_schema import SCHEMA, SPAN
from mta.data.encoding import TokenizerSide
from mta.data.rows import PROMPT_TOO_LONG, Example, RowProblem
from mta.data.span_extraction import WORD, SpanExtractor
from mta.data.truncation import FittedText, PromptTooLong, fit_to_limits

SPACY_BATCH_SIZE = 64


@dataclass
class ChunkResult:
    """The rows of one chunk, the examples it skipped, and counts for the manifest."""

    batch: pa.RecordBatch
    skipped: list[RowProblem] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)


@dataclass(frozen=True)
class AlignedSpans:
    """Spans kept on both sides. chars, teacher, student: ``[spans, 2]``; labels: ``[spans]``."""

    chars: np.ndarray
    labels: list[str]
    teacher: np.ndarray
    student: np.ndarray
    dropped: int


def align_spans(
    text: str, visible: Sequence[np.ndarray], chars: np.ndarray, labels: Sequence[str]
) -> AlignedSpans:
    """Map character spans to the teacher's and the student's tokens; drop any span that one
    side cannot represent or that the cut removed.

    visible: per side, ``[tokens, 2]`` token ranges without leading whitespace
    (:func:`mta.data.token_ranges.visible_ranges`); chars: ``[spans, 2]``.
    """
    chars = np.asarray(chars, dtype=np.int64).reshape(-1, 2)
    t_start, t_end, t_found = member_ranges(visible[0], chars)
    s_start, s_end, s_found = member_ranges(visible[1], chars)
    keep = t_found & s_found & (chars[:, 1] <= len(text))
    return AlignedSpans(
        chars=chars[keep],
        labels=[label for label, kept in zip(labels, keep) if kept],
        teacher=np.stack([t_start[keep], t_end[keep]], axis=1),
        student=np.stack([s_start[keep], s_end[keep]], axis=1),
        dropped=int(np.count_nonzero(~keep)),
    )


def _int32_lists(rows: Sequence[np.ndarray]) -> pa.ListArray:
    offsets = np.concatenate([[0], np.cumsum([len(row) for row in rows])]).astype(np.int32)
    values = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.int32()))


def _span_lists(rows: Sequence[AlignedSpans]) -> pa.ListArray:
    offsets = np.concatenate([[0], np.cumsum([len(row.labels) for row in rows])]).astype(np.int32)

    def column(arrays: list[np.ndarray], index: int) -> pa.Array:
        values = np.concatenate([a[:, index] for a in arrays]) if arrays else np.zeros(0)
        return pa.array(values.astype(np.int32), pa.int32())

    chars = [row.chars for row in rows]
    teacher = [row.teacher for row in rows]
    student = [row.student for row in rows]
    labels = pa.array([label for row in rows for label in row.labels], pa.string())
    spans = pa.StructArray.from_arrays(
        [column(chars, 0), column(chars, 1), labels, column(teacher, 0), column(teacher, 1),
         column(student, 0), column(student, 1)],
        fields=list(SPAN),
    )
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), spans)


class ExampleAnnotator:
    """Fits, parses and aligns examples for one (teacher, student) pair and one set of limits."""

    def __init__(
        self,
        extractor: SpanExtractor,
        teacher: TokenizerSide,
        student: TokenizerSide,
        *,
        max_length: int,
        max_prompt_length: int,
        truncate_prompt: bool,
    ):
        self.extractor = extractor
        self.sides = (teacher, student)
        self.max_length = max_length
        self.max_prompt_length = max_prompt_length
        self.truncate_prompt = truncate_prompt

    def annotate(self, examples: Sequence[Example]) -> ChunkResult:
        counts: Counter = Counter()
        skipped: list[RowProblem] = []
        kept: list[tuple[Example, FittedText]] = []
        for example in examples:
            fitted = fit_to_limits(
                example.prompt, example.response, self.sides,
                max_length=self.max_length, max_prompt_length=self.max_prompt_length,
                truncate_prompt=self.truncate_prompt,
            )
            if isinstance(fitted, PromptTooLong):
                skipped.append(RowProblem(example.id, example.line, PROMPT_TOO_LONG, fitted.message))
                continue
            counts["response_cut"] += fitted.response_cut
            counts["prompt_cut"] += fitted.prompt_cut
            kept.append((example, fitted))

        # spaCy sees the kept text and a margin of what the cut removed, so a phrase that the cut
        # splits is recognised and dropped instead of being parsed as a shorter phrase that never
        # was one; what lies further on cannot reach the kept spans, so it is never parsed.
        max_chars = self.extractor.nlp.max_length
        parsed = self.extractor.pipe([fitted.parse_text[:max_chars] for _, fitted in kept],
                                     batch_size=SPACY_BATCH_SIZE)
        ids = {"teacher": [], "student": []}
        prompt_lens = {"teacher": [], "student": []}
        phrases, words = [], []
        for (example, fitted), spans in zip(kept, parsed):
            for name, side, encoding in zip(("teacher", "student"), self.sides, fitted.encodings):
                eos = [side.eos_id] if fitted.complete else []  # docs/method.md §1: EOS ends a whole response
                ids[name].append(np.concatenate([encoding.ids, np.asarray(eos, np.int32)]))
                prompt_lens[name].append(prompt_token_count(encoding.offsets, fitted.prompt_chars))
            visible = [visible_ranges(fitted.text, encoding.offsets) for encoding in fitted.encodings]
            phrase_spans = align_spans(fitted.text, visible, spans.phrases, spans.phrase_labels)
            word_spans = align_spans(fitted.text, visible, spans.words, [WORD] * len(spans.words))
            counts["phrase_spans"] += len(phrase_spans.labels)
            counts["phrase_spans_dropped"] += phrase_spans.dropped
            counts["word_spans"] += len(word_spans.labels)
            counts["word_spans_dropped"] += word_spans.dropped
            phrases.append(phrase_spans)
            words.append(word_spans)

        batch = pa.RecordBatch.from_arrays(
            [
                pa.array([example.id for example, _ in kept], pa.int64()),
                pa.array([fitted.text for _, fitted in kept], pa.string()),
                pa.array([fitted.prompt_chars for _, fitted in kept], pa.int32()),
                _int32_lists(ids["teacher"]),
                _int32_lists(ids["student"]),
                pa.array(prompt_lens["teacher"], pa.int32()),
                pa.array(prompt_lens["student"], pa.int32()),
                _span_lists(phrases),
                _span_lists(words),
            ],
            schema=SCHEMA,
        )
        return ChunkResult(batch=batch, skipped=skipped, counts=counts)
