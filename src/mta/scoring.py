"""Scores of the MiniLLM / DistiLLM / DSKD protocol: ROUGE-L and exact match, max over references,
and the text they score: a completion decoded with special tokens skipped, then stripped.

ROUGE-L is ``rouge_score`` with its default tokenizer, which lower-cases and keeps only
``[a-z0-9]`` runs: a reference in Chinese, Arabic or emoji has no tokens and scores 0 against any
prediction. That is the published protocol, so it is kept; ``has_rouge_tokens`` lets a report
count such rows instead of hiding them.

rouge_score is imported on the first score, not with this module (``completion_text`` is all
that training and ``mta generate`` need of it most of the time): its stemmer is nltk's, and
``import nltk`` imports all of nltk, whose optional wrappers import scikit-learn (with pandas and
pyarrow) and scipy.stats when they are installed: 1 to 1.5 s on the development machine for
code ROUGE never runs. nltk is imported with those two hidden from it (``import_nltk``: 0.3 s);
the stemmer and the scores are the same.
"""

from __future__ import annotations

import string
import sys
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rouge_score.rouge_scorer import RougeScorer
    from transformers import PreTrainedTokenizerBase

_PUNCTUATION = set(string.punctuation)


def completion_text(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> str:
    """The prediction the protocol scores: the completion's ids (cut before their stop token)
    decoded with special tokens skipped, leading and trailing whitespace stripped."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True).strip()


# What nltk imports only inside ``try: ... except ImportError`` (nltk.classify.scikitlearn,
# nltk.parse.transitionparser; nltk.metrics.association, nltk.metrics.scores, ...).
HIDDEN_FROM_NLTK = ("sklearn", "scipy.stats")


def import_nltk() -> None:
    """Import nltk with ``HIDDEN_FROM_NLTK`` hidden from it, those not imported already.

    While nltk is imported, each hidden module's ``sys.modules`` entry is None, so nltk's
    ``import`` of it raises ImportError and nltk takes its fallback; afterwards the entries are
    removed and the modules import as usual. Only nltk's wrappers of them (a scikit-learn
    classifier, Fisher's exact test), which mta never calls, stay without them in this process.
    """
    if "nltk" in sys.modules:
        return
    hidden = [name for name in HIDDEN_FROM_NLTK if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        import nltk  # noqa: F401
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


@lru_cache(maxsize=1)
def rouge_l_scorer() -> RougeScorer:
    """The protocol's scorer, built once: ``rougeL`` with the Porter stemmer (``use_stemmer``)."""
    import_nltk()
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(prediction: str, references: Sequence[str]) -> float:
    """ROUGE-L F-measure x 100 of ``prediction``, the best over ``references``."""
    scorer = rouge_l_scorer()
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
    from rouge_score import tokenize  # re and six only: no nltk

    return bool(tokenize.tokenize(text, None))
