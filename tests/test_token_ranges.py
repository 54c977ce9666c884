"""Character spans to token ranges, prompt lengths and length limits, against loop references
that re-tokenise the text with ``transformers`` (not the Rust backend annotate uses)."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from mta.data.encoding import TokenizerSide
from mta.data.token_ranges import prompt_token_count, token_ranges
from mta.data.truncation import FittedText, PromptTooLong, fit_to_limits, last_fitting_cut

TEXT = (
    "Below is an instruction.\n\n### Response:\n  Water   evaporates\tfrom oceans; "
    "茶是中国的 👋 سلام عليكم and the end.\n"
)


def reference_range(offsets, text, start, end):
    """docs/method.md §1 membership, token by token."""
    members = []
    for index, (a, b) in enumerate(offsets):
        piece = text[a:b]
        visible_start = a + (len(piece) - len(piece.lstrip()))
        if visible_start < b and start <= visible_start and b <= end:
            members.append(index)
    return (members[0], members[-1] + 1) if members else None


@pytest.fixture(params=["tiny", "other", "gpt2"])
def tokenizer_dir(request):
    name = {"tiny": "tiny_tokenizer_dir", "other": "other_tokenizer_dir", "gpt2": "gpt2_tokenizer_dir"}
    return request.getfixturevalue(name[request.param])


def test_token_ranges_match_the_membership_rule(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    encoded = tokenizer(TEXT, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.array(encoded["offset_mapping"])
    rng = np.random.default_rng(1)
    starts = rng.integers(0, len(TEXT), 400)
    spans = np.stack([starts, np.minimum(starts + rng.integers(1, 25, 400), len(TEXT))], axis=1)
    first, end, found = token_ranges(TEXT, offsets, spans)
    for (a, b), f, e, ok in zip(spans.tolist(), first.tolist(), end.tolist(), found.tolist(), strict=True):
        expected = reference_range(offsets.tolist(), TEXT, a, b)
        assert (expected is not None) == ok, (a, b)
        if ok:
            assert (f, e) == expected, (TEXT[a:b], a, b)


def test_whitespace_only_and_special_tokens_belong_to_no_span():
    text = "a   b"
    offsets = np.array([[0, 1], [1, 3], [3, 5], [0, 0]])  # "a", "  " (only spaces), " b", special
    first, end, found = token_ranges(text, offsets, np.array([[1, 3], [0, 5], [4, 5]]))
    assert found.tolist() == [False, True, True]
    assert (first[1], end[1]) == (0, 3)  # "a" .. " b"; the space token inside the range is kept
    assert (first[2], end[2]) == (2, 3)  # " b" belongs: its leading space is stripped


def test_prompt_length_counts_the_token_that_straddles_the_boundary():
    offsets = np.array([[0, 3], [3, 7], [7, 9]])
    assert prompt_token_count(offsets, 3) == 1
    assert prompt_token_count(offsets, 5) == 2  # token [3, 7) starts before 5: prompt
    assert prompt_token_count(offsets, 9) == 3


def test_last_fitting_cut_finds_the_boundary_from_any_estimate():
    text = "x" * 100
    for limit in (0, 1, 37, 99, 100):
        for estimate in (0, 5, 50, 100, 500):
            assert last_fitting_cut(text, 0, estimate, lambda c, limit=limit: c <= limit) == limit


@pytest.fixture
def sides(tiny_tokenizer_dir, other_tokenizer_dir):
    return TokenizerSide.load(tiny_tokenizer_dir), TokenizerSide.load(other_tokenizer_dir)


def test_backend_encoding_equals_the_transformers_call(sides, tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    encoded = tokenizer(TEXT, add_special_tokens=False, return_offsets_mapping=True)
    ours = sides[0].encode(TEXT)
    assert ours.ids.tolist() == encoded["input_ids"]
    assert ours.offsets.tolist() == [list(pair) for pair in encoded["offset_mapping"]]


def test_a_long_response_is_cut_where_both_sides_just_fit(sides):
    prompt, response = "Question: why?\nAnswer: ", "Because the sky scatters blue light. " * 20
    fitted = fit_to_limits(prompt, response, sides, max_length=40, max_prompt_length=20)
    assert isinstance(fitted, FittedText) and not fitted.complete
    assert fitted.text == (prompt + response)[: len(fitted.text)]
    assert fitted.text[: fitted.prompt_chars] + fitted.response == prompt + response  # the response kept whole
    counts = [side.count(fitted.text) for side in sides]
    assert max(counts) <= 40
    one_more = (prompt + response)[: len(fitted.text) + 1]
    assert max(side.count(one_more) for side in sides) > 40
    assert [len(e) for e in fitted.encodings] == counts


def test_a_sequence_that_fits_keeps_its_eos_slot(sides):
    fitted = fit_to_limits("Q: ", "Yes.", sides, max_length=64, max_prompt_length=8)
    assert fitted.complete and fitted.text == "Q: Yes."
    assert all(len(e) + 1 <= 64 for e in fitted.encodings)


def test_a_long_prompt_is_skipped_or_its_head_kept(sides):
    prompt, response = "Instruction: " + "describe the river " * 20, "It flows."
    skipped = fit_to_limits(prompt, response, sides, max_length=200, max_prompt_length=16)
    assert isinstance(skipped, PromptTooLong) and skipped.tokens > 16
    assert "--truncate-prompt" in skipped.message

    kept = fit_to_limits(prompt, response, sides, max_length=200, max_prompt_length=16, truncate_prompt=True)
    assert kept.prompt_cut and kept.complete
    assert kept.text == prompt[: kept.prompt_chars] + response
    for side in sides:
        assert prompt_token_count(side.encode(kept.text).offsets, kept.prompt_chars) <= 16
    longer = prompt[: kept.prompt_chars + 1] + response
    assert max(prompt_token_count(side.encode(longer).offsets, kept.prompt_chars + 1) for side in sides) > 16
