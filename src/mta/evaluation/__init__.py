"""Evaluation under the MiniLLM protocol: sampled generation, ROUGE-L, perplexity, reports.

Modules, in the order the data flows: ``settings`` (what to run, the protocol's sampler) ->
``datasets`` (set files) -> ``models_under_test`` (labels, up-front checks, load and teardown;
``model_files``: whole weights, checksum lists, the weights' fingerprint) -> generation
through ``mta.generation`` -> ``predictions`` (journals -> scored files, with ``mta.scoring``) ->
``results`` + ``report`` (results.json, results.md); ``perplexity`` scores references
teacher-forced; ``layout`` names the files; ``runner`` ties them together with resume and
torchrun sharding.
"""

from mta.evaluation.datasets import DEFAULT_BENCHMARKS
from mta.evaluation.perplexity import PerplexityResult, response_perplexity
from mta.evaluation.results import collect_results
from mta.evaluation.runner import evaluate_checkpoints
from mta.evaluation.settings import EvalSettings
from mta.scoring import exact_match, rouge_l

__all__ = [
    "DEFAULT_BENCHMARKS",
    "EvalSettings",
    "PerplexityResult",
    "collect_results",
    "evaluate_checkpoints",
    "exact_match",
    "response_perplexity",
    "rouge_l",
]
