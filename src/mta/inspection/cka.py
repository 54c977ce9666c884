"""Linear CKA (Kornblith et al. 2019) between every pair of two lists of feature sets, streamed.

Linear CKA of features ``X [n, p]`` and ``Y [n, q]`` (the same ``n`` items, e.g. tokens or
spans, seen by two layers) is ``HSIC(X, Y) / sqrt(HSIC(X, X) · HSIC(Y, Y))`` with the linear
kernel. Two estimators of HSIC:

- ``biased``: ``‖X_cᵀ Y_c‖²_F`` on column-centred features (the original estimator; with few
  items against the width it is biased towards 1 for unrelated features);
- ``debiased``: the unbiased HSIC of Song et al. (2012) as used for CKA by Nguyen et al. (2021):
  ``[tr(K̃L̃) + 1ᵀK̃1·1ᵀL̃1 / ((n−1)(n−2)) − 2/(n−2)·1ᵀK̃L̃1] / (n(n−3))`` with ``K̃ = XXᵀ`` and
  ``L̃ = YYᵀ`` with zeroed diagonals (it centres implicitly).

Both are computed from sums over items, never from the ``n × n`` Gram matrices, so memory does
not grow with the rows: ``Σ x yᵀ`` (every left width × every right width), ``Σ x``, ``Σ y``,
``Σ x xᵀ`` per left set, ``Σ y yᵀ`` per right set, and for the debiased form the item norms'
sums ``Σ ‖x‖²‖y‖²``, ``Σ x ‖y‖²``, ``Σ y ‖x‖²``. Everything accumulates in float64, on features
shifted by the first update's mean (exact in exact arithmetic: both estimators are invariant to
a shift of either side; in floating point the shift keeps the sums near centred, so the final
centring subtracts small numbers instead of large ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np
import torch

from mta.distributed import torch_threads
from mta.errors import MtaError

Estimator = Literal["debiased", "biased"]
ESTIMATORS: tuple[str, ...] = get_args(Estimator)
DTYPE = torch.float64


class LinearCKA:
    """Streaming linear CKA between each of ``left`` feature sets and each of ``right`` ones.

    left_dims, right_dims: the width of every feature set (e.g. one per layer of a model).
    ``update`` adds items (the same items on both sides, in the same order); ``matrix`` gives
    ``[len(left_dims), len(right_dims)]`` CKA values of everything added so far. The result of
    any split of the items into updates equals one update of them all (up to float64 rounding).
    """

    def __init__(self, left_dims: Sequence[int], right_dims: Sequence[int], *, device: str | torch.device = "cpu"):
        if not left_dims or not right_dims:
            raise MtaError("CKA needs at least one feature set on each side")
        self.left_dims, self.right_dims = list(left_dims), list(right_dims)
        self.device = torch.device(device)
        self.items = 0
        self._left_shift: torch.Tensor | None = None
        self._right_shift: torch.Tensor | None = None
        width_l, width_r = sum(self.left_dims), sum(self.right_dims)
        zeros = lambda *shape: torch.zeros(*shape, dtype=DTYPE, device=self.device)  # noqa: E731
        self.cross = zeros(width_l, width_r)  # Σ x yᵀ over every pair of sets at once
        self.left_sum, self.right_sum = zeros(width_l), zeros(width_r)
        self.left_gram = [zeros(d, d) for d in self.left_dims]  # Σ x xᵀ per set
        self.right_gram = [zeros(d, d) for d in self.right_dims]
        # For the debiased estimator: a = ‖x‖² per set, b = ‖y‖² per set.
        self.norm_products = zeros(len(self.left_dims), len(self.right_dims))  # Σ a_i b_j
        self.left_by_right_norms = zeros(width_l, len(self.right_dims))  # Σ x b_j
        self.right_by_left_norms = zeros(width_r, len(self.left_dims))  # Σ y a_i
        self.left_self = zeros(width_l, len(self.left_dims))  # Σ x a_i (the diagonal blocks serve)
        self.right_self = zeros(width_r, len(self.right_dims))
        self.left_norm_sum, self.right_norm_sum = zeros(len(self.left_dims)), zeros(len(self.right_dims))
        self.left_norm_squares, self.right_norm_squares = zeros(len(self.left_dims)), zeros(len(self.right_dims))

    def update(self, left: Sequence[torch.Tensor], right: Sequence[torch.Tensor]) -> None:
        """Add ``n`` items: ``left[i]`` is ``[n, left_dims[i]]``, ``right[j]`` is ``[n, right_dims[j]]``."""
        x = self._stacked(left, self.left_dims, "left")
        y = self._stacked(right, self.right_dims, "right")
        if x.shape[0] != y.shape[0]:
            raise MtaError(f"CKA: {x.shape[0]} items on the left and {y.shape[0]} on the right; give the same items")
        if x.shape[0] == 0:
            return
        if self._left_shift is None or self._right_shift is None:
            self._left_shift, self._right_shift = x.mean(dim=0), y.mean(dim=0)
        x, y = x - self._left_shift, y - self._right_shift
        self.items += x.shape[0]
        self.cross.addmm_(x.T, y)  # in place: no second every-width-by-every-width matrix
        self.left_sum += x.sum(dim=0)
        self.right_sum += y.sum(dim=0)
        a = _set_norms(x, self.left_dims)  # [n, sets]
        b = _set_norms(y, self.right_dims)
        for gram, block in zip(self.left_gram, _blocks(x, self.left_dims), strict=True):
            gram.addmm_(block.T, block)
        for gram, block in zip(self.right_gram, _blocks(y, self.right_dims), strict=True):
            gram.addmm_(block.T, block)
        self.norm_products += a.T @ b
        self.left_by_right_norms += x.T @ b
        self.right_by_left_norms += y.T @ a
        self.left_self += x.T @ a
        self.right_self += y.T @ b
        self.left_norm_sum += a.sum(dim=0)
        self.right_norm_sum += b.sum(dim=0)
        self.left_norm_squares += a.square().sum(dim=0)
        self.right_norm_squares += b.square().sum(dim=0)

    def matrix(self, estimator: Estimator = "debiased") -> np.ndarray:
        """``[left sets, right sets]`` float64 CKA of the items added so far.

        NaN where a side's HSIC is not positive (constant features) or, for the debiased
        estimator, with fewer than 4 items."""
        if estimator not in ESTIMATORS:
            raise MtaError(f"CKA estimator '{estimator}' is not one of {', '.join(ESTIMATORS)}")
        n = self.items
        out = np.full((len(self.left_dims), len(self.right_dims)), np.nan)
        if n < (4 if estimator == "debiased" else 2):
            return out
        # One thread: thousands of small ops on 576 x 576 blocks, which a second thread does not
        # speed up and which wait for it whenever another process holds the other core (5 s
        # instead of 0.3 s a matrix on the shared 2-core machine, issue 50).
        with torch_threads(1):
            return self._matrix(n, out, estimator)

    def _matrix(self, n: int, out: np.ndarray, estimator: Estimator) -> np.ndarray:
        left_self = [self._self_hsic("left", i, estimator) for i in range(len(self.left_dims))]
        right_self = [self._self_hsic("right", j, estimator) for j in range(len(self.right_dims))]
        left_slices, right_slices = _slices(self.left_dims), _slices(self.right_dims)
        for i, li in enumerate(left_slices):
            for j, rj in enumerate(right_slices):
                cross = self.cross[li, rj]
                sx, sy = self.left_sum[li], self.right_sum[rj]
                if estimator == "biased":
                    hsic = (cross - torch.outer(sx, sy) / n).square().sum()
                else:
                    hsic = _unbiased_hsic(
                        n,
                        trace=cross.square().sum() - self.norm_products[i, j],
                        left_total=sx.square().sum() - self.left_norm_sum[i],
                        right_total=sy.square().sum() - self.right_norm_sum[j],
                        product_total=sx @ cross @ sy
                        - sx @ self.left_by_right_norms[li, j]
                        - sy @ self.right_by_left_norms[rj, i]
                        + self.norm_products[i, j],
                    )
                denominator = left_self[i] * right_self[j]
                if denominator > 0:
                    out[i, j] = float(hsic) / float(np.sqrt(denominator))
        return out

    def _self_hsic(self, side: str, index: int, estimator: Estimator) -> float:
        n = self.items
        dims = self.left_dims if side == "left" else self.right_dims
        part = _slices(dims)[index]
        gram = (self.left_gram if side == "left" else self.right_gram)[index]
        total = (self.left_sum if side == "left" else self.right_sum)[part]
        if estimator == "biased":
            return float((gram - torch.outer(total, total) / n).square().sum())
        norm_sum = (self.left_norm_sum if side == "left" else self.right_norm_sum)[index]
        norm_squares = (self.left_norm_squares if side == "left" else self.right_norm_squares)[index]
        by_norms = (self.left_self if side == "left" else self.right_self)[part, index]
        base = total.square().sum() - norm_sum
        return float(
            _unbiased_hsic(
                n,
                trace=gram.square().sum() - norm_squares,
                left_total=base,
                right_total=base,
                product_total=total @ gram @ total - 2 * (total @ by_norms) + norm_squares,
            )
        )

    def _stacked(self, features: Sequence[torch.Tensor], dims: list[int], side: str) -> torch.Tensor:
        if len(features) != len(dims):
            raise MtaError(f"CKA: {len(features)} {side} feature sets given, {len(dims)} expected")
        for number, (tensor, dim) in enumerate(zip(features, dims, strict=True)):
            if tensor.dim() != 2 or tensor.shape[1] != dim:
                raise MtaError(f"CKA: {side} feature set {number} is {tuple(tensor.shape)}, expected [items, {dim}]")
        return torch.cat([tensor.to(device=self.device, dtype=DTYPE) for tensor in features], dim=1)


def _unbiased_hsic(
    n: int, *, trace: torch.Tensor, left_total: torch.Tensor, right_total: torch.Tensor, product_total: torch.Tensor
) -> torch.Tensor:
    """Song et al.'s unbiased HSIC from ``tr(K̃L̃)``, ``1ᵀK̃1``, ``1ᵀL̃1`` and ``1ᵀK̃L̃1``."""
    return (trace + left_total * right_total / ((n - 1) * (n - 2)) - 2 * product_total / (n - 2)) / (n * (n - 3))


def _slices(dims: Sequence[int]) -> list[slice]:
    ends = np.cumsum(dims).tolist()
    return [slice(end - dim, end) for end, dim in zip(ends, dims, strict=True)]


def _blocks(stacked: torch.Tensor, dims: Sequence[int]) -> list[torch.Tensor]:
    return list(torch.split(stacked, list(dims), dim=1))


def _set_norms(stacked: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """``[n, sets]``: each item's squared norm within each feature set."""
    return torch.stack([block.square().sum(dim=1) for block in _blocks(stacked, dims)], dim=1)


def linear_cka(x: torch.Tensor, y: torch.Tensor, estimator: Estimator = "debiased") -> float:
    """Linear CKA of two feature matrices ``[n, p]`` and ``[n, q]`` (one update of :class:`LinearCKA`)."""
    accumulator = LinearCKA([x.shape[1]], [y.shape[1]])
    accumulator.update([x], [y])
    return float(accumulator.matrix(estimator)[0, 0])


__all__ = ["ESTIMATORS", "Estimator", "LinearCKA", "linear_cka"]
