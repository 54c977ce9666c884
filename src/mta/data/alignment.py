"""Character spans to token ranges, by the membership rule of METHOD.md section 1.

A token belongs to span ``[a, b)`` when its character range, with leading whitespace stripped, is
non-empty and lies inside ``[a, b)``; the span's token range is ``[first member, last member + 1)``.
Byte-level BPE ("Ġword") and SentencePiece ("▁word") tokens carry the space before a word, which
is why the leading whitespace is stripped; a whitespace-only token or a special token (offsets
``(0, 0)``) belongs to no span.
"""

from __future__ import annotations

import numpy as np

# Every code point Python's str.isspace() accepts (the highest is U+3000).
_WHITESPACE = np.array([code for code in range(0x3001) if chr(code).isspace()], dtype=np.uint32)


def stripped_starts(text: str, offsets: np.ndarray) -> np.ndarray:
    """``[tokens]`` start of each token's character range after skipping leading whitespace.

    offsets: ``[tokens, 2]`` character ranges into ``text``. A token that is only whitespace gets
    its end as start (an empty range).
    """
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    non_space = np.flatnonzero(~np.isin(codes, _WHITESPACE))
    # Position of the first non-space character at or after each token's start (len(text) if none).
    following = np.searchsorted(non_space, offsets[:, 0])
    first_visible = np.append(non_space, len(text))[following]
    return np.minimum(first_visible, offsets[:, 1])


def token_ranges(
    text: str, offsets: np.ndarray, spans: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Map character spans to half-open token ranges.

    offsets: ``[tokens, 2]`` character ranges of the tokens of ``text`` (EOS not included).
    spans: ``[spans, 2]`` half-open character ranges.
    Returns ``(start [spans], end [spans], found [spans])``; start/end are meaningless where
    ``found`` is False (no token belongs to the span).
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if len(offsets) == 0 or len(spans) == 0:
        empty = np.zeros(len(spans), dtype=np.int64)
        return empty, empty, np.zeros(len(spans), dtype=bool)
    starts = stripped_starts(text, offsets)
    ends = offsets[:, 1]
    visible = starts < ends
    # member: [spans, tokens]
    member = (
        visible[None, :]
        & (spans[:, :1] <= starts[None, :])
        & (ends[None, :] <= spans[:, 1:])
    )
    found = member.any(axis=1)
    first = member.argmax(axis=1)
    last = member.shape[1] - 1 - member[:, ::-1].argmax(axis=1)
    return first, last + 1, found


def prompt_token_count(offsets: np.ndarray, prompt_chars: int) -> int:
    """Tokens whose character range starts before the end of the prompt (METHOD.md section 1).

    A token straddling the prompt/response boundary belongs to the prompt.
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    return int(np.count_nonzero(offsets[:, 0] < prompt_chars))
