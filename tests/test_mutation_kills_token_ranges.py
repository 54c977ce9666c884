"""``mta.data.token_ranges`` on the edges mutation testing (bench/mutation.py) found unchecked:
every kind of whitespace ``str.isspace`` knows (U+3000, the highest, included; U+3001 is not
one), texts without tokens, batches without spans, and the types of what comes back.
References loop over characters and tokens with plain python.
"""

from __future__ import annotations

import numpy as np

from mta.data.token_ranges import member_ranges, prompt_token_count, token_ranges, visible_ranges

SPACES = [chr(c) for c in range(0x3001) if chr(c).isspace()]  # \t \n ... U+2028 U+3000


def reference_visible(text: str, offsets) -> list[list[int]]:
    out = []
    for start, end in offsets:
        first = start
        while first < end and text[first].isspace():
            first += 1
        out.append([first, end])
    return out


def reference_ranges(text: str, offsets, spans) -> list:
    found = []
    for a, b in spans:
        members = [
            i
            for i, (start, end) in enumerate(reference_visible(text, offsets))
            if start < end and a <= start and end <= b
        ]
        found.append((members[0], members[-1] + 1) if members else None)
    return found


def test_visible_ranges_skip_exactly_the_characters_str_isspace_calls_whitespace():
    assert "\u3000" in SPACES and "\u3001" not in SPACES
    rng = np.random.default_rng(7)
    alphabet = SPACES + list("ab,.") + ["\u3001", "\u2fff", "茶", "👋", "\u3002"]
    for _ in range(20):
        text = "".join(rng.choice(alphabet, size=60))
        cuts = np.sort(rng.choice(np.arange(1, 60), size=14, replace=False))
        bounds = [0, *cuts.tolist(), 60]
        offsets = np.array([[a, b] for a, b in zip(bounds, bounds[1:], strict=False)])  # consecutive pairs
        assert visible_ranges(text, offsets).tolist() == reference_visible(text, offsets.tolist()), text
        spans = [
            [int(a), int(min(a + w, 60))] for a, w in zip(rng.integers(0, 60, 12), rng.integers(1, 30, 12), strict=True)
        ]
        start, end, found = token_ranges(text, offsets, np.array(spans))
        expected = reference_ranges(text, offsets.tolist(), spans)
        assert found.tolist() == [e is not None for e in expected]
        assert [(s, e) for s, e, f in zip(start.tolist(), end.tolist(), found.tolist(), strict=True) if f] == [
            e for e in expected if e
        ]


def test_the_ideographic_space_is_whitespace_and_the_ideographic_comma_is_not():
    assert visible_ranges("x\u3000y", [[1, 3]]).tolist() == [[2, 3]]
    assert visible_ranges("x\u3001y", [[1, 3]]).tolist() == [[1, 3]]


def test_a_text_without_tokens_or_a_batch_without_spans_finds_nothing_and_keeps_the_types():
    usual = token_ranges("ab", np.array([[0, 1], [1, 2]]), np.array([[0, 2]]))
    kinds = [a.dtype.kind for a in usual]
    assert kinds == ["i", "i", "b"]
    no_tokens = token_ranges("", np.zeros((0, 2), dtype=np.int64), np.array([[0, 1], [0, 0]]))
    assert [a.shape for a in no_tokens] == [(2,)] * 3 and no_tokens[2].tolist() == [False, False]
    assert [a.dtype.kind for a in no_tokens] == kinds
    no_spans = token_ranges("ab", np.array([[0, 1], [1, 2]]), np.zeros((0, 2), dtype=np.int64))
    assert [a.shape for a in no_spans] == [(0,)] * 3 and [a.dtype.kind for a in no_spans] == kinds
    # Neither empty: one token and one span are an ordinary case.
    start, end, found = member_ranges(np.array([[0, 1]]), np.array([[0, 1]]))
    assert (start.tolist(), end.tolist(), found.tolist()) == ([0], [1], [True])
    start, end, found = token_ranges("abc", np.array([[0, 1], [1, 3]]), [[0, 3]])
    assert (start.tolist(), end.tolist(), found.tolist()) == ([0], [2], [True])


def test_prompt_token_count_takes_plain_lists_and_empty_offsets():
    assert prompt_token_count([], 5) == 0
    assert prompt_token_count([[0, 2], [2, 4], [4, 6]], 3) == 2
