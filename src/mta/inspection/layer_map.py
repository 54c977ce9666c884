"""A suggested layer map: for fixed student layers, the monotone teacher layers of highest total CKA.

The recipe's pairs keep their student layers and granularities; each gets a teacher layer so that
the teacher layers never decrease along the pairs (ordered by student layer) and the sum of each
pair's CKA (its granularity's matrix) is the largest such sum. Dynamic programming over
``(pair, teacher layer)``: ``best[i, t] = score[i, t] + max_{t' ≤ t} best[i − 1, t']``,
``O(pairs × teacher layers)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mta.errors import MtaError


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


__all__ = ["monotone_choice"]
