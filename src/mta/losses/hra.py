"""Hidden Representation Alignment: pull projected student states onto the teacher's (docs/method.md §3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mta.losses.dsa import REDUCTIONS, Reduction, check_sequence_count, sequence_mean

WEIGHT_EPS = 1e-12


def hidden_representation_alignment(
    projected_student: torch.Tensor,
    teacher: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    *,
    reduction: Reduction = "sequence",
    num_sequences: float | None = None,
) -> torch.Tensor:
    """Weighted cosine distance between aligned positions.

    projected_student: ``[batch, items, d_teacher]`` student states already mapped to the
    teacher's width; teacher: ``[batch, items, d_teacher]``; items are tokens (same tokenizer)
    or spans (different tokenizers). weights: ``[batch, items]`` teacher importance or span
    salience. mask: ``[batch, items]`` which items take part.

    Per sequence ``Σ w (1 − cos) / Σ w`` over its masked items; returns the mean over sequences
    with at least one item (and positive weight), or a graph-carrying zero when there is none.
    ``reduction="batch"``: one ``Σ w (1 − cos) / Σ w`` over the masked items of the whole batch
    (the authors' uniform-weights ablation, docs/method.md §8). Another ``reduction``: ValueError.
    num_sequences (``"sequence"`` only): the sum of the per-sequence values over this count (the
    global batch's sequences) instead of the mean over the contributing ones here.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, not {reduction!r}")
    check_sequence_count(num_sequences, reduction)
    mask = mask.bool()
    weights = weights.float() * mask  # [batch, items]
    # cosine_similarity's own eps (1e-8) keeps a zero vector's distance finite.
    distance = 1.0 - F.cosine_similarity(projected_student.float(), teacher.detach().float(), dim=-1)
    if reduction == "batch":  # zero weights everywhere: a zero that keeps the graph
        return (weights * distance).sum() / weights.sum().clamp(min=WEIGHT_EPS)
    weight_sum = weights.sum(dim=1)
    per_sequence = (weights * distance).sum(dim=1) / weight_sum.clamp(min=WEIGHT_EPS)
    contributes = weight_sum > 0  # the weights are masked: a positive sum means a masked item
    return sequence_mean(per_sequence, contributes, num_sequences)
