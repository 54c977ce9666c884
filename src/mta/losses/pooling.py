"""Span representations: importance-weighted means of a span's token states (docs/method.md §2)."""

from __future__ import annotations

import torch

MASS_EPS = 1e-8


def pool_spans(
    hidden: torch.Tensor, weights: torch.Tensor, span_token_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool every span of a batch with one batched matmul.

    hidden: ``[batch, seq, dim]`` one layer's hidden states.
    weights: ``[batch, seq]`` token importance (0 on padding).
    span_token_mask: ``[batch, spans, seq]`` bool (or 0/1 float), True where token t lies in
    span k.
    Returns ``(spans [batch, spans, dim], mass [batch, spans])`` in fp32: ``spans[b, k]`` is
    ``Σ_t w_t H_t / max(Σ_t w_t, ε)`` over the span's tokens and ``mass[b, k]`` its summed
    weight (the span's salience before normalisation). A span with no token pools to zeros.
    """
    span_weights = span_token_mask.float() * weights.float().unsqueeze(1)  # [B, K, T]
    mass = span_weights.sum(dim=-1)
    summed = torch.bmm(span_weights, hidden.float())  # [B, K, D]
    return summed / mass.clamp(min=MASS_EPS).unsqueeze(-1), mass
