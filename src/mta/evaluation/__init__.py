"""Evaluation under the MiniLLM protocol: sampled generation, ROUGE-L, perplexity, reports.

Modules, in the order the data flows: ``datasets`` (set files) -> ``checkpoints`` (labels, load
and teardown) -> ``sampling`` + ``generation`` (the ``Generator`` interface and its HF backend)
-> ``scoring`` (ROUGE-L, exact match) -> ``results`` + ``report`` (results.json, results.md, the
table); ``perplexity`` scores references teacher-forced; ``runner`` ties them together with
resume (``files``) and torchrun sharding (``distributed``).
"""

from mta.evaluation.perplexity import PerplexityResult, response_perplexity
from mta.evaluation.runner import EvalSettings, Progress, evaluate_checkpoints
from mta.scoring import exact_match, rouge_l

__all__ = [
    "EvalSettings",
    "PerplexityResult",
    "Progress",
    "evaluate_checkpoints",
    "exact_match",
    "response_perplexity",
    "rouge_l",
]
