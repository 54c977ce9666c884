"""A suggested layer map: for fixed student layers, the monotone teacher layers of highest total CKA.

The recipe's pairs keep their student layers and granularities; each gets a teacher layer so that
the teacher layers never decrease along the pairs (ordered by student layer) and the sum of each
pair's CKA (its granularity's matrix) is the largest such sum. Dynamic programming over
``(pair, teacher layer)``: ``best[i, t] = score[i, t] + max_{t' ≤ t} best[i − 1, t']``,
``O(pairs × teacher layers)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mta.errors import MtaError
from mta.inspection.structure import finite_or_none


def monotone_choice(scores: Sequence[Sequence[float]] | np.ndarray, *, strict: bool = False) -> tuple[list[int], float]:
    """Column indices ``t_0 ≤ t_1 ≤ …`` (``<`` with ``strict``), one per row of ``scores``
    (``[pairs, teacher layers]``), maximising ``Σ scores[i, t_i]``; NaN scores are never chosen
    (unless a row has nothing else). Returns ``(choice, total)``; ties go to the smallest layer."""
    table = np.asarray(scores, dtype=np.float64)
    if table.ndim != 2 or table.shape[0] == 0:
        return [], 0.0
    pairs, layers = table.shape
    if strict and pairs > layers:
        raise MtaError(f"{pairs} pairs cannot take strictly increasing teacher layers out of {layers}")
    table = np.where(np.isnan(table), -1e9, table)
    best = np.full((pairs, layers), -np.inf)
    back = np.zeros((pairs, layers), dtype=np.int64)
    best[0] = table[0]
    for i in range(1, pairs):
        previous = best[i - 1]
        if strict:  # the best of t' < t: shift by one
            previous = np.concatenate([[-np.inf], previous[:-1]])
        # running argmax of previous (first index of the maximum so far)
        running = np.maximum.accumulate(previous)
        argmax = np.zeros(layers, dtype=np.int64)
        for t in range(1, layers):
            argmax[t] = argmax[t - 1] if previous[t] <= running[t - 1] else t
        if strict:
            argmax = np.maximum(argmax - 1, 0)  # back to indices of best[i - 1]
        best[i] = table[i] + running
        back[i] = argmax
    choice = [int(np.argmax(best[-1]))]
    for i in range(pairs - 1, 0, -1):
        choice.append(int(back[i, choice[-1]]))
    choice.reverse()
    total = float(sum(np.asarray(scores, dtype=np.float64)[i, t] for i, t in enumerate(choice)))
    return choice, total


def suggested_map(student: Mapping[str, Any], teacher_layers: Sequence[int], estimator: str) -> dict[str, Any]:
    """The recipe's map beside the suggestion: the same student layers and granularities, the
    monotone teacher layers of highest total span CKA (``monotone_choice``), each pair's CKA."""
    pairs = sorted(student["aligned"], key=lambda pair: pair["student"])
    scores = [
        [
            np.nan if value is None else value
            for value in student["cka"][pair["granularity"]][estimator][pair["student"]]
        ]
        for pair in pairs
    ]
    choice, total = monotone_choice(scores)
    recipe_total = sum(score[teacher_layers.index(pair["teacher"])] for score, pair in zip(scores, pairs, strict=True))
    return {
        "recipe": [[p["student"], p["teacher"], p["granularity"]] for p in pairs],
        "recipe_cka": [
            finite_or_none(float(s[teacher_layers.index(p["teacher"])])) for s, p in zip(scores, pairs, strict=True)
        ],
        "recipe_total": finite_or_none(float(recipe_total)),
        "suggested": [[p["student"], teacher_layers[t], p["granularity"]] for p, t in zip(pairs, choice, strict=True)],
        "suggested_cka": [finite_or_none(float(s[t])) for s, t in zip(scores, choice, strict=True)],
        "suggested_total": finite_or_none(total),
    }


def layer_map_yaml(pairs: Sequence[Sequence[Any]], cka: Sequence[float | None]) -> str:
    """``loss.layers`` as recipe YAML, each pair's CKA as a comment."""
    lines = ["loss:", "  layers:"]
    for (s, t, g), value in zip(pairs, cka, strict=True):
        lines.append(f"    - [{s}, {t}, {g}]  # CKA {'n/a' if value is None else f'{value:.3f}'}")
    return "\n".join(lines)


__all__ = ["layer_map_yaml", "monotone_choice", "suggested_map"]
