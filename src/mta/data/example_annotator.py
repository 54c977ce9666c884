"""Turn a chunk of examples into artefact rows: fit to the limits, parse, align, build Arrow.

One :class:`ExampleAnnotator` lives in each worker process; it is the only place where spaCy and
the tokenizers meet. It takes two kinds of rows, which differ only in how their text and ids are
settled; parsing, alignment and the Arrow rows are one code path for both:

- :class:`mta.data.rows.Example` (``mta annotate``): prompt + response text, fitted to the
  length limits on both sides and encoded by each tokenizer;
- :class:`GeneratedRow` (training on sampled responses, :mod:`mta.data.online_spans`): ids a
  model generated, kept exactly; the text is decoded from them and the other side encodes it.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from mta.data.artefact_schema import BOUNDARY_SPAN, SCHEMA, SIDES, SPAN
from mta.data.encoding import Encoding, TokenizerSide
from mta.data.rows import PROMPT_TOO_LONG, Example, RowProblem
from mta.data.span_extraction import WORD, SpanExtractor
from mta.data.token_ranges import SpanRule, boundary_spans, member_ranges, membership_ranges, prompt_token_count
from mta.data.truncation import FittedText, PromptTooLong, fit_to_limits

SPACY_BATCH_SIZE = 64


@dataclass
class ChunkResult:
    """The rows of one chunk, the examples it skipped, and counts for the manifest."""

    batch: pa.RecordBatch
    skipped: list[RowProblem] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)


@dataclass(frozen=True, eq=False)
class GeneratedRow:
    """One sampled sequence whose ids are fixed: a prompt and what a model generated after it.

    prompt: the prompt's text; prompt_ids: ``[prompt tokens]`` the ids the model was prompted
    with; generated_ids: ``[generated tokens]`` what it produced, no padding, its stop token
    last when it stopped by itself (both stored as int64 arrays). All ids are the generating
    side's (``side``: "student" or "teacher").
    finished: whether the last generated id is a stop token that ended the response (kept in
    the ids, not part of the text; the other side gets its own EOS instead). None: when that id
    is the generating side's EOS. id: the row's ``id`` column.
    turns: the generated ids may hold the EOS and other special tokens inside (a tool-calling
    conversation: end of turn, the tool's reply, the next turn). They stay in the ids and the
    text; spaCy reads each special token's characters as a line break, so they are span
    boundaries and no span holds one. False: an EOS before the end is refused (padding passed).
    """

    prompt: str
    prompt_ids: Sequence[int]
    generated_ids: Sequence[int]
    finished: bool | None = None
    side: str = "student"
    id: int = 0
    turns: bool = False

    def __post_init__(self) -> None:
        if self.side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {self.side!r}")
        # Plain int64 arrays: cheap to send to a worker (a torch tensor would travel as shared
        # memory); a CUDA tensor must be moved to the CPU first (``.tolist()`` or ``.cpu()``).
        for name in ("prompt_ids", "generated_ids"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64).reshape(-1))


@dataclass(frozen=True)
class AlignedSpans:
    """Spans kept on both sides. chars, teacher, student: ``[spans, 2]``; labels: ``[spans]``."""

    chars: np.ndarray
    labels: list[str]
    teacher: np.ndarray
    student: np.ndarray
    dropped: int


def align_spans(
    text: str,
    visible: Sequence[np.ndarray],
    chars: np.ndarray,
    labels: Sequence[str],
    rule: SpanRule = "paper",
) -> AlignedSpans:
    """Map character spans to the teacher's and the student's tokens; drop any span that one
    side cannot represent or that the cut removed.

    visible: per side, ``[tokens, 2]`` token ranges without leading whitespace
    (:func:`mta.data.token_ranges.visible_ranges`), or the raw offsets under ``rule="reference"``
    (:func:`mta.data.token_ranges.membership_ranges`); chars: ``[spans, 2]``.
    """
    chars = np.asarray(chars, dtype=np.int64).reshape(-1, 2)
    t_start, t_end, t_found = member_ranges(visible[0], chars, rule)
    s_start, s_end, s_found = member_ranges(visible[1], chars, rule)
    keep = t_found & s_found & (chars[:, 1] <= len(text))
    return AlignedSpans(
        chars=chars[keep],
        labels=[label for label, kept in zip(labels, keep, strict=True) if kept],
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
        [
            column(chars, 0),
            column(chars, 1),
            labels,
            column(teacher, 0),
            column(teacher, 1),
            column(student, 0),
            column(student, 1),
        ],
        fields=list(SPAN),
    )
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), spans)


def _boundary_lists(rows: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> pa.ListArray:
    """``boundary_spans`` of each row from its ``(chars, teacher, student)`` ``[spans, 2]``."""
    offsets = np.concatenate([[0], np.cumsum([len(row[0]) for row in rows])]).astype(np.int32)
    flat = np.concatenate([np.concatenate(row, axis=1) for row in rows]) if rows else np.zeros((0, 6))
    spans = pa.StructArray.from_arrays(
        [pa.array(flat[:, index].astype(np.int32), pa.int32()) for index in range(6)],
        fields=list(BOUNDARY_SPAN),
    )
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), spans)


class ExampleAnnotator:
    """Fits, parses and aligns examples for one (teacher, student) pair and one set of limits;
    settles, parses and aligns generated rows the same way (limits do not apply to them)."""

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

    def annotate(self, examples: Sequence[Example | GeneratedRow]) -> ChunkResult:
        """Arrow rows (``SCHEMA``) of ``examples``, in order; an example whose prompt is over the
        limit is skipped (a :class:`GeneratedRow` is never skipped: its ids are what they are)."""
        counts: Counter = Counter()
        skipped: list[RowProblem] = []
        kept: list[tuple[Example | GeneratedRow, FittedText, tuple[np.ndarray, ...]]] = []
        for example in examples:
            if isinstance(example, GeneratedRow):
                fitted, row_ids = self.settle_generated(example)
                counts["prompt_not_decoded"] += fitted.prompt_chars != len(example.prompt)
            else:
                fitted = fit_to_limits(
                    example.prompt,
                    example.response,
                    self.sides,
                    max_length=self.max_length,
                    max_prompt_length=self.max_prompt_length,
                    truncate_prompt=self.truncate_prompt,
                )
                if isinstance(fitted, PromptTooLong):
                    skipped.append(RowProblem(example.id, example.line, PROMPT_TOO_LONG, fitted.message))
                    continue
                row_ids = tuple(
                    # docs/method.md §1: EOS ends a whole response
                    np.concatenate([encoding.ids, np.asarray([side.eos_id] if fitted.complete else [], np.int32)])
                    for side, encoding in zip(self.sides, fitted.encodings, strict=True)
                )
            counts["response_cut"] += fitted.response_cut
            counts["prompt_cut"] += fitted.prompt_cut
            kept.append((example, fitted, row_ids))

        # spaCy sees the kept text and a margin of what the cut removed, so a phrase that the cut
        # splits is recognised and dropped instead of being parsed as a shorter phrase that never
        # was one; what lies further on cannot reach the kept spans, so it is never parsed.
        max_chars = self.extractor.nlp.max_length
        parsed = self.extractor.pipe(
            [fitted.parse_text[:max_chars] for _, fitted, _ in kept], batch_size=SPACY_BATCH_SIZE
        )
        ids = {"teacher": [], "student": []}
        prompt_lens = {"teacher": [], "student": []}
        phrases, words, boundaries = [], [], []
        for (_example, fitted, row_ids), spans in zip(kept, parsed, strict=True):
            for name, side_ids, encoding in zip(SIDES, row_ids, fitted.encodings, strict=True):
                ids[name].append(side_ids)
                prompt_lens[name].append(prompt_token_count(encoding.offsets, fitted.prompt_chars))
            rule = self.extractor.span_rule
            visible = [membership_ranges(fitted.text, encoding.offsets, rule) for encoding in fitted.encodings]
            phrase_spans = align_spans(fitted.text, visible, spans.phrases, spans.phrase_labels, rule)
            word_spans = align_spans(fitted.text, visible, spans.words, [WORD] * len(spans.words), rule)
            counts["phrase_spans"] += len(phrase_spans.labels)
            counts["phrase_spans_dropped"] += phrase_spans.dropped
            counts["word_spans"] += len(word_spans.labels)
            counts["word_spans_dropped"] += word_spans.dropped
            phrases.append(phrase_spans)
            words.append(word_spans)
            # SRA's spans, over the whole text (prompt and response); EOS is in no offsets.
            boundaries.append(boundary_spans(fitted.text, *(e.offsets for e in fitted.encodings)))
            counts["boundary_spans"] += len(boundaries[-1][0])

        batch = pa.RecordBatch.from_arrays(
            [
                pa.array([example.id for example, _, _ in kept], pa.int64()),
                pa.array([fitted.text for _, fitted, _ in kept], pa.string()),
                pa.array([fitted.prompt_chars for _, fitted, _ in kept], pa.int32()),
                _int32_lists(ids["teacher"]),
                _int32_lists(ids["student"]),
                pa.array(prompt_lens["teacher"], pa.int32()),
                pa.array(prompt_lens["student"], pa.int32()),
                _span_lists(phrases),
                _span_lists(words),
                pa.array([getattr(example, "pair_id", None) for example, _, _ in kept], pa.int64()),
                pa.array([getattr(example, "role", None) for example, _, _ in kept], pa.string()),
                _boundary_lists(boundaries),
            ],
            schema=SCHEMA,
        )
        return ChunkResult(batch=batch, skipped=skipped, counts=counts)

    def settle_generated(self, row: GeneratedRow) -> tuple[FittedText, tuple[np.ndarray, np.ndarray]]:
        """The text, encodings and final ids of a generated row (docs/method.md §1, online).

        The generating side keeps exactly ``prompt_ids + generated_ids``; its text and offsets
        come from those ids (:meth:`TokenizerSide.decode_with_offsets`: a character split
        between tokens belongs to each of them). A side with the same vocabulary (fingerprint)
        sees the same ids; another tokenizer encodes the text, with its EOS when the response
        is finished. ``prompt_chars`` is ``len(row.prompt)`` when the text starts with it, else
        where the prompt ids' text ends (a tokenizer that normalizes, e.g. NFC). No length
        limit is applied: the generator's budget bounds the generating side, and another
        tokenizer may need more ids for the same text.
        Returns ``(FittedText, (teacher ids [tokens], student ids [tokens]) int32)``.
        """
        maker = self.sides[SIDES.index(row.side)]
        prompt_ids, generated = row.prompt_ids, row.generated_ids
        finished = row.finished
        if finished is None:
            finished = len(generated) > 0 and int(generated[-1]) == maker.eos_id
        if finished and len(generated) == 0:
            raise ValueError("a finished row needs its stop token as the last generated id")
        body = generated[: len(generated) - int(finished)]
        if np.any(body == maker.eos_id) and not row.turns:
            at = int(np.flatnonzero(body == maker.eos_id)[0])
            raise ValueError(
                f"generated_ids holds the {row.side}'s EOS ({maker.eos_id}) at position {at}, "
                f"before its end: pass one row's ids up to and including its first EOS, no padding"
            )
        text, decoded = maker.decode_with_offsets(np.concatenate([prompt_ids, body]))
        if text.startswith(row.prompt):
            prompt_chars = len(row.prompt)
        else:
            prompt_chars = int(decoded.offsets[len(prompt_ids) - 1, 1]) if len(prompt_ids) else 0
        given = np.concatenate([prompt_ids, generated]).astype(np.int32)
        encodings: list[Encoding] = []
        row_ids: list[np.ndarray] = []
        for side in self.sides:
            if side is maker or side.fingerprint == maker.fingerprint:
                encodings.append(decoded)
                row_ids.append(given)
            else:
                encoding = side.encode(text)
                encodings.append(encoding)
                row_ids.append(np.concatenate([encoding.ids, np.asarray([side.eos_id] if finished else [], np.int32)]))
        # What spaCy parses (FittedText.parse_text): with turns, special tokens read as line breaks.
        parsed = special_tokens_as_breaks(text, decoded, maker.special_ids) if row.turns else text
        fitted = FittedText(text, prompt_chars, bool(finished), False, tuple(encodings), parsed[prompt_chars:])
        return fitted, (row_ids[0], row_ids[1])


def special_tokens_as_breaks(text: str, encoding: Encoding, special_ids: np.ndarray) -> str:
    """``text`` with the characters of each special token of ``encoding`` (ids in
    ``special_ids``) replaced by line breaks: the same length, so character offsets still hold."""
    special = np.isin(encoding.ids, special_ids)
    if not special.any():
        return text
    starts, ends = encoding.offsets[special, 0], encoding.offsets[special, 1]
    lengths = ends - starts
    # [characters of every special token] their positions, without a loop over tokens.
    positions = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + np.arange(lengths.sum())
    chars = np.array(list(text), dtype=object)
    chars[positions] = "\n"
    return "".join(chars)


# --------------------------------------------------------------------------- worker processes
# The pool initializer and task of the processes that run an annotator: ``mta annotate``
# (:func:`mta.data.annotate.map_chunks`) and the trainer's span parser (:mod:`mta.data.online_spans`).

_WORKER_ANNOTATOR: ExampleAnnotator | None = None


def init_annotator_worker(source: ExampleAnnotator | Callable[[], ExampleAnnotator]) -> None:
    """Install this worker process's annotator: ``source`` itself (inherited by fork), or what
    it builds (spawn)."""
    global _WORKER_ANNOTATOR
    # Ctrl-C is the parent's to handle: it stops the pool and deletes the unfinished part.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker; no nested threads
    _WORKER_ANNOTATOR = source if isinstance(source, ExampleAnnotator) else source()


def annotate_in_worker(chunk: Sequence[Example | GeneratedRow]) -> ChunkResult:
    """One chunk annotated by this worker's annotator (:func:`init_annotator_worker`)."""
    assert _WORKER_ANNOTATOR is not None, "worker used before init_annotator_worker"
    return _WORKER_ANNOTATOR.annotate(chunk)
