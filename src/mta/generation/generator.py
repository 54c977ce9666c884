"""Prompt -> completion generation behind one small interface.

``Generator`` is all a caller needs: give it prompts as token ids and one seed per prompt (see
``sampling_seed``), get completions back batch by batch. ``HFGenerator`` implements it with
``transformers``' ``generate`` (left padding, KV cache, prompts sorted by length so a batch wastes
little padding) and works on a model in the middle of training (see ``model_state``).
``mta.generation.vllm_engine.VLLMGenerator`` implements it on vLLM, in its own environment
(``--engine vllm`` of ``mta evaluate`` and ``mta generate``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from mta import distributed
from mta.generation.model_state import CausalLM, generation_mode, unwrap_engine, weights_partitioned
from mta.generation.sampling import KeyedGumbelSampler, SamplingParams


@dataclass(frozen=True)
class Completion:
    """The sampled continuation of prompt number ``position`` (its place in the request)."""

    position: int
    token_ids: list[int]  # generated ids up to, not including, the first stop token
    finished: bool  # True when a stop token (EOS or a stop id) ended it within the budget

    @property
    def num_tokens(self) -> int:
        """Tokens the model produced, the stop token included: what tokens/s counts."""
        return len(self.token_ids) + int(self.finished)


class Generator(Protocol):
    def generate(self, prompts: Sequence[list[int]], row_seeds: Sequence[int]) -> Iterator[list[Completion]]:
        """Sample one completion per prompt; yield them a batch at a time, in any order."""
        ...


def eos_token_ids(model: CausalLM | GenerationConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the model's own (chat models
    such as SmolLM2-Instruct end turns with a token the tokenizer does not call EOS). ``model``:
    the model, or its ``GenerationConfig`` (an engine that does not load the model here)."""
    ids = {tokenizer.eos_token_id}
    config = model if isinstance(model, GenerationConfig) else model.generation_config
    configured = config.eos_token_id
    ids.update(configured if isinstance(configured, list) else [configured])
    ids.discard(None)
    if not ids:
        raise ValueError("neither the tokenizer nor the model names an EOS token")
    return sorted(ids)


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Positions grouped into batches of similar length, longest first (so a batch that does
    not fit in memory fails at once rather than at the end)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def left_pad(prompts: Sequence[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask, both [batch, longest prompt], real tokens at the right."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def cut_at_stop(new_tokens: torch.Tensor, stop_ids: Sequence[int]) -> tuple[list[list[int]], list[bool]]:
    """new_tokens ``[batch, new]`` -> each row's ids before its first stop id, and whether it
    has one (padding after the stop is dropped with it)."""
    is_stop = torch.isin(new_tokens, torch.tensor(list(stop_ids), device=new_tokens.device))
    finished = is_stop.any(dim=1)
    lengths = torch.where(finished, is_stop.int().argmax(dim=1), new_tokens.shape[1])
    rows = new_tokens.tolist()
    return [rows[b][:n] for b, n in enumerate(lengths.tolist())], finished.tolist()


class HFGenerator:
    """Batched keyed sampling with ``model.generate``: left padding, KV cache, length-sorted
    batches.

    ``model``: a causal LM, or a DeepSpeed engine around one. Under ZeRO-3 with several ranks
    every rank must call ``generate`` (and consume all it yields) together: each forward gathers
    weights from all ranks, so every rank runs as many batches as the busiest one (padding its
    share with one-token dummy batches) and keeps stepping until every rank's batch is done.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        *,
        batch_size: int = 16,
    ):
        self.model = unwrap_engine(model)
        self.params = params
        self.batch_size = batch_size
        self.synced = weights_partitioned(model) and distributed.is_distributed()
        eos_ids = eos_token_ids(self.model, tokenizer)
        self.stop_ids = sorted({*eos_ids, *params.stop_token_ids})
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
        # Greedy search (GenerationConfig's default: no sampling, one beam, KV cache) over
        # KeyedGumbelSampler's scores = keyed sampling under ``params``.
        self.config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.min_new_tokens or None,  # HF masks every stop id until then
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
        )

    def generate(self, prompts: Sequence[list[int]], row_seeds: Sequence[int]) -> Iterator[list[Completion]]:
        """One completion per prompt (``row_seeds[i]`` keys prompt i), a length-sorted batch at a time."""
        if len(prompts) != len(row_seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(row_seeds)} seeds")
        batches = length_sorted_batches([len(p) for p in prompts], self.batch_size)
        # Agreed before the first forward: every later collective belongs to a forward.
        dummies = distributed.max_over_ranks(len(batches)) - len(batches) if self.synced else 0
        for batch in batches:
            yield self._complete(batch, [prompts[i] for i in batch], [row_seeds[i] for i in batch])
        for _ in range(dummies):
            self._dummy_batch()

    def _dummy_batch(self) -> None:
        """A one-token prompt whose completion is dropped: this rank's part in the others' forwards."""
        self._complete([0], [[self.pad_id]], [0])

    def _complete(self, positions: list[int], prompts: list[list[int]], seeds: list[int]) -> list[Completion]:
        """The completions of one batch; ``positions`` are the prompts' places in the request."""
        input_ids, attention_mask = left_pad(prompts, self.pad_id, self.model.device)
        new_tokens = self._sample(input_ids, attention_mask, seeds)[:, input_ids.shape[1] :]
        kept, finished = cut_at_stop(new_tokens, self.stop_ids)
        return [Completion(p, ids, done) for p, ids, done in zip(positions, kept, finished, strict=True)]

    def _sample(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """[batch, prompt] -> [batch, prompt + new]; padded with pad_id after the stop token."""
        sampler = KeyedGumbelSampler(self.params, seeds, device=input_ids.device)
        with generation_mode(self.model, self.config), torch.no_grad():  # config: the model's own meanwhile
            return self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                logits_processor=LogitsProcessorList([sampler]),
                synced_gpus=self.synced,
            )
