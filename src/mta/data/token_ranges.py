"""Character spans to token ranges, by the membership rule of docs/method.md §1.

A token belongs to span ``[a, b)`` when its character range, with leading whitespace stripped, is
non-empty and lies inside ``[a, b)``; the span's token range is ``[first member, last member + 1)``.
Byte-level BPE ("Ġword") and SentencePiece ("▁word") tokens carry the space before a word, which
is why the leading whitespace is stripped; a whitespace-only token or a special token (offsets
``(0, 0)``) belongs to no span.
"""

from __future__ import annotations

import numpy as np

# Whether each code point up to U+3000 (the highest one str.isspace() accepts) is whitespace.
_IS_SPACE = np.array([chr(code).isspace() for code in range(0x3001)], dtype=bool)


def visible_ranges(text: str, offsets: np.ndarray) -> np.ndarray:
    """``[tokens, 2]`` each token's character range with its leading whitespace skipped.

    offsets: ``[tokens, 2]`` character ranges into ``text``. A token that is only whitespace, or a
    special token at ``(0, 0)``, gets an empty range (start == end).
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    is_space = (codes <= 0x3000) & _IS_SPACE[np.minimum(codes, 0x3000)]
    non_space = np.append(np.flatnonzero(~is_space), len(text))
    # The first visible character at or after each token's start, but never past its end.
    starts = np.minimum(non_space[np.searchsorted(non_space, offsets[:, 0])], offsets[:, 1])
    return np.stack([starts, offsets[:, 1]], axis=1)


def member_ranges(visible: np.ndarray, spans: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ranges of ``spans`` given the tokens' ``visible`` ranges (see :func:`token_ranges`)."""
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if len(visible) == 0 or len(spans) == 0:
        empty = np.zeros(len(spans), dtype=np.int64)
        return empty, empty, np.zeros(len(spans), dtype=bool)
    starts, ends = visible[:, 0], visible[:, 1]
    # member: [spans, tokens]
    member = (
        (starts < ends)[None, :]
        & (spans[:, :1] <= starts[None, :])
        & (ends[None, :] <= spans[:, 1:])
    )
    found = member.any(axis=1)
    first = member.argmax(axis=1)
    last = member.shape[1] - 1 - member[:, ::-1].argmax(axis=1)
    return first, last + 1, found


def token_ranges(
    text: str, offsets: np.ndarray, spans: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Map character spans to half-open token ranges.

    offsets: ``[tokens, 2]`` character ranges of the tokens of ``text`` (EOS not included).
    spans: ``[spans, 2]`` half-open character ranges.
    Returns ``(start [spans], end [spans], found [spans])``; start/end are meaningless where
    ``found`` is False (no token belongs to the span).
    """
    return member_ranges(visible_ranges(text, offsets), spans)


def prompt_token_count(offsets: np.ndarray, prompt_chars: int) -> int:
    """Tokens whose character range starts before the end of the prompt (docs/method.md §1).

    A token straddling the prompt/response boundary belongs to the prompt.
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    return int(np.count_nonzero(offsets[:, 0] < prompt_chars))
