"""The one place that turns prompts into completions: evaluation, training-time samples and
``mta generate`` all draw through it, so a row's sample means the same everywhere.

``sampling`` holds the sampler (``SamplingParams``, the per-row keyed Gumbel-max draw and its
``sampling_seed`` key); ``generator`` the ``Generator`` interface and its Hugging Face backend
``HFGenerator``; ``model_state`` how a model borrowed from training is used and given back.
"""

from mta.generation.generator import Completion, Generator, HFGenerator, eos_token_ids
from mta.generation.sampling import KeyedGumbelSampler, SamplingParams, sampling_seed

__all__ = [
    "Completion",
    "Generator",
    "HFGenerator",
    "KeyedGumbelSampler",
    "SamplingParams",
    "eos_token_ids",
    "sampling_seed",
]
