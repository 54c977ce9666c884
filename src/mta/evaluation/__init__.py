"""Evaluation under the MiniLLM protocol: sampled generation, ROUGE-L, perplexity, reports.

Modules, in the order the data flows: ``settings`` (what to run, the protocol's sampler) ->
``datasets`` (set files) -> ``models_under_test`` (labels, up-front checks, load and teardown;
``mta.models.weights``: whole weights, checksum lists, the fingerprint) -> generation
through ``mta.generation`` -> ``predictions`` (journals -> scored files, with ``mta.scoring``) ->
``results`` + ``report`` (results.json, results.md); ``perplexity`` scores references
teacher-forced; ``layout`` names the files; ``runner`` ties them together with resume and
torchrun sharding.

The names below are imported on first use (PEP 562), so that importing one module of the package
(``mta.evaluation.datasets``, ``download``) does not import torch, transformers
and the scorer through the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mta.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from mta.evaluation.datasets import DEFAULT_BENCHMARKS
    from mta.evaluation.perplexity import PerplexityResult, response_perplexity
    from mta.evaluation.results import collect_results
    from mta.evaluation.runner import evaluate_checkpoints
    from mta.evaluation.settings import EvalSettings
    from mta.scoring import exact_match, rouge_l

# Each public name and the module it lives in.
EXPORTS = {
    "DEFAULT_BENCHMARKS": "mta.evaluation.datasets",
    "EvalSettings": "mta.evaluation.settings",
    "PerplexityResult": "mta.evaluation.perplexity",
    "collect_results": "mta.evaluation.results",
    "evaluate_checkpoints": "mta.evaluation.runner",
    "exact_match": "mta.scoring",
    "response_perplexity": "mta.evaluation.perplexity",
    "rouge_l": "mta.scoring",
}


__getattr__, __dir__ = lazy_exports(globals(), EXPORTS)


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
