"""Dynamic Structural Alignment: match the geometry of spans inside one layer (docs/method.md §3).

Compares span-to-span cosine similarity matrices, so student and teacher may differ in width
and in tokenizer; no projection is involved.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F

COS_EPS = 1e-8
WEIGHT_EPS = 1e-12
# How DSA and HRA reduce over a batch: per sequence then averaged, or the authors' one pool of the
# whole batch; how DSA weighs a pair of spans. The tuples are what the functions accept.
Reduction = Literal["sequence", "batch"]
PairWeights = Literal["salience", "uniform"]
REDUCTIONS: tuple[str, ...] = get_args(Reduction)
PAIR_WEIGHTS: tuple[str, ...] = get_args(PairWeights)


def _cosine_matrix(spans: torch.Tensor) -> torch.Tensor:
    """``[batch, spans, dim]`` -> ``[batch, spans, spans]`` pairwise cosine similarities."""
    unit = F.normalize(spans.float(), dim=-1, eps=COS_EPS)
    return torch.bmm(unit, unit.transpose(1, 2))


def dynamic_structural_alignment(
    student_spans: torch.Tensor,
    teacher_spans: torch.Tensor,
    salience: torch.Tensor,
    span_mask: torch.Tensor,
    *,
    reduction: Reduction = "sequence",
    pair_weights: PairWeights = "salience",
    num_sequences: float | None = None,
) -> torch.Tensor:
    """Salience-weighted squared difference of the two span similarity matrices.

    student_spans: ``[batch, spans, d_student]``; teacher_spans: ``[batch, spans, d_teacher]``
    (the same spans, in the same order). salience: ``[batch, spans]`` non-negative span weights
    from the teacher (normalised here over each sequence's spans). span_mask: ``[batch, spans]``.

    Per sequence: ``Σ_{i≠j} w_ij (cos S_ij − cos T_ij)² / Σ_{i≠j} w_ij`` with
    ``w_ij = w̃_i w̃_j``. Returns the mean over sequences with at least two spans (and positive
    pair weight), or a zero that still carries the graph when no sequence contributes.

    The authors' code (docs/method.md §8): ``reduction="batch"`` is one weighted mean over the
    intra-sequence pairs of the whole batch; ``pair_weights="uniform"`` (their uniform-weights
    ablation) weighs every pair of spans with positive salience 1. Other values: ValueError.

    num_sequences (``reduction="sequence"`` only): divide the sum of the per-sequence values by
    this, the sequences of the whole global batch, instead of by the contributing ones here, so
    that micro batches add up to the global batch's mean (a sequence without a pair adds 0).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, not {reduction!r}")
    check_sequence_count(num_sequences, reduction)
    if pair_weights not in PAIR_WEIGHTS:
        raise ValueError(f"pair_weights must be one of {PAIR_WEIGHTS}, not {pair_weights!r}")
    mask = span_mask.bool()
    salience = salience.float() * mask  # [batch, spans]
    if pair_weights == "uniform":
        normalised = (salience > 0).float()
    else:
        normalised = salience / salience.sum(dim=1, keepdim=True).clamp(min=WEIGHT_EPS)
    num_spans = mask.shape[1]
    off_diagonal = ~torch.eye(num_spans, dtype=torch.bool, device=mask.device)
    weights = normalised.unsqueeze(2) * normalised.unsqueeze(1) * off_diagonal  # [B, K, K]

    gap = _cosine_matrix(student_spans) - _cosine_matrix(teacher_spans.detach())
    if reduction == "batch":  # no pair anywhere: a zero that keeps the graph
        return (weights * gap.square()).sum() / weights.sum().clamp(min=WEIGHT_EPS)
    weight_sum = weights.sum(dim=(1, 2))
    per_sequence = (weights * gap.square()).sum(dim=(1, 2)) / weight_sum.clamp(min=WEIGHT_EPS)

    # The pair weights are masked and off the diagonal: a positive sum means two masked spans.
    contributes = weight_sum > 0
    return sequence_mean(per_sequence, contributes, num_sequences)


def check_sequence_count(num_sequences: float | None, reduction: str) -> None:
    """``num_sequences`` is a positive count, given only with the per-sequence reduction."""
    if num_sequences is None:
        return
    if reduction != "sequence":
        raise ValueError(f"num_sequences divides per-sequence values: it needs reduction='sequence', not {reduction!r}")
    if not num_sequences > 0:
        raise ValueError(f"num_sequences must be positive (the global batch's sequences), got {num_sequences}")


def sequence_mean(per_sequence: torch.Tensor, contributes: torch.Tensor, num_sequences: float | None) -> torch.Tensor:
    """``[batch]`` values and ``[batch]`` bool -> the mean over the contributing sequences, or
    their sum over ``num_sequences`` when given. No host sync; with no contributor a zero that
    keeps the graph."""
    total = (per_sequence * contributes).sum()
    return total / (contributes.sum().clamp(min=1) if num_sequences is None else num_sequences)
