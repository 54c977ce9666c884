"""What DSA and HRA aim at, measured at one aligned layer pair on held-out rows.

- :func:`structure_agreement`: DSA matches the span-by-span cosine matrices of the two models
  (``mta.losses.dsa``); their agreement on a row is the Pearson correlation of the two matrices'
  entries above the diagonal (rows with at least 3 spans), averaged over rows. 1 when the
  student's span states equal the teacher's up to a rotation and a scale, near 0 when unrelated.
- :class:`HeldOutLinearFit`: HRA pulls a linear projection of the student's states onto the
  teacher's (``mta.losses.hra``). How far the best linear map gets on text it was not fitted on:
  least squares with a bias, fitted on the first half of the rows, measured on the second half
  as HRA's own term (salience-weighted ``1 − cos``, ``mta.losses.hra``) and as the relative
  squared residual ``Σ‖y − ŷ‖² / Σ‖y − ȳ‖²`` (``1 − R²``; ȳ the measured half's mean). Both
  halves stream: the normal equations and the residual sums accumulate in float64.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mta.errors import MtaError
from mta.losses.dsa import COS_EPS
from mta.losses.hra import hidden_representation_alignment

MIN_SPANS = 3  # a row with 3 spans has 3 pairs: the fewest that make a correlation meaningful
# Fewer fitting items than this many per input (the student's width + 1) and least squares
# mostly fits noise: on the demo pair, 613 phrase spans for 577 inputs gave 1 − R² of 3.9 on the
# other half, 3,363 gave 0.81.
ITEMS_PER_INPUT = 5
DTYPE = torch.float64


def structure_agreement(
    student_spans: torch.Tensor, teacher_spans: torch.Tensor, span_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row Pearson correlation of the two span cosine matrices.

    student_spans ``[batch, spans, d_s]``, teacher_spans ``[batch, spans, d_t]`` (the same spans
    in the same order), span_mask ``[batch, spans]``. Returns ``(correlation [batch] float64,
    counted [batch] bool)``: a row counts when it has at least ``MIN_SPANS`` real spans and both
    matrices vary over its pairs (its correlation is 0 otherwise).
    """
    mask = span_mask.bool()
    num_spans = mask.shape[1]
    above = torch.triu(torch.ones(num_spans, num_spans, dtype=torch.bool, device=mask.device), diagonal=1)
    pairs = (mask.unsqueeze(2) & mask.unsqueeze(1) & above).to(DTYPE)  # [B, K, K]
    count = pairs.sum(dim=(1, 2))
    student, teacher = _cosines(student_spans), _cosines(teacher_spans)
    safe = count.clamp(min=1)
    student_c = (student - ((student * pairs).sum(dim=(1, 2)) / safe)[:, None, None]) * pairs
    teacher_c = (teacher - ((teacher * pairs).sum(dim=(1, 2)) / safe)[:, None, None]) * pairs
    covariance = (student_c * teacher_c).sum(dim=(1, 2))
    spread = (student_c.square().sum(dim=(1, 2)) * teacher_c.square().sum(dim=(1, 2))).sqrt()
    counted = (mask.sum(dim=1) >= MIN_SPANS) & (spread > 1e-12)
    correlation = torch.where(counted, covariance / spread.clamp(min=1e-300), torch.zeros_like(covariance))
    return correlation, counted


def _cosines(spans: torch.Tensor) -> torch.Tensor:
    unit = F.normalize(spans.to(DTYPE), dim=-1, eps=COS_EPS)
    return torch.bmm(unit, unit.transpose(1, 2))


class HeldOutLinearFit:
    """The best linear map (with a bias) from student items to teacher items, fitted on some
    rows and measured on others, streamed: ``fit`` every batch of the first half, then
    ``measure`` every batch of the second (the map is solved at the first ``measure``)."""

    def __init__(self, student_dim: int, teacher_dim: int, *, ridge: float = 1e-6, device: str | torch.device = "cpu"):
        self.ridge = ridge
        self.device = torch.device(device)
        self.gram = torch.zeros(student_dim + 1, student_dim + 1, dtype=DTYPE, device=self.device)  # [x 1]ᵀ[x 1]
        self.cross = torch.zeros(student_dim + 1, teacher_dim, dtype=DTYPE, device=self.device)  # [x 1]ᵀ y
        self.fitted_items = 0
        self.weight: torch.Tensor | None = None
        self.measured_items = 0
        self.squared_error = 0.0
        self.target_sum = torch.zeros(teacher_dim, dtype=DTYPE, device=self.device)
        self.target_squares = 0.0
        self.cosine_sum = 0.0  # Σ over rows of HRA's per-row value
        self.cosine_rows = 0

    def fit(self, student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> None:
        """Add the masked items of a batch to the fit: ``[batch, items, d]`` each, mask ``[batch, items]``."""
        if self.weight is not None:
            raise MtaError("the linear map is already solved; fit every fitting batch before the first measure")
        real = mask.bool()
        x, y = _with_bias(student[real].to(self.device)), teacher[real].to(self.device, DTYPE)
        self.gram += x.T @ x
        self.cross += x.T @ y
        self.fitted_items += x.shape[0]

    def measure(self, student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> None:
        """Score the map on a batch it was not fitted on (weights: HRA's, e.g. span salience)."""
        if self.weight is None:
            self.weight = self._solve()
        student, teacher = student.to(self.device), teacher.to(self.device)
        weights, mask = weights.to(self.device), mask.to(self.device)
        batch = student.shape[0]
        projected = (_with_bias(student.reshape(-1, student.shape[-1])) @ self.weight).reshape(
            batch, -1, self.weight.shape[1]
        )
        real = mask.bool()
        y = teacher[real].to(DTYPE)
        self.squared_error += float((projected[real] - y).square().sum())
        self.target_sum += y.sum(dim=0)
        self.target_squares += float(y.square().sum())
        self.measured_items += y.shape[0]
        contributing = int(((weights.float() * real).sum(dim=1) > 0).sum())
        if contributing:
            value = hidden_representation_alignment(projected.float(), teacher.float(), weights, real)
            self.cosine_sum += float(value) * contributing
            self.cosine_rows += contributing

    def _solve(self) -> torch.Tensor:
        if self.fitted_items == 0:
            raise MtaError("the held-out linear fit has no fitting items (no spans in the first half of the rows)")
        scale = float(torch.diagonal(self.gram).mean()) or 1.0
        regularised = self.gram + self.ridge * scale * torch.eye(self.gram.shape[0], dtype=DTYPE, device=self.device)
        return torch.linalg.solve(regularised, self.cross)

    def result(self) -> dict[str, float | int | None]:
        """``relative_residual`` (1 − R²), ``hra`` (HRA's 1 − cos, salience-weighted, mean over
        rows), and the item and row counts; None where nothing was measured."""
        n = self.measured_items
        spread = self.target_squares - float(self.target_sum.square().sum()) / n if n else 0.0
        return {
            "relative_residual": self.squared_error / spread if n and spread > 0 else None,
            "hra": self.cosine_sum / self.cosine_rows if self.cosine_rows else None,
            "fitted_items": self.fitted_items,
            "underdetermined": self.fitted_items < ITEMS_PER_INPUT * self.gram.shape[0],
            "measured_items": n,
            "measured_rows": self.cosine_rows,
        }


def _with_bias(x: torch.Tensor) -> torch.Tensor:
    x = x.to(DTYPE)
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=DTYPE, device=x.device)], dim=1)


def finite_or_none(value: float) -> float | None:
    """``value``, or None for NaN / infinity (JSON has neither)."""
    return value if math.isfinite(value) else None


__all__ = ["ITEMS_PER_INPUT", "MIN_SPANS", "HeldOutLinearFit", "finite_or_none", "structure_agreement"]
