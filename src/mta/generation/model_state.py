"""A model borrowed for generation, possibly in the middle of training.

The model may come wrapped in a DeepSpeed engine, in train mode, with ZeRO-3 partitioned
weights, ``use_cache`` off and a generation config of its own. Generation unwraps it, learns
whether its weights are partitioned (then every rank must take part in every forward), and
switches it to eval mode with the generator's config only for the duration of a batch: on exit,
normal or not, every module's train/eval flag, ``generation_config`` and ``config.use_cache``
are what they were.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeGuard, cast

import torch
from transformers import GenerationConfig


class CausalLM(Protocol):
    """What generation uses of a causal LM: a Hugging Face ``...ForCausalLM``, or a PEFT model
    around one (``PreTrainedModel`` alone has no ``generate`` in transformers 5)."""

    config: Any
    generation_config: GenerationConfig

    @property
    def device(self) -> torch.device: ...

    def modules(self) -> Iterator[torch.nn.Module]: ...

    def eval(self) -> Any: ...

    def generate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The prompt and new ids ``[batch, prompt + new]`` (generation here never asks for a dict)."""
        ...


class _EngineLike(Protocol):
    """What generation reads of a DeepSpeed engine."""

    module: torch.nn.Module

    def zero_optimization_partition_weights(self) -> bool: ...


def _is_deepspeed_engine(model: torch.nn.Module) -> TypeGuard[_EngineLike]:
    return hasattr(model, "zero_optimization_partition_weights") and hasattr(model, "module")


def unwrap_engine(model: torch.nn.Module) -> CausalLM:
    """The model a DeepSpeed engine wraps, or ``model`` itself."""
    inner = model.module if _is_deepspeed_engine(model) else model
    # Generation is only ever handed a causal LM (or a PEFT model around one), engine or not.
    return cast(CausalLM, inner)


def weights_partitioned(model: torch.nn.Module) -> bool:
    """Whether ZeRO-3 partitions the weights (each rank holds a shard; a forward gathers them).

    Asks the engine when given one; otherwise a parameter DeepSpeed manages carries ``ds_id``.
    """
    if _is_deepspeed_engine(model):
        return bool(model.zero_optimization_partition_weights())
    return any(hasattr(param, "ds_id") for param in model.parameters())


@contextmanager
def generation_mode(model: CausalLM, config: GenerationConfig) -> Iterator[None]:
    """``model`` in eval mode with ``config`` as its generation config; restored on exit.

    ``generate`` fills every setting left unset from ``model.generation_config`` (a saved
    repetition_penalty would apply), so the model's own config is swapped out meanwhile.
    """
    modes = [(module, module.training) for module in model.modules()]
    saved_config = model.generation_config
    use_cache = getattr(model.config, "use_cache", None)  # not every config has one
    model.eval()
    model.generation_config = config
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
        model.generation_config = saved_config
        if use_cache is not None:
            model.config.use_cache = use_cache
