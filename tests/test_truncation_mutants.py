"""``mta.data.truncation`` at its exact limits, its messages and its encoding cost: the cases
mutation testing (bench/mutation.py) found unchecked.

Token counts come from ``transformers`` (``AutoTokenizer`` with offsets), not from the Rust
backend or from ``mta.data.token_ranges``; a prompt token is one starting before the end of the
prompt (docs/method.md §1). Where the windows, the cut search's probes and its estimate are
pinned (the module docstring's rules), the sides are regex tokenizers (:class:`RegexSide`) whose
tokens are worked out by hand, including whitespace in no token, a word straddling the prompt's
end, and a token whose prefixes split into characters.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from transformers import AutoTokenizer

from mta.data import truncation
from mta.data.encoding import Encoding, TokenizerSide
from mta.data.truncation import FittedText, PromptTooLong, fit_to_limits, last_fitting_cut

PROMPT = "Instruction: tell me why the river flows down to the sea, in a few words.\n\nAnswer: "
RESPONSE = "Because water runs downhill, pulled by gravity, until it reaches the lowest place."


@pytest.fixture
def sides(tiny_tokenizer_dir, other_tokenizer_dir):
    return TokenizerSide.load(tiny_tokenizer_dir), TokenizerSide.load(other_tokenizer_dir)


@pytest.fixture
def references(tiny_tokenizer_dir, other_tokenizer_dir):
    return [AutoTokenizer.from_pretrained(str(d)) for d in (tiny_tokenizer_dir, other_tokenizer_dir)]


def reference_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reference_prompt_tokens(tokenizer, text: str, prompt_chars: int) -> int:
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return sum(1 for start, _ in offsets if start < prompt_chars)


def expected_message(tokens: int, side: str, limit: int, at_least: bool = False) -> str:
    return (
        f"the prompt is {'at least ' if at_least else ''}{tokens} tokens for the {side}, over "
        f"--max-prompt-length {limit} (pass --truncate-prompt to keep its head instead of skipping the row)"
    )


def test_the_eos_slot_decides_completeness_at_the_exact_limit(sides, references):
    text = PROMPT + RESPONSE
    counts = [len(reference_ids(r, text)) for r in references]
    prompt_limit = max(reference_prompt_tokens(r, text, len(PROMPT)) for r in references)
    longest = max(counts)
    assert len(set(counts)) == 2  # one side reaches the limit first; the other stays under it

    # Room for every id and the EOS: whole and complete.
    fitted = fit_to_limits(PROMPT, RESPONSE, sides, max_length=longest + 1, max_prompt_length=prompt_limit)
    assert isinstance(fitted, FittedText) and fitted.text == text
    assert fitted.complete is True and fitted.response_cut is False and fitted.prompt_cut is False
    assert [e.ids.tolist() for e in fitted.encodings] == [reference_ids(r, text) for r in references]

    # Room for every id but not the EOS: the whole text, marked cut (it gets no EOS).
    fitted = fit_to_limits(PROMPT, RESPONSE, sides, max_length=longest, max_prompt_length=prompt_limit)
    assert fitted.text == text and fitted.complete is False and fitted.response_cut is True
    assert fitted.prompt_cut is False
    assert [e.ids.tolist() for e in fitted.encodings] == [reference_ids(r, text) for r in references]

    # One id fewer: the longest prefix within the limit on both sides.
    fitted = fit_to_limits(PROMPT, RESPONSE, sides, max_length=longest - 1, max_prompt_length=prompt_limit)
    assert fitted.complete is False and len(fitted.text) < len(text)
    assert max(len(reference_ids(r, fitted.text)) for r in references) <= longest - 1
    assert max(len(reference_ids(r, text[: len(fitted.text) + 1])) for r in references) > longest - 1


@pytest.mark.parametrize("swap", [False, True], ids=["student-worst", "teacher-worst"])
def test_a_prompt_at_the_limit_is_kept_and_one_over_is_refused_naming_the_side(sides, references, swap):
    if swap:
        sides, references = sides[::-1], references[::-1]
    text = PROMPT + RESPONSE
    prompt_counts = [reference_prompt_tokens(r, text, len(PROMPT)) for r in references]
    worst = max(range(2), key=lambda i: prompt_counts[i])
    assert prompt_counts[worst] > prompt_counts[1 - worst]
    limit = prompt_counts[worst]

    kept = fit_to_limits(PROMPT, RESPONSE, sides, max_length=200, max_prompt_length=limit)
    assert isinstance(kept, FittedText) and kept.text == text and kept.prompt_cut is False and kept.complete

    refused = fit_to_limits(PROMPT, RESPONSE, sides, max_length=200, max_prompt_length=limit - 1)
    assert isinstance(refused, PromptTooLong)
    assert (refused.tokens, refused.side, refused.limit, refused.at_least) == (
        limit,
        ("teacher", "student")[worst],
        limit - 1,
        False,
    )
    assert refused.message == expected_message(limit, ("teacher", "student")[worst], limit - 1)
    named = fit_to_limits(PROMPT, RESPONSE, sides, max_length=200, max_prompt_length=limit - 1, roles=("left", "right"))
    assert named.side == ("left", "right")[worst]


def test_a_prompt_without_response_is_counted_exactly(sides, references):
    """Every token is a prompt token: the count is still exact (the whole text was encoded)."""
    counts = [len(reference_ids(r, PROMPT)) for r in references]
    refused = fit_to_limits(PROMPT, "", sides, max_length=200, max_prompt_length=10)
    worst = max(range(2), key=lambda i: counts[i])
    assert refused.message == expected_message(counts[worst], ("teacher", "student")[worst], 10)


def _long_prompt_row(references, length: int) -> tuple[str, str]:
    """A prompt of about 600 characters and a response that makes the text ``length`` long."""
    prompt = ("Summarise the following notes about rivers and rain. " * 12)[:600] + "\n\nAnswer: "
    response = ("The rain falls, the rivers fill and the water returns to the sea. " * 40)[: length - len(prompt)]
    assert len(prompt + response) == length
    return prompt, response


def test_a_too_long_prompt_is_counted_exactly_whenever_the_first_window_holds_the_whole_text(sides, references):
    """The first window encodes max_length * WINDOW_CHARS_PER_TOKEN + LOCALITY_CHARS characters:
    a text up to that long (the boundary included) is encoded whole and its count is exact; a
    longer one may report a lower bound ("at least"), which is then still over the limit and
    never above the true count."""
    max_length, limit = 8, 4
    boundary = max_length * truncation.WINDOW_CHARS_PER_TOKEN + truncation.LOCALITY_CHARS
    for length in (700, boundary - 1, boundary):
        prompt, response = _long_prompt_row(references, length)
        counts = [reference_prompt_tokens(r, prompt + response, len(prompt)) for r in references]
        worst = max(range(2), key=lambda i: counts[i])
        refused = fit_to_limits(prompt, response, sides, max_length=max_length, max_prompt_length=limit)
        assert refused.message == expected_message(counts[worst], ("teacher", "student")[worst], limit), length

    prompt = ("Summarise the following notes about rivers and rain. " * 60) + "\n\nAnswer: "
    counts = [reference_prompt_tokens(r, prompt + "Rain.", len(prompt)) for r in references]
    refused = fit_to_limits(prompt, "Rain.", sides, max_length=max_length, max_prompt_length=limit)
    assert refused.at_least and refused.message.startswith("the prompt is at least ")
    assert limit < refused.tokens <= counts[("teacher", "student").index(refused.side)]


@pytest.fixture
def encoded(monkeypatch):
    """The length of every text a TokenizerSide encodes, in order."""
    lengths: list[int] = []
    encode = TokenizerSide.encode

    def recording(self, text):
        lengths.append(len(text))
        return encode(self, text)

    monkeypatch.setattr(TokenizerSide, "encode", recording)
    return lengths


def test_an_ordinary_row_is_encoded_once_per_tokenizer(sides, encoded):
    fitted = fit_to_limits(PROMPT, RESPONSE, sides, max_length=200, max_prompt_length=100)
    assert isinstance(fitted, FittedText) and fitted.complete
    assert encoded == [len(PROMPT + RESPONSE)] * 2
    encoded.clear()
    # One tokenizer on both sides encodes once.
    fitted = fit_to_limits(PROMPT, RESPONSE, (sides[0], sides[0]), max_length=200, max_prompt_length=100)
    assert encoded == [len(PROMPT + RESPONSE)]
    assert fitted.encodings[0].ids.tolist() == fitted.encodings[1].ids.tolist()


@pytest.mark.parametrize("max_length", [8, 64])
def test_a_long_row_is_only_encoded_through_its_first_window(sides, encoded, max_length):
    """Whatever the row's length, a decision reached in the first window never encodes more than
    max_length * WINDOW_CHARS_PER_TOKEN + LOCALITY_CHARS characters of it."""
    window = max_length * truncation.WINDOW_CHARS_PER_TOKEN + truncation.LOCALITY_CHARS
    long_prompt = "Summarise the following notes about rivers and rain. " * 400  # ~21k characters
    refused = fit_to_limits(long_prompt, "Done.", sides, max_length=max_length, max_prompt_length=max_length // 2)
    assert isinstance(refused, PromptTooLong)
    assert encoded and max(encoded) <= window
    encoded.clear()
    fitted = fit_to_limits("Q: ", RESPONSE * 250, sides, max_length=max_length, max_prompt_length=max_length // 2)
    assert isinstance(fitted, FittedText) and fitted.complete is False
    assert encoded and max(encoded) <= window


# ---------------------------------------------------------------- tokenizers whose tokens are known by hand


class RegexSide:
    """A tokenizer side whose tokens are the matches of ``pattern`` (``\\S+``: one token a word,
    whitespace in no token, as a WordPiece pre-tokenizer drops it); records each encoded length."""

    def __init__(self, pattern: str) -> None:
        self.pattern = re.compile(pattern)
        self.encoded: list[int] = []

    def encode(self, text: str) -> Encoding:
        self.encoded.append(len(text))
        spans = [match.span() for match in self.pattern.finditer(text)]
        return Encoding(np.arange(len(spans), dtype=np.int32), np.array(spans, dtype=np.int64).reshape(-1, 2))


@pytest.mark.parametrize(
    ("head", "windows", "known"),
    [
        # max_length 1 needs 2 known tokens; the first window knows the text up to 16 characters
        # (1 x WINDOW_CHARS_PER_TOKEN) and encodes 16 + LOCALITY_CHARS of it. "bbbbbbbb" ends at
        # exactly 16: both words are known and the first window decides.
        ("aaaaaaa bbbbbbbb" + " cc" * 1000, [1016], 2),
        # "bbbbbbbb" ends at 17: one known word; the window grows 4x to 64 characters, where
        # "aaaaaaaa", "bbbbbbbb" and the 15 "cc" ending by 64 (at 20, 23, ..., 62) are known.
        ("aaaaaaaa bbbbbbbb" + " cc" * 1000, [1016, 1064], 17),
        # Only whitespace after 16 in the first window: no token ends beyond 16, so all its tokens
        # are known (2) and it decides.
        ("aaaaaaa bbbbbbbb" + " " * 3000 + "cc dd", [1016], 2),
    ],
    ids=["token-ends-at-the-window", "window-grows-4x", "whitespace-to-the-window-end"],
)
def test_a_long_prompt_is_refused_on_the_tokens_its_first_sufficient_window_knows(head, windows, known):
    """Module docstring: the first window holds max_length x WINDOW_CHARS_PER_TOKEN characters,
    grown 4x until it knows max_length + 1 tokens on every side; a token is known once it ends
    within it. A prompt over the limit there is refused with that lower bound ("at least")."""
    side = RegexSide(r"\S+")
    refused = fit_to_limits(head, "", [side], max_length=1, max_prompt_length=1)
    assert refused == PromptTooLong(known, "teacher", 1, at_least=True)
    assert side.encoded == windows


def test_the_cut_search_confirms_an_exact_estimate_with_two_probes_and_gallops_by_doubling_steps():
    """last_fitting_cut starts at the estimate and gallops (steps 1, 2, 4, ...) until a probe does
    not fit, then bisects: an exact estimate costs the estimate and the next character."""
    probes: list[int] = []

    def fits(cut: int) -> bool:
        probes.append(cut)
        return cut <= 40

    assert last_fitting_cut("x" * 100, 0, 40, fits) == 40
    assert probes == [40, 41]
    probes.clear()
    assert last_fitting_cut("x" * 100, 0, 10, fits) == 40
    assert probes == [10, 11, 13, 17, 25, 41, 33, 37, 39, 40]  # gallop to 41, then bisect 25..41


def test_a_response_cut_starts_where_the_limit_th_token_ends_and_costs_two_encodes():
    """One token a character: the 10th token ends at 10, which fits, and 11 does not. Besides the
    whole text (29 characters, one window), only those two prefixes are encoded."""
    side = RegexSide(r"(?s).")
    fitted = fit_to_limits("Q: ", "abcdefghijklmnopqrstuvwxyz", [side], max_length=10, max_prompt_length=5)
    assert isinstance(fitted, FittedText) and fitted.text == "Q: abcdefg" and fitted.complete is False
    assert side.encoded == [29, 10, 11]


def test_a_text_at_max_length_without_room_for_eos_is_kept_whole_after_one_check():
    """No side has more than max_length tokens, so the cut search starts at the end of the text,
    not at the end of the last token (the trailing spaces belong to no token)."""
    side = RegexSide(r"\S+")
    text = "Q: one two three   "
    fitted = fit_to_limits("Q:", text[2:], [side], max_length=4, max_prompt_length=4)
    assert isinstance(fitted, FittedText) and fitted.text == text and fitted.complete is False
    assert side.encoded == [len(text), len(text)]


def test_a_prompt_cut_counts_a_word_that_straddles_the_cut_and_ends_far_into_the_response():
    """Prompt "a b " + 600 x, response 300 y then 10,000 " z"; at most 2 prompt tokens. A cut
    inside the x's leaves a third prompt token (x..xy..y) that ends more than
    PROMPT_PROBE_CHARS past the cut: it still counts, so the prompt keeps "a b ". The response
    is then cut after 50 tokens: a, b, the y's and 47 z's (the 47th ends at 398, a space follows).
    No encode is longer than the row's second head window (4 x 50 x 16 + LOCALITY_CHARS)."""
    side = RegexSide(r"\S+")
    prompt, response = "a b " + "x" * 600, "y" * 300 + " z" * 10_000
    fitted = fit_to_limits(prompt, response, [side], max_length=50, max_prompt_length=2, truncate_prompt=True)
    assert isinstance(fitted, FittedText) and fitted.prompt_cut and fitted.complete is False
    assert (fitted.prompt_chars, fitted.text) == (4, ("a b " + response)[:399])
    assert max(side.encoded) <= 4 * 50 * truncation.WINDOW_CHARS_PER_TOKEN + truncation.LOCALITY_CHARS


def test_a_prompt_limit_of_zero_with_truncation_keeps_no_prompt():
    side = RegexSide(r"\S+")
    fitted = fit_to_limits("abc def", " ghi", [side], max_length=100, max_prompt_length=0, truncate_prompt=True)
    assert isinstance(fitted, FittedText)
    assert (fitted.text, fitted.prompt_chars, fitted.prompt_cut, fitted.complete) == (" ghi", 0, True, True)


def test_a_cut_at_the_end_of_the_prompt_that_the_search_never_probed_is_encoded_for_the_result():
    """Side B has one token for "abcdef q r" but splits any prefix of it into characters, so every
    cut after "p a" is over max_length 2 on B (the whole text is over on A, 4 words): the cut is the
    prompt's end, where both sides have the 2 tokens "p", "a"."""
    words, merged = RegexSide(r"\S+"), RegexSide(r"abcdef q r|\S")
    fitted = fit_to_limits("p a", "bcdef q r", [words, merged], max_length=2, max_prompt_length=2)
    assert isinstance(fitted, FittedText) and fitted.text == "p a" and fitted.complete is False
    assert [encoding.offsets.tolist() for encoding in fitted.encodings] == [[[0, 1], [2, 3]]] * 2
