"""Span batches: the token ranges of a batch's spans on both sides, as padded tensors.

Built once per batch from the annotate artefact's ``[start, end)`` token ranges; everything
downstream (masks, pooling, losses) is batched tensor code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def to(self, device: torch.device | str) -> "SpanBatch":
        return SpanBatch(*(tensor.to(device) for tensor in (
            self.student_start, self.student_end, self.teacher_start, self.teacher_end, self.mask
        )))

    @property
    def num_spans(self) -> int:
        return self.mask.shape[1]
