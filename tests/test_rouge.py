"""ROUGE-L and exact match against values worked out by hand.

ROUGE-L F = 2PR / (P + R) with P = LCS / prediction tokens and R = LCS / reference tokens, over
the default rouge_score tokens (lower case, [a-z0-9] runs, Porter stems for words over 3 letters).
"""

from __future__ import annotations

import pytest

from mta.scoring import exact_match, has_rouge_tokens, normalize_answer, rouge_l


@pytest.mark.parametrize(
    "prediction, reference, expected",
    [
        # LCS "the cat on the mat" = 5 of 6 tokens on both sides: P = R = F = 5/6.
        ("the cat lay on the mat", "the cat sat on the mat", 100 * 5 / 6),
        # Stemming: cats -> cat, running / runs -> run, so the token lists are equal.
        ("cat runs", "cats running", 100.0),
        # P = 2/2, R = 2/4: F = 2 * 1 * 0.5 / 1.5 = 2/3.
        ("a c", "a b c d", 100 * 2 / 3),
        # Case and punctuation do not count: P = 1/1, R = 1/4, F = 0.4.
        ("Paris.", "Paris is the capital", 40.0),
        # Order matters: LCS of (x y z) and (z y x) is 1 token: F = 1/3.
        ("z y x", "x y z", 100 / 3),
        # The tokenizer drops the accented letter: "caf au lait" vs "cafe au lait", LCS 2 of 3.
        ("cafe au lait", "café au lait", 100 * 2 / 3),
    ],
)
def test_rouge_l_matches_hand_computed_values(prediction, reference, expected):
    assert rouge_l(prediction, [reference]) == pytest.approx(expected)


def test_rouge_l_takes_the_best_reference():
    references = ["x y z", "the cat lay on the mat", "completely different words"]
    assert rouge_l("the cat lay on the mat", references) == pytest.approx(100.0)
    # Best of 1/3 (first) and 0 (second).
    assert rouge_l("z y x", ["x y z", "q r s"]) == pytest.approx(100 / 3)


def test_empty_prediction_scores_zero():
    assert rouge_l("", ["the answer"]) == 0.0
    assert exact_match("", ["the answer"]) == 0.0


def test_non_ascii_references_score_zero_as_in_the_protocol():
    # The default ROUGE tokenizer keeps only [a-z0-9]: CJK, Arabic and emoji have no tokens.
    for text in ("茶是中国的", "سلام", "👋🌍"):
        assert rouge_l(text, [text]) == 0.0
        assert not has_rouge_tokens(text)
    assert has_rouge_tokens("茶 tea")
    # A mixed reference is scored on its ASCII tokens only: "tea" of 1 token, P = 1/1, R = 1/1.
    assert rouge_l("tea", ["茶 tea"]) == pytest.approx(100.0)


def test_exact_match_normalises_case_punctuation_and_spaces_but_keeps_articles():
    assert normalize_answer("  The  Answer, please! ") == "the answer please"
    assert exact_match("The answer.", ["no", "the  ANSWER"]) == 100.0
    assert exact_match("an answer", ["answer"]) == 0.0
