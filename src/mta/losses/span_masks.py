"""Span batches: the token ranges of a batch's spans on both sides, as padded tensors.

Built once per batch from the annotate artefact's ``[start, end)`` token ranges; everything
downstream (masks, pooling, losses) is batched tensor code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def span_token_mask(
    start: torch.Tensor, end: torch.Tensor, seq_len: int, span_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Which tokens each span covers.

    start, end: ``[batch, spans]`` half-open token ranges ``[start, end)``; an empty range
    (``start >= end``) covers nothing. span_mask: ``[batch, spans]``, False for padding spans,
    which then cover nothing whatever their range.
    Returns ``[batch, spans, seq_len]`` bool, True where token t lies in span k.
    """
    if span_mask is not None:
        end = torch.where(span_mask.bool(), end, start)  # on [B, K], not on [B, K, T]
    positions = torch.arange(seq_len, device=start.device)
    return (positions >= start.unsqueeze(-1)) & (positions < end.unsqueeze(-1))


def span_cover_count(
    start: torch.Tensor, end: torch.Tensor, seq_len: int, span_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """How many spans each token lies in: ``[batch, seq_len]`` int32.

    Same inputs as :func:`span_token_mask`; computed as a running count of open spans
    (+1 at each start, −1 at each end), so it never builds the ``[batch, spans, seq_len]`` mask.
    """
    start, end = start.clamp(0, seq_len), end.clamp(0, seq_len)
    live = (end > start) if span_mask is None else (end > start) & span_mask.bool()
    step = live.to(torch.int32)
    change = torch.zeros(start.shape[0], seq_len + 1, dtype=torch.int32, device=start.device)
    change.scatter_add_(1, start, step).scatter_add_(1, end, -step)
    return change.cumsum(dim=1, dtype=torch.int32)[:, :-1]  # the last column only closes spans ending at seq_len


def span_union_mask(
    start: torch.Tensor, end: torch.Tensor, seq_len: int, span_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Tokens inside at least one span, each counted once: ``[batch, seq_len]`` bool.

    Same inputs as :func:`span_token_mask` (:func:`span_cover_count` > 0).
    """
    return span_cover_count(start, end, seq_len, span_mask) > 0


@dataclass
class SpanBatch:
    """Spans of one granularity for a batch, padded to the longest span list.

    student_start, student_end: ``[batch, spans]`` half-open token ranges in the student's ids.
    teacher_start, teacher_end: ``[batch, spans]`` the same spans in the teacher's ids.
    mask: ``[batch, spans]`` True for real spans, False for padding.
    """

    student_start: torch.Tensor
    student_end: torch.Tensor
    teacher_start: torch.Tensor
    teacher_end: torch.Tensor
    mask: torch.Tensor

    def to(self, device: torch.device | str) -> SpanBatch:
        return SpanBatch(
            *(
                tensor.to(device)
                for tensor in (self.student_start, self.student_end, self.teacher_start, self.teacher_end, self.mask)
            )
        )

    @property
    def num_spans(self) -> int:
        return self.mask.shape[1]

    def student_token_mask(self, seq_len: int) -> torch.Tensor:
        """``[batch, spans, seq_len]`` bool: the student tokens of each real span."""
        return span_token_mask(self.student_start, self.student_end, seq_len, self.mask)

    def teacher_token_mask(self, seq_len: int) -> torch.Tensor:
        """``[batch, spans, seq_len]`` bool: the teacher tokens of each real span."""
        return span_token_mask(self.teacher_start, self.teacher_end, seq_len, self.mask)

    def teacher_token_union(self, seq_len: int) -> torch.Tensor:
        """``[batch, seq_len]`` bool: teacher tokens inside any real span, each once."""
        return span_union_mask(self.teacher_start, self.teacher_end, seq_len, self.mask)

    def teacher_token_count(self, seq_len: int) -> torch.Tensor:
        """``[batch, seq_len]`` int32: how many real spans each teacher token lies in."""
        return span_cover_count(self.teacher_start, self.teacher_end, seq_len, self.mask)
