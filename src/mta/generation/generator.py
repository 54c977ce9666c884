"""Prompt -> completion generation behind one small interface.

``Generator`` is all the runner needs: give it prompts as token ids and one seed per prompt, get
completions back batch by batch. ``HFGenerator`` implements it with ``transformers``'
``generate`` (left padding, KV cache, prompts sorted by length so a batch wastes little padding).
A faster engine (vLLM, whose ``SamplingParams(seed=...)`` is per request like ``row_seeds``) fits
behind the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from mta.generation.sampling import KeyedGumbelNoise


@dataclass(frozen=True)
class Completion:
    """The sampled continuation of prompt number ``position`` (its place in the request)."""

    position: int
    token_ids: list[int]  # generated ids up to, not including, the first EOS
    finished: bool  # True when the model emitted EOS within the token budget

    @property
    def num_tokens(self) -> int:
        """Tokens the model produced, EOS included: what tokens/s counts."""
        return len(self.token_ids) + int(self.finished)


class Generator(Protocol):
    def generate(self, prompts: Sequence[list[int]], row_seeds: Sequence[int]) -> Iterator[list[Completion]]:
        """Sample one completion per prompt; yield them a batch at a time, in any order."""
        ...


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the model's own (chat models
    such as SmolLM2-Instruct end turns with a token the tokenizer does not call EOS)."""
    ids = {tokenizer.eos_token_id}
    configured = model.generation_config.eos_token_id
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


def cut_at_eos(ids: list[int], eos_ids: set[int]) -> tuple[list[int], bool]:
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[:i], True
    return ids, False


class HFGenerator:
    """Batched sampling with ``model.generate``: left padding, KV cache, length-sorted batches."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        batch_size: int = 16,
        max_new_tokens: int = 256,
    ):
        self.model = model
        self.batch_size = batch_size
        self.eos_ids = eos_token_ids(model, tokenizer)
        pad_id = tokenizer.pad_token_id
        self.pad_id = pad_id if pad_id is not None else self.eos_ids[0]
        # Greedy search + KeyedGumbelNoise = sampling with top_k 0, top_p 1.0, temperature 1.0.
        self.config = GenerationConfig(
            do_sample=False,
            num_beams=1,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            use_cache=True,
        )

    def _sample(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """[batch, prompt] -> [batch, prompt + new]; padded with pad_id after EOS."""
        # generate() fills every setting left unset from model.generation_config (a saved
        # repetition_penalty would apply), so the model's own config is swapped out meanwhile.
        saved, self.model.generation_config = self.model.generation_config, self.config
        try:
            return self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=self.config,
                logits_processor=LogitsProcessorList([KeyedGumbelNoise(seeds, device=input_ids.device)]),
            )
        finally:
            self.model.generation_config = saved

    @torch.inference_mode()
    def generate(self, prompts: Sequence[list[int]], row_seeds: Sequence[int]) -> Iterator[list[Completion]]:
        device = self.model.device
        eos = set(self.eos_ids)
        for batch in length_sorted_batches([len(p) for p in prompts], self.batch_size):
            input_ids, attention_mask = left_pad([prompts[i] for i in batch], self.pad_id, device)
            seeds = [row_seeds[i] for i in batch]
            new_tokens = self._sample(input_ids, attention_mask, seeds)[:, input_ids.shape[1] :].tolist()
            completions = []
            for position, ids in zip(batch, new_tokens):
                kept, finished = cut_at_eos(ids, eos)
                completions.append(Completion(position=position, token_ids=kept, finished=finished))
            yield completions
