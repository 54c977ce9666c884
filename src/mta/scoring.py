"""Scores of the MiniLLM / DistiLLM / DSKD protocol: ROUGE-L and exact match, max over references,
and the text they score: a completion decoded with special tokens skipped, then stripped.

ROUGE-L is ``rouge_score`` with its default tokenizer, which lower-cases and keeps only
``[a-z0-9]`` runs: a reference in Chinese, Arabic or emoji has no tokens and scores 0 against any
prediction. That is the published protocol, so it is kept; ``has_rouge_tokens`` lets a report
count such rows instead of hiding them.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from rouge_score import rouge_scorer, tokenize

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_PUNCTUATION = set(string.punctuation)


def completion_text(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> str:
    """The prediction the protocol scores: the completion's ids (cut before their stop token)
    decoded with special tokens skipped, leading and trailing whitespace stripped."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True).strip()


@lru_cache(maxsize=1)
def _scorer() -> rouge_scorer.RougeScorer:
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(prediction: str, references: Sequence[str]) -> float:
    """ROUGE-L F-measure x 100 of ``prediction``, the best over ``references``."""
    scorer = _scorer()
    return 100.0 * max(scorer.score(ref, prediction)["rougeL"].fmeasure for ref in references)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation as the Super-NaturalInstructions scorer applies it: lower case, no
    punctuation, single spaces. Articles are kept (the lineage does not remove them)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(text.split())


def exact_match(prediction: str, references: Sequence[str]) -> float:
    """100 when the normalised prediction equals a normalised reference, else 0."""
    normalized = normalize_answer(prediction)
    return 100.0 * any(normalized == normalize_answer(ref) for ref in references)


def has_rouge_tokens(text: str) -> bool:
    """Whether the default ROUGE tokenizer sees any token in ``text``."""
    return bool(tokenize.tokenize(text, None))
