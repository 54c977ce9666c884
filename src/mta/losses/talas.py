"""TALAS's loss terms (arXiv 2606.21851; ../shared/docs/TALAS.md §3-6), on pooled sentence embeddings.

Each student layer l = 1..L is pooled into a sentence embedding e_l (``[L, B, d_S]``; the pooling
is the caller's, ``mta.embedding.pooling.pool``); the teacher gives one embedding per text
(``[B, d_T]``, stored by ``mta embed``).

- TAMD (:class:`TeacherAnchor`): the top K layers each get ``1 − cos(W_l e_l, e_T)`` through one
  bias-free projection ``W_l: d_S -> d_T`` per layer, averaged over the K layers and the batch.
- LASD (:func:`lasd_loss`): each layer's in-batch cosine matrix ``R_l = Ê_l Ê_lᵀ`` (``[B, B]``)
  is pulled towards the layer above's, over every adjacent pair l, l + 1, averaged over the
  L − 1 pairs; per pair the mean over the B² entries (the author's ``F.mse_loss``) or their sum
  (eq. 5's squared Frobenius norm); the upper layer (the guide) optionally detached.
- SimCSE (:func:`simcse_loss`): InfoNCE between the last layer's embeddings of two dropout passes
  over the same batch, the other rows as negatives.

Pure torch, maths in fp32 at least (float64 stays float64), no loop over rows or tokens.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

PROJECTION_INIT_STD = 1e-3  # [A] model.build_projection_layer: W_l ~ N(0, 1e-3²)


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in fp32, or float64 when it already is."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def tamd_loss(projected: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """``projected [K, B, d_T]`` (W_l e_l of the K anchored layers), ``teacher [B, d_T]`` -> scalar:
    the mean over layers and rows of ``1 − cos(W_l e_l, e_T)``."""
    cosine = F.cosine_similarity(_wide(projected), _wide(teacher).unsqueeze(0), dim=-1)  # [K, B]
    return (1.0 - cosine).mean()


class TeacherAnchor(nn.Module):
    """TAMD with its projections: one ``nn.Linear(d_S, d_T, bias=False)`` per anchored layer,
    initialised N(0, 1e-3²) as the author's; ``forward(embeddings [K, B, d_S], teacher [B, d_T])``.

    ``drawn_for=L`` draws them as the author's ``model.build_projection_layer`` does: one
    projection per student layer, each built then drawn before the next, the top ``num_layers``
    kept (the same RNG state then gives his weights); None draws only the ones used."""

    def __init__(self, num_layers: int, student_dim: int, teacher_dim: int, *, drawn_for: int | None = None):
        super().__init__()
        if drawn_for is None:
            projections = [nn.Linear(student_dim, teacher_dim, bias=False) for _ in range(num_layers)]
            with torch.no_grad():
                for projection in projections:
                    projection.weight.normal_(mean=0.0, std=PROJECTION_INIT_STD)
        else:
            projections = []
            for _ in range(drawn_for):
                projections.append(nn.Linear(student_dim, teacher_dim, bias=False))
                with torch.no_grad():
                    projections[-1].weight.normal_(mean=0.0, std=PROJECTION_INIT_STD)
            projections = projections[drawn_for - num_layers :]
        self.projections = nn.ModuleList(projections)

    def forward(self, embeddings: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        projected = torch.stack(
            [projection(layer) for projection, layer in zip(self.projections, embeddings, strict=True)]
        )
        return tamd_loss(projected, teacher)


def similarity_matrices(embeddings: torch.Tensor) -> torch.Tensor:
    """``[L, B, d]`` -> ``[L, B, B]``: each layer's in-batch cosine similarities (fp32)."""
    unit = F.normalize(_wide(embeddings), dim=-1)
    return unit @ unit.transpose(-1, -2)


def lasd_loss(
    embeddings: torch.Tensor, *, detach_upper: bool = False, reduction: Literal["mean", "sum"] = "mean"
) -> torch.Tensor:
    """``embeddings [L, B, d]`` (layers bottom to top, L ≥ 2) -> scalar:
    ``1/(L−1) · Σ_l D(R_{l+1}, R_l)`` with D the mean (``reduction="mean"``) or sum (``"sum"``) of
    the squared differences of the B×B cosine matrices. ``detach_upper``: no gradient through
    R_{l+1}, the guide (the author's code lets it flow)."""
    matrices = similarity_matrices(embeddings)
    upper, lower = matrices[1:], matrices[:-1]
    if detach_upper:
        upper = upper.detach()
    squared = (upper - lower).square().flatten(1)  # [L-1, B²]
    per_pair = squared.mean(dim=1) if reduction == "mean" else squared.sum(dim=1)
    return per_pair.mean()


def simcse_loss(first: torch.Tensor, second: torch.Tensor, temperature: float = 0.1) -> torch.Tensor:
    """``first, second [B, d]``: one batch's embeddings from two dropout passes -> scalar
    ``CE(q pᵀ / τ, diagonal)`` with q, p the L2-normalised rows (row b's positive is b)."""
    q, p = F.normalize(_wide(first), dim=-1), F.normalize(_wide(second), dim=-1)
    scores = q @ p.transpose(0, 1) / temperature
    return F.cross_entropy(scores, torch.arange(len(q), device=scores.device))
