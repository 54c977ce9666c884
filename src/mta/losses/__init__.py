"""MTA's losses: token importance, span pooling, DSA, HRA and the base distillation losses.

Shapes are named in every docstring: ``[batch, seq, dim]`` hidden states, ``[batch, spans]``
span tensors. Nothing here loops over tokens or spans; see docs/method.md §2–5 for the formulas.
"""

from mta.losses.dsa import dynamic_structural_alignment
from mta.losses.hra import hidden_representation_alignment
from mta.losses.importance import token_importance, uniform_importance
from mta.losses.kd import BASE_LOSSES, build_base_loss
from mta.losses.pooling import pool_spans
from mta.losses.span_masks import SpanBatch, span_token_mask, span_union_mask
from mta.losses.trajectory import TrajectoryAlignmentLoss

__all__ = [
    "BASE_LOSSES",
    "SpanBatch",
    "TrajectoryAlignmentLoss",
    "build_base_loss",
    "dynamic_structural_alignment",
    "hidden_representation_alignment",
    "pool_spans",
    "span_token_mask",
    "span_union_mask",
    "token_importance",
    "uniform_importance",
]
