"""Teacher-forced perplexity of a model on reference responses, sharded over ranks.

Each row is tokenised as the models are trained (docs/method.md §1): ``prompt + response`` in one
call without special tokens, EOS appended, and a token belongs to the prompt by the rule of
``mta.data.token_ranges.prompt_token_count``. Prompt tokens are masked; the perplexity is
``exp(sum of response-token NLL / number of response tokens)`` over the whole set, EOS
included. It separates weak students that all score near zero ROUGE-L.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mta import distributed
from mta.data.token_ranges import prompt_token_count
from mta.evaluation.datasets import EvalRow
from mta.reporting import Reporter, SilentReporter

IGNORE = -100


@dataclass(frozen=True)
class ScoredSequence:
    """One row as scored: ``labels`` repeat ``input_ids`` on the response, IGNORE on the prompt."""

    input_ids: list[int]
    labels: list[int]
    prompt_truncated: bool  # its first tokens kept, as in generation
    response_truncated: bool  # no EOS then: the model is not asked to stop mid-answer


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per response token, in nats
    tokens: int
    rows: int
    prompts_truncated: int
    responses_truncated: int

    @classmethod
    def from_sums(
        cls, total_nll: float, tokens: int, rows: int, prompts_cut: int, responses_cut: int
    ) -> PerplexityResult:
        """The result of ``rows`` rows whose ``tokens`` response tokens have ``total_nll`` nats."""
        nll = total_nll / max(tokens, 1)
        return cls(math.exp(nll), nll, tokens, rows, prompts_cut, responses_cut)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class PerplexitySet:
    """The rows perplexity is scored on, and the set as the user named it (e.g. dolly-dev)."""

    spec: str
    path: Path
    rows: list[EvalRow]

    def key(self, max_prompt_length: int, max_response_length: int) -> dict:
        """What a stored perplexity depends on: reuse it only when all of this matches."""
        return {
            "set": self.spec,
            "path": str(self.path.resolve()),
            "rows": len(self.rows),
            "max_prompt_length": max_prompt_length,
            "max_response_length": max_response_length,
        }


def encode_for_scoring(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    response: str,
    *,
    max_prompt_length: int,
    max_response_length: int,
) -> ScoredSequence:
    """The scored sequence of one (prompt, reference response) pair."""
    encoded = tokenizer(prompt + response, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    prompt_length = prompt_token_count(np.asarray(encoded["offset_mapping"]), len(prompt))
    prompt_ids, response_ids = ids[:prompt_length], ids[prompt_length:]
    prompt_cut = len(prompt_ids) > max_prompt_length
    prompt_ids = prompt_ids[:max_prompt_length]
    # The budget counts EOS, as max_new_tokens does in generation.
    response_cut = len(response_ids) + 1 > max_response_length
    if response_cut:
        response_ids = response_ids[:max_response_length]
    else:
        response_ids = response_ids + [tokenizer.eos_token_id]
    labels = [IGNORE] * len(prompt_ids) + response_ids
    return ScoredSequence(prompt_ids + response_ids, labels, prompt_cut, response_cut)


def scoring_sequences(
    tokenizer: PreTrainedTokenizerBase, rows: Sequence[EvalRow], max_prompt_length: int, max_response_length: int
) -> tuple[list[ScoredSequence], int]:
    """Each row's prompt and first reference encoded for teacher-forced scoring
    (:func:`encode_for_scoring`), and the id that pads them (the pad token, else EOS)."""
    sequences = [
        encode_for_scoring(
            tokenizer,
            row.prompt,
            row.references[0],
            max_prompt_length=max_prompt_length,
            max_response_length=max_response_length,
        )
        for row in rows
    ]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return sequences, pad_id


def right_pad(sequences: Sequence[ScoredSequence], pad_id: int, device) -> tuple[torch.Tensor, ...]:
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
    model: PreTrainedModel, sequences: Sequence[ScoredSequence], pad_id: int, batch_size: int, reporter: Reporter
) -> tuple[float, int]:
    """Summed NLL (nats, float64) and the number of scored tokens over ``sequences``."""
    total, tokens = 0.0, 0
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i].input_ids))
    for start in range(0, len(order), batch_size):
        batch = [sequences[i] for i in order[start : start + batch_size]]
        input_ids, attention_mask, labels = right_pad(batch, pad_id, model.device)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [b, t, vocab]
        targets = labels[:, 1:]
        total += F.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
        ).item()
        tokens += int((targets != IGNORE).sum())
        # tokens: the batch's real (unpadded) tokens the forward read, for the tokens/s a bar shows
        reporter.advance(len(batch), tokens=int(attention_mask.sum()))
    return total, tokens


def response_perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[EvalRow],
    *,
    max_prompt_length: int = 256,
    max_response_length: int = 256,
    batch_size: int = 8,
    reporter: Reporter | None = None,
    description: str = "perplexity",
) -> PerplexityResult:
    """Perplexity of ``model`` on each row's first reference given its prompt.

    Under torchrun every rank calls it with the same ``rows``: rank r scores ``rows[r::world]``,
    the sums are added over ranks, and every rank returns the result of the whole set.
    """
    reporter = reporter or SilentReporter()
    mine = rows[distributed.rank() :: distributed.world_size()]
    sequences, pad_id = scoring_sequences(tokenizer, mine, max_prompt_length, max_response_length)
    reporter.start(description, len(sequences), unit="rows")
    try:
        total, tokens = response_nll(model, sequences, pad_id, batch_size, reporter)
    finally:
        reporter.stop()
    total, tokens, prompts_cut, responses_cut = distributed.sum_over_ranks(
        [
            total,
            tokens,
            sum(s.prompt_truncated for s in sequences),
            sum(s.response_truncated for s in sequences),
        ]
    )
    return PerplexityResult.from_sums(total, int(tokens), len(rows), int(prompts_cut), int(responses_cut))
