"""``mta.data.token_ranges`` where mutation testing (bench/mutation.py) had labelled mutants
"equivalent" or found them unpinned: offsets given as an empty plain list (they are read as int64
ranges), the membership rules (the module docstring's: "paper" is the default, the authors'
"reference" takes a token ``(s, e)`` into ``[a, b)`` when ``s + 1 >= a and e <= b``), a rule
neither names (refused), trailing whitespace stripped from a token's range, and a whitespace-only
token beside the other side's word in boundary spans.

Expected values are worked out by hand from the module docstring.
"""

from __future__ import annotations

import numpy as np
import pytest

from mta.data.token_ranges import (
    before_trailing_space,
    boundary_spans,
    member_ranges,
    membership_ranges,
    stripped_ranges,
    token_ranges,
)

# "a", the newline, "Jupiter", " is": the newline ends where the span of "Jupiter" begins.
TEXT = "a\nJupiter is"
OFFSETS = [[0, 1], [1, 2], [2, 9], [9, 12]]
JUPITER = [[2, 9]]


def test_a_side_given_an_empty_list_of_offsets_has_no_token_so_no_span():
    """A side with no token has no token in any span, and a span one side has no token in is
    dropped: nothing is left, as three empty ``[0, 2]`` integer arrays."""
    for teacher, student in (([[0, 2]], []), ([], [[0, 2]]), ([], [])):
        result = boundary_spans("ab", teacher, student)
        assert [part.shape for part in result] == [(0, 2)] * 3
        assert [part.dtype.kind for part in result] == ["i"] * 3


def test_the_reference_rule_takes_in_the_token_ending_where_the_span_begins():
    """(1, 2) "\\n": 1 + 1 >= 2 and 2 <= 9, a member; (0, 1): 0 + 1 < 2, not one; (2, 9) ends at
    the span's end, a member; (9, 12) ends past it. Under the paper rule the newline has no
    visible character and belongs to no span."""
    start, end, found = token_ranges(TEXT, np.array(OFFSETS), JUPITER, rule="reference")
    assert (start.tolist(), end.tolist(), found.tolist()) == ([1], [3], [True])
    start, end, found = token_ranges(TEXT, np.array(OFFSETS), JUPITER)
    assert (start.tolist(), end.tolist(), found.tolist()) == ([2], [3], [True])


def test_the_reference_rule_reads_the_raw_offsets_not_the_visible_ranges():
    """Token (1, 4) is "  b": its raw start 1 + 1 < 3, so under the reference rule it is not in
    the span [3, 4) of "b", although its visible range (3, 4) is (the paper rule's member)."""
    _, _, found = token_ranges("a  b", [[0, 1], [1, 4]], [[3, 4]], rule="reference")
    assert found.tolist() == [False]
    start, end, found = token_ranges("a  b", [[0, 1], [1, 4]], [[3, 4]])
    assert (start.tolist(), end.tolist(), found.tolist()) == ([1], [2], [True])


def test_membership_ranges_are_the_visible_ranges_by_default_and_the_raw_offsets_for_the_reference_rule():
    visible = [[0, 1], [2, 2], [2, 9], [10, 12]]  # the newline: empty; " is": from "i"
    assert membership_ranges(TEXT, OFFSETS).tolist() == visible
    assert membership_ranges(TEXT, OFFSETS, "paper").tolist() == visible
    assert membership_ranges(TEXT, OFFSETS, "reference").tolist() == OFFSETS
    start, end, found = member_ranges(np.array(OFFSETS), JUPITER, "reference")
    assert (start.tolist(), end.tolist(), found.tolist()) == ([1], [3], [True])


@pytest.mark.parametrize("rule", ["authors", "Paper", None])
def test_a_rule_neither_documented_name_names_is_refused(rule):
    message = rf"^the span rule must be one of \('paper', 'reference'\), not {rule!r}$"
    with pytest.raises(ValueError, match=message):
        token_ranges(TEXT, OFFSETS, JUPITER, rule=rule)
    with pytest.raises(ValueError, match=message):
        member_ranges(np.array(OFFSETS), JUPITER, rule)
    with pytest.raises(ValueError, match=message):
        membership_ranges(TEXT, OFFSETS, rule)


def test_one_past_the_last_visible_character_before_each_end_is_zero_when_there_is_none():
    """Visible characters at 1 and 4: before 0 and 1 there is none (0), before 2..4 the one at 1
    (2), before 5 and 6 the one at 4 (5)."""
    ends = before_trailing_space(np.array([1, 4]), np.array([0, 1, 2, 4, 5, 6]))
    assert ends.tolist() == [0, 0, 2, 2, 5, 5]


def test_a_stripped_range_ends_on_the_tokens_last_visible_character():
    """The stripped_ranges docstring's Qwen token ".\n\n" of "Stop.\n\nGo" ends after the ".";
    "\nGo" would start at "G"; a whitespace-only token is empty (start == end)."""
    assert stripped_ranges("Stop.\n\nGo", [[0, 4], [4, 7], [7, 9]]).tolist() == [[0, 4], [4, 5], [7, 9]]
    stop, dot, newline, go = stripped_ranges("Stop.\n\nGo", [[0, 4], [4, 5], [5, 6], [6, 9]]).tolist()
    assert (stop, dot, go) == ([0, 4], [4, 5], [7, 9]) and newline[0] == newline[1]


def test_a_whitespace_only_token_starts_no_boundary_where_the_other_side_starts_a_word():
    """Teacher tokens "ab" and " " (empty once stripped), student "ab" and " cd" (from "c"): the
    only common boundary is 0, so one span runs over the whole text, holding the teacher's token
    0 and the student's tokens 0 and 1."""
    chars, teacher, student = boundary_spans("ab cd", [[0, 2], [2, 3]], [[0, 2], [2, 5]])
    assert (chars.tolist(), teacher.tolist(), student.tolist()) == ([[0, 5]], [[0, 1]], [[0, 2]])


def test_a_start_strictly_inside_a_token_of_one_side_is_no_boundary():
    """Byte-level tokens that split 🎉 (position 1) overlap on it: the teacher's "a🎉" (0, 2)
    strictly contains 1, where both sides start a token, so 1 is no boundary; 0 and 2 are. The
    spans are "a🎉" and "cd", each with the tokens that start in it."""
    text = "a\U0001f389cd"
    chars, teacher, student = boundary_spans(text, [[0, 2], [1, 2], [2, 4]], [[0, 1], [1, 2], [2, 4]])
    assert chars.tolist() == [[0, 2], [2, 4]]
    assert teacher.tolist() == student.tolist() == [[0, 2], [2, 3]]
