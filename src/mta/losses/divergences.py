"""The divergences between next-token distributions that the logit losses share, on
log-probabilities ``[n, vocab]`` (all in log space, so no mixture underflows)."""

from __future__ import annotations

import math

import torch

from mta.errors import MtaError


def _log(weight: float) -> float:
    return math.log(weight) if weight > 0 else -math.inf


def log_mixture(log_a: torch.Tensor, log_b: torch.Tensor, weight_a: float) -> torch.Tensor:
    """``log(weight_a · a + (1 − weight_a) · b)`` from log-probabilities, without underflow."""
    return torch.logaddexp(log_a + _log(weight_a), log_b + _log(1.0 - weight_a))


def kl_terms(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(p ‖ q)``'s term at each token, ``p · (log p − log q)``: ``[n, m]`` -> ``[n, m]``."""
    return log_p.exp() * (log_p - log_q)


def kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(p ‖ q)`` per row: ``[n, vocab]`` log-probabilities -> ``[n]``."""
    return kl_terms(log_p, log_q).sum(dim=1)


def check_unit_interval(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise MtaError(f"{name} must lie in [0, 1], got {value}")
