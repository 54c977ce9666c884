"""Teacher-forced perplexity of a model on reference responses.

Each row is tokenised as the models are trained (METHOD section 1): ``prompt + response`` in one
call without special tokens, EOS appended, and a token belongs to the prompt when its character
range starts before the prompt ends. Prompt tokens are masked; the perplexity is
``exp(sum of response-token NLL / number of response tokens)`` over the whole set, EOS
included. It separates weak students that all score near zero ROUGE-L.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mta.evaluation.datasets import EvalRow

IGNORE = -100


@dataclass(frozen=True)
class ScoredSequence:
    input_ids: list[int]
    labels: list[int]  # IGNORE on prompt tokens


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per response token, in nats
    tokens: int
    rows: int
    prompts_truncated: int
    responses_truncated: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def encode_for_scoring(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    response: str,
    *,
    max_prompt_length: int,
    max_response_length: int,
) -> tuple[ScoredSequence, bool, bool]:
    """The sequence, whether its prompt was cut (its first tokens kept, as in generation) and
    whether its response was cut (no EOS then: the model is not asked to stop mid-answer)."""
    encoded = tokenizer(prompt + response, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    prompt_length = sum(1 for start, _ in offsets if start < len(prompt))
    prompt_ids, response_ids = ids[:prompt_length], ids[prompt_length:]
    prompt_cut = len(prompt_ids) > max_prompt_length
    prompt_ids = prompt_ids[:max_prompt_length]
    # The budget counts EOS, as max_new_tokens does in generation.
    response_cut = len(response_ids) + 1 > max_response_length
    if response_cut:
        response_ids = response_ids[:max_response_length]
    else:
        response_ids = response_ids + [tokenizer.eos_token_id]
    return (
        ScoredSequence(prompt_ids + response_ids, [IGNORE] * len(prompt_ids) + response_ids),
        prompt_cut,
        response_cut,
    )


def _right_pad(sequences: Sequence[ScoredSequence], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """input_ids, attention_mask, labels: [batch, longest]."""
    width = max(len(s.input_ids) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), width), IGNORE, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        n = len(seq.input_ids)
        input_ids[row, :n] = torch.tensor(seq.input_ids)
        labels[row, :n] = torch.tensor(seq.labels)
        attention_mask[row, :n] = 1
    return input_ids.to(device), attention_mask.to(device), labels.to(device)


@torch.inference_mode()
def response_nll(
    model: PreTrainedModel, sequences: Sequence[ScoredSequence], pad_id: int, batch_size: int = 8,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[float, int]:
    """Summed NLL (nats, float64) and the number of scored tokens over ``sequences``."""
    total, tokens = 0.0, 0
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i].input_ids))
    for start in range(0, len(order), batch_size):
        batch = [sequences[i] for i in order[start : start + batch_size]]
        input_ids, attention_mask, labels = _right_pad(batch, pad_id, model.device)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [b, t, vocab]
        targets = labels[:, 1:]
        total += F.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
        ).item()
        tokens += int((targets != IGNORE).sum())
        if on_batch is not None:
            on_batch(len(batch))
    return total, tokens


def response_perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[EvalRow],
    *,
    max_prompt_length: int = 256,
    max_response_length: int = 256,
    batch_size: int = 8,
) -> PerplexityResult:
    """Perplexity of ``model`` on each row's first reference given its prompt."""
    encoded = [
        encode_for_scoring(
            tokenizer, row.prompt, row.references[0],
            max_prompt_length=max_prompt_length, max_response_length=max_response_length,
        )
        for row in rows
    ]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    total, tokens = response_nll(model, [e[0] for e in encoded], pad_id, batch_size)
    return perplexity_result(total, tokens, len(rows), sum(e[1] for e in encoded), sum(e[2] for e in encoded))


def perplexity_result(total_nll: float, tokens: int, rows: int, prompts_cut: int, responses_cut: int) -> PerplexityResult:
    nll = total_nll / max(tokens, 1)
    return PerplexityResult(math.exp(nll), nll, tokens, rows, prompts_cut, responses_cut)
