"""Phrase and word spans against plain loop-based readings of docs/method.md §1."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mta.data.span_extraction import NOUN_PHRASE, VERB_PHRASE, SpanExtractor, keep_outermost, load_spacy

TEXTS = [
    "The quick brown fox has been quickly running away from the farmer's angry dogs.",
    "Below is an instruction that describes a task.\n\n### Response:\nWater evaporates slowly.",
    "She quickly ran and jumped over the old fence, then happily went home.",
    "!!! ??? ...",
    "",
    "茶是中国的传统饮料。 I really love drinking green tea 👋 every single morning.",
    "مرحبا بالعالم. The students were studying hard for the final exams.",
]


@pytest.fixture(scope="module")
def nlp():
    return load_spacy("en_core_web_sm").nlp


def reference_keep(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The nesting rule as written: sort by (start, -end), drop a span inside the last kept one."""
    kept: list[tuple[int, int, int]] = []
    for start, end, rank in sorted(spans, key=lambda s: (s[0], -s[1], s[2])):
        if kept and kept[-1][0] <= start and end <= kept[-1][1]:
            continue
        kept.append((start, end, rank))
    return kept


def reference_verb_phrases(doc) -> list[tuple[int, int]]:
    """Every token range whose POS sequence matches AUX* ADV* VERB+ ADV* (a regex, no Matcher)."""
    letters = "".join({"AUX": "a", "ADV": "d", "VERB": "v"}.get(token.pos_, "x") for token in doc)
    return [
        (i, j) for i in range(len(doc)) for j in range(i + 1, len(doc) + 1) if re.fullmatch("a*d*v+d*", letters[i:j])
    ]


def test_keep_outermost_matches_the_loop_reference():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(0, 12))
        starts = rng.integers(0, 20, n)
        spans = [(int(s), int(s + rng.integers(1, 8)), int(rng.integers(0, 2))) for s in starts]
        spans = list(dict.fromkeys(spans))  # the Matcher and noun_chunks yield no duplicates
        got = keep_outermost(np.array(spans, dtype=np.int64).reshape(-1, 3))
        assert [tuple(row) for row in got.tolist()] == reference_keep(spans)


def test_identical_noun_and_verb_phrase_keep_the_noun_label():
    got = keep_outermost(np.array([[3, 5, 1], [3, 5, 0], [0, 2, 1]]))
    assert got.tolist() == [[0, 2, 1], [3, 5, 0]]


def test_partial_overlaps_are_kept_and_nested_spans_dropped():
    got = keep_outermost(np.array([[0, 4, 0], [2, 6, 1], [3, 5, 0], [1, 3, 1]]))
    assert got.tolist() == [[0, 4, 0], [2, 6, 1]]


@pytest.mark.parametrize("text", TEXTS)
def test_phrases_follow_the_rule_on_real_parses(nlp, text):
    extractor = SpanExtractor(nlp, "phrase")
    doc = nlp(text)
    spans = extractor.extract(doc)

    candidates = [(c.start, c.end, 0) for c in doc.noun_chunks]
    candidates += [(i, j, 1) for i, j in reference_verb_phrases(doc)]
    expected = reference_keep(candidates)
    expected_chars = [(doc[start].idx, doc[end - 1].idx + len(doc[end - 1])) for start, end, _ in expected]
    assert [tuple(row) for row in spans.phrases.tolist()] == expected_chars
    assert spans.phrase_labels == [NOUN_PHRASE if rank == 0 else VERB_PHRASE for *_, rank in expected]

    # Word spans: each non-space spaCy token inside a kept phrase, once, in order.
    inside = {t.i for start, end, _ in expected for t in doc[start:end] if not t.is_space}
    expected_words = [(doc[i].idx, doc[i].idx + len(doc[i])) for i in sorted(inside)]
    assert [tuple(row) for row in spans.words.tolist()] == expected_words
    for start, end in spans.words.tolist():
        assert text[start:end] == text[start:end].strip() != ""


def test_known_phrases_of_a_plain_sentence(nlp):
    text = TEXTS[0]
    spans = SpanExtractor(nlp).extract(nlp(text))
    found = {(text[a:b], label) for (a, b), label in zip(spans.phrases.tolist(), spans.phrase_labels, strict=True)}
    assert ("The quick brown fox", NOUN_PHRASE) in found
    assert ("has been quickly running away", VERB_PHRASE) in found


def test_all_words_are_every_non_punctuation_token(nlp):
    text = TEXTS[2]
    doc = nlp(text)
    spans = SpanExtractor(nlp, "all").extract(doc)
    expected = [(t.idx, t.idx + len(t)) for t in doc if not (t.is_punct or t.is_space)]
    assert [tuple(row) for row in spans.words.tolist()] == expected
    assert "," not in {text[a:b] for a, b in spans.words.tolist()}


def test_text_without_phrases_gives_empty_arrays(nlp):
    spans = SpanExtractor(nlp).extract(nlp("!!! ???"))
    assert spans.phrases.shape == (0, 2) and spans.words.shape == (0, 2)
    assert spans.phrase_labels == []
