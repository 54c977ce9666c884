"""``mta.data.truncation`` at its exact limits, its messages and its encoding cost: the cases
mutation testing (bench/mutation.py) found unchecked.

Token counts come from ``transformers`` (``AutoTokenizer`` with offsets), not from the Rust
backend or from ``mta.data.token_ranges``; a prompt token is one starting before the end of the
prompt (docs/method.md §1).
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from mta.data import truncation
from mta.data.encoding import TokenizerSide
from mta.data.truncation import FittedText, PromptTooLong, fit_to_limits

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
