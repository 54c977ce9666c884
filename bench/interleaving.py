"""How every benchmark here times variants side by side: interleaved rounds, paired ratios."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import TypeVar

V = TypeVar("V")


def interleaved_rounds(
    variants: Sequence[V],
    rounds: int,
    measure: Callable[[V], None],
    *,
    warm_up: Callable[[V], None],
    describe: Callable[[V], str],
) -> None:
    """``warm_up`` each variant once, then ``rounds`` rounds of ``measure`` on every variant, the
    order rotated by one each round (no variant always runs first, right after another); after
    each round a line of ``describe(variant)`` for all of them."""
    variants = list(variants)
    for variant in variants:
        warm_up(variant)
    for index in range(rounds):
        shift = index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            measure(variant)
        print(f"  round {index + 1}/{rounds}: " + ", ".join(describe(v) for v in variants), flush=True)


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """The median of per-round ratios: robust to slow drifts in the machine's load."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))
