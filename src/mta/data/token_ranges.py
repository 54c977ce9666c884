"""Character spans to token ranges, by the membership rule of docs/method.md §1.

A token belongs to span ``[a, b)`` when its character range, with leading whitespace stripped, is
non-empty and lies inside ``[a, b)``; the span's token range is ``[first member, last member + 1)``.
Byte-level BPE ("Ġword") and SentencePiece ("▁word") tokens carry the space before a word, which
is why the leading whitespace is stripped; a whitespace-only token or a special token (offsets
``(0, 0)``) belongs to no span.

The ``"reference"`` rule (``data.span_rule``, docs/method.md §8) is the authors' instead
(``prepare_span_indices_and_weights`` in their ``span_utils.py``): a token with raw offsets
``(s, e)`` belongs to ``[a, b)`` when ``s + 1 >= a and e <= b``, so a one-character token that ends
where the span begins (a newline, a quote, a lone space) is taken in.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

SpanRule = Literal["paper", "reference"]
SPAN_RULES = ("paper", "reference")

# Whether each code point up to U+3000 (the highest one str.isspace() accepts) is whitespace.
_IS_SPACE = np.array([chr(code).isspace() for code in range(0x3001)], dtype=bool)


def _ranges(values: np.ndarray) -> np.ndarray:
    """``values`` (an array or nested lists, possibly empty) as ``[n, 2]`` int64 ranges."""
    return np.asarray(values, dtype=np.int64).reshape(-1, 2)


def _check_rule(rule: str) -> None:
    if rule not in SPAN_RULES:
        raise ValueError(f"the span rule must be one of {SPAN_RULES}, not {rule!r}")


def _non_space(text: str) -> np.ndarray:
    """``[characters]`` the positions of ``text``'s characters that are not whitespace."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    is_space = (codes <= 0x3000) & _IS_SPACE[np.minimum(codes, 0x3000)]
    return np.flatnonzero(~is_space)


def visible_ranges(text: str, offsets: np.ndarray) -> np.ndarray:
    """``[tokens, 2]`` each token's character range with its leading whitespace skipped.

    offsets: ``[tokens, 2]`` character ranges into ``text``. A token that is only whitespace, or a
    special token at ``(0, 0)``, gets an empty range (start == end).
    """
    offsets = _ranges(offsets)
    non_space = np.append(_non_space(text), len(text))
    # The first visible character at or after each token's start, but never past its end.
    starts = np.minimum(non_space[np.searchsorted(non_space, offsets[:, 0])], offsets[:, 1])
    return np.stack([starts, offsets[:, 1]], axis=1)


def before_trailing_space(non_space: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """For each end position, one past the last non-whitespace character before it (0: none)."""
    left = np.concatenate([[-1], non_space])
    return left[np.searchsorted(left, ends) - 1] + 1


def stripped_ranges(text: str, offsets: np.ndarray) -> np.ndarray:
    """``[tokens, 2]`` each token's character range with leading *and* trailing whitespace
    stripped (a whitespace-only or ``(0, 0)`` token: an empty range, start == end).

    A token such as ``".\n\n"`` (Qwen) ends on its last visible character, so it fits a span
    whose own trailing whitespace is stripped (:func:`boundary_spans`)."""
    visible = visible_ranges(text, offsets)
    ends = np.maximum(before_trailing_space(_non_space(text), visible[:, 1]), visible[:, 0])
    return np.stack([visible[:, 0], ends], axis=1)


def boundary_spans(
    text: str, teacher_offsets: np.ndarray, student_offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The spans both tokenisations of ``text`` agree on (SRA, docs/method.md §1).

    Each token's range is stripped of leading and trailing whitespace (:func:`stripped_ranges`;
    whitespace-only and special tokens drop out). A position is a *boundary* of one side when a
    non-empty stripped token range starts there and no other one of that side strictly contains
    it (byte-level tokens that split a character overlap on it: the second one's start is not a
    boundary); a *common boundary* is a boundary of both sides. The spans run from each common
    boundary to the next one (the last to the end of the text), trailing whitespace stripped:
    the finest segmentation both tokenizers respect. Their token range on a side is
    ``[first, last + 1)`` of the tokens whose stripped range lies inside them: never empty (a
    token of each side starts on the span's boundary), and a token never crosses a span edge (it
    would strictly contain the next boundary). With the same tokenizer on both sides the spans
    are the tokens (tokens sharing one range — pieces of one character — share its span).

    teacher_offsets, student_offsets: ``[tokens, 2]`` character ranges into ``text`` (EOS, if
    any, at ``(0, 0)`` or left out). Returns ``(chars, teacher, student)``, each ``[spans, 2]``
    int64 half-open ranges, ordered by position, not overlapping.
    """
    length = len(text)
    non_space = _non_space(text)
    ranges, is_boundary = [], np.ones(length + 1, dtype=bool)
    for offsets in (teacher_offsets, student_offsets):  # the two sides, not the tokens
        # A stripped range ends by len(text) (on a visible character); a negative offset reads as 0.
        stripped = np.maximum(stripped_ranges(text, offsets), 0)
        ranges.append(stripped)
        real = stripped[stripped[:, 0] < stripped[:, 1]]
        starts = np.zeros(length + 1, dtype=bool)
        starts[real[:, 0]] = True
        # +1 after each start, -1 at each end: positions strictly inside a token count > 0.
        inside = (
            np.cumsum(
                np.bincount(real[:, 0] + 1, minlength=length + 2)  # starts < ends <= length
                - np.bincount(real[:, 1], minlength=length + 2)
            )[: length + 1]
            > 0
        )
        is_boundary &= starts & ~inside
    begins = np.flatnonzero(is_boundary)
    ends = before_trailing_space(non_space, np.append(begins[1:], length)[: len(begins)])
    spans = np.stack([begins, ends], axis=1)

    token_spans = []
    for stripped in ranges:
        # The span each non-empty token starts in (and ends in: it crosses no span edge).
        span_of = np.searchsorted(begins, stripped[:, 0], side="right") - 1
        tokens = np.flatnonzero((stripped[:, 0] < stripped[:, 1]) & (span_of >= 0))
        first = np.full_like(begins, np.iinfo(np.int64).max)
        stop = np.zeros_like(begins)
        np.minimum.at(first, span_of[tokens], tokens)
        np.maximum.at(stop, span_of[tokens], tokens + 1)
        token_spans.append(np.stack([first, stop], axis=1))
    return spans, token_spans[0], token_spans[1]


def membership_ranges(text: str, offsets: np.ndarray, rule: SpanRule = "paper") -> np.ndarray:
    """``[tokens, 2]`` the ranges :func:`member_ranges` compares with spans under ``rule``: the
    visible ranges (``"paper"``) or the raw offsets (``"reference"``); another rule: ValueError."""
    _check_rule(rule)
    if rule == "reference":
        return _ranges(offsets)
    return visible_ranges(text, offsets)


def member_ranges(
    visible: np.ndarray, spans: np.ndarray, rule: SpanRule = "paper"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ranges of ``spans`` given the tokens' ``visible`` ranges (see :func:`token_ranges`);
    with ``rule="reference"`` ``visible`` holds the raw offsets (:func:`membership_ranges`).
    Another rule: ValueError."""
    _check_rule(rule)
    spans = _ranges(spans)
    if len(visible) == 0 or len(spans) == 0:
        empty = np.zeros(len(spans), dtype=np.int64)
        return empty, empty, np.zeros(len(spans), dtype=bool)
    starts, ends = visible[:, 0], visible[:, 1]
    # member: [spans, tokens]
    if rule == "reference":  # the authors' `offset_start + 1 >= a and offset_end <= b`
        member = (starts[None, :] + 1 >= spans[:, :1]) & (ends[None, :] <= spans[:, 1:])
    else:
        member = (starts < ends)[None, :] & (spans[:, :1] <= starts[None, :]) & (ends[None, :] <= spans[:, 1:])
    found = member.any(axis=1)
    first = member.argmax(axis=1)
    last = member.shape[1] - 1 - member[:, ::-1].argmax(axis=1)
    return first, last + 1, found


def token_ranges(
    text: str, offsets: np.ndarray, spans: np.ndarray, rule: SpanRule = "paper"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Map character spans to half-open token ranges.

    offsets: ``[tokens, 2]`` character ranges of the tokens of ``text`` (EOS not included).
    spans: ``[spans, 2]`` half-open character ranges. rule: the membership rule (module docstring).
    Returns ``(start [spans], end [spans], found [spans])``; start/end are meaningless where
    ``found`` is False (no token belongs to the span).
    """
    return member_ranges(membership_ranges(text, offsets, rule), spans, rule)


def prompt_token_count(offsets: np.ndarray, prompt_chars: int) -> int:
    """Tokens whose character range starts before the end of the prompt (docs/method.md §1).

    A token straddling the prompt/response boundary belongs to the prompt.
    """
    offsets = _ranges(offsets)
    return int(np.count_nonzero(offsets[:, 0] < prompt_chars))


def unit_counts(teacher_ranges: np.ndarray, student_ranges: np.ndarray, response: np.ndarray) -> dict[str, int]:
    """How the aligned units (``boundary_spans``) of some rows cover their response tokens.

    teacher_ranges, student_ranges: ``[units, 2]`` half-open token ranges of the units (any number
    of rows, flattened); response: ``[units]`` bool, the units a response loss reads. Returns
    counts over the response units: ``units``, ``single_token_units`` (one token on both sides),
    and per side ``<side>_tokens`` (tokens inside them) and ``<side>_tokens_in_single`` (inside
    single-token units). The share of a side's positions in single-token units is the ratio of
    its last two counts.
    """
    teacher_sizes = np.diff(_ranges(teacher_ranges), axis=1)[:, 0][response]
    student_sizes = np.diff(_ranges(student_ranges), axis=1)[:, 0][response]
    single = (teacher_sizes == 1) & (student_sizes == 1)
    return {
        "units": int(single.size),
        "single_token_units": int(single.sum()),
        "student_tokens": int(student_sizes.sum()),
        "student_tokens_in_single": int(single.sum()),
        "teacher_tokens": int(teacher_sizes.sum()),
        "teacher_tokens_in_single": int(single.sum()),
    }
