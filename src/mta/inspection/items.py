"""The items CKA compares, from one batch: spans pooled as MTA pools them, the token positions,
and which of them stay clear of the attention sink (each row's first position)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mta.losses.importance import IMPORTANCE
from mta.losses.pooling import pool_spans
from mta.losses.span_masks import SpanBatch


def pooled_spans(
    hidden: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
    layers: Sequence[int],
    attention_mask: torch.Tensor,
    span_masks: Mapping[str, torch.Tensor],
    importance: str = "attention",
) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """``{granularity: {layer: (spans [B, K, d], salience [B, K])}}``: every layer's spans pooled
    as MTA pools them (that layer's token importance, ``mta.losses.importance``, then
    ``pool_spans``). span_masks: ``{granularity: [B, K, T] float}``."""
    weigh = IMPORTANCE[importance]
    out: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {name: {} for name in span_masks}
    for layer in layers:
        state = hidden[layer]
        weights = weigh(state, attention_mask)
        for name, mask in span_masks.items():
            out[name][layer] = pool_spans(state, weights, mask)
    return out


def token_positions(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    special_ids: Sequence[int],
    per_row: int,
    *,
    skip_first: bool = True,
) -> torch.Tensor:
    """``[B, T]`` bool: the real positions of each row that are not special tokens nor (with
    ``skip_first``) the row's first real position, at most ``per_row`` of them, evenly spaced
    over the row (the first eligible one always kept)."""
    eligible = attention_mask.bool()
    if special_ids:
        eligible &= ~torch.isin(input_ids, torch.tensor(list(special_ids), device=input_ids.device))
    if skip_first:  # the attention sink: BOS where the tokenizer adds one, else the first token
        first = attention_mask.long().argmax(dim=1)
        eligible &= torch.arange(input_ids.shape[1], device=input_ids.device)[None, :] != first[:, None]
    rank = eligible.long().cumsum(dim=1) - 1  # the position's index among its row's eligible ones
    count = eligible.sum(dim=1, keepdim=True)
    bucket = rank * per_row // count.clamp(min=1)  # which of per_row evenly spaced slots it falls in
    previous = (rank - 1) * per_row // count.clamp(min=1)
    first_of_bucket = (rank == 0) | (bucket != previous)
    return eligible & ((count <= per_row) | first_of_bucket)


def off_sink(spans: SpanBatch, skip_first: bool) -> torch.Tensor:
    """``[B, K]`` bool: the real spans that cover neither side's first position (the attention
    sink, whose state is an outlier hundreds of times the others' norm in LLMs), or all real
    spans without ``skip_first``. Rows are right-padded: the first position is 0."""
    real = spans.mask.bool()
    if not skip_first:
        return real
    return real & (spans.student_start > 0) & (spans.teacher_start > 0)


__all__ = ["off_sink", "pooled_spans", "token_positions"]
