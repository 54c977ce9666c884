"""The difference between two variants' scores: a hierarchical bootstrap interval and the
smallest difference the design can detect (issue 33's comparison of MTA with its base).

Scores are ``[train_seeds, sampling_seeds, rows]`` per variant and set; rows are paired across
variants, training runs are not. A replicate redraws, with replacement, each variant's training
seeds, within them its sampling seeds, and per set the rows (one draw shared by both variants).
The interval is ``estimate ± t(0.975, df) · SE`` with ``df = n_A + n_B − 2`` training seeds (the
scarce level); it errs on the wide side (simulated coverage 0.98-0.99). The detectable difference
at 80 % power is ``(t(0.975, df) + t(0.80, df)) · SE``; tests/test_bootstrap.py checks both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

AVERAGE = "average"


@dataclass(frozen=True)
class Difference:
    """``estimate`` (B - A) with its 95 % interval ``[low, high]``, standard error and the smallest
    difference detectable at 80 % power, ``detectable``."""

    estimate: float
    low: float
    high: float
    standard_error: float
    detectable: float


def t_quantile(probability: float, df: int) -> float:
    """Student's t quantile (scipy's)."""
    from scipy.stats import t

    return float(t.ppf(probability, df))


def bootstrap_differences(
    base: Mapping[str, np.ndarray],
    other: Mapping[str, np.ndarray],
    *,
    replicates: int = 2000,
    seed: int = 0,
    power: float = 0.8,
    level: float = 0.95,
) -> dict[str, Difference]:
    """``{set: Difference, "average": Difference}`` of ``other - base``.

    base, other: ``{set: scores [train_seeds, sampling_seeds, rows]}`` over the same sets, each
    set's row count the same in both. Vectorised: one replicate is a gather, no loop over rows."""
    if set(base) != set(other) or not base:
        raise ValueError(f"both variants need the same sets, got {sorted(base)} and {sorted(other)}")
    rng = np.random.default_rng(seed)
    sets = sorted(base)
    shapes = {name: (np.asarray(base[name]).shape, np.asarray(other[name]).shape) for name in sets}
    for name, (a, b) in shapes.items():
        if len(a) != 3 or len(b) != 3 or a[2] != b[2]:
            raise ValueError(
                f"{name}: scores must be [train_seeds, sampling_seeds, rows] on the same rows, got {a}, {b}"
            )
    train = {"base": shapes[sets[0]][0][0], "other": shapes[sets[0]][1][0]}
    sampling = {"base": shapes[sets[0]][0][1], "other": shapes[sets[0]][1][1]}
    if any(train[v] < 2 for v in train):
        raise ValueError("each variant needs at least 2 training seeds for an interval")
    # Steps 1 and 2, shared by every set: [B, T] training seeds, [B, T, S] sampling seeds.
    draws = {
        variant: (
            rng.integers(0, train[variant], size=(replicates, train[variant])),
            rng.integers(0, sampling[variant], size=(replicates, train[variant], sampling[variant])),
        )
        for variant in ("base", "other")
    }
    replicate_differences: dict[str, np.ndarray] = {}
    estimates: dict[str, float] = {}
    for name in sets:
        rows = shapes[name][0][2]
        # Step 3: one row draw per replicate for both variants, as counts [rows, B].
        picked = rng.integers(0, rows, size=(replicates, rows))
        counts = np.zeros((rows, replicates))
        np.add.at(counts, (picked, np.arange(replicates)[:, None]), 1.0)
        means = {}
        for variant, scores in (("base", base[name]), ("other", other[name])):
            values = np.asarray(scores, dtype=np.float64)
            t, s, _ = values.shape
            row_means = (values.reshape(t * s, rows) @ counts / rows).reshape(t, s, replicates)  # [T, S, B]
            seeds, samples = draws[variant]
            chosen = row_means[seeds[:, :, None], samples, np.arange(replicates)[:, None, None]]  # [B, T, S]
            means[variant] = chosen.mean(axis=(1, 2))
        replicate_differences[name] = means["other"] - means["base"]
        estimates[name] = float(np.asarray(other[name]).mean() - np.asarray(base[name]).mean())
    replicate_differences[AVERAGE] = np.mean([replicate_differences[name] for name in sets], axis=0)
    estimates[AVERAGE] = float(np.mean([estimates[name] for name in sets]))
    df = train["base"] + train["other"] - 2
    two_sided = t_quantile(0.5 + level / 2, df)
    detect = two_sided + t_quantile(power, df)
    found = {}
    for name, values in replicate_differences.items():
        error = float(values.std(ddof=1))
        estimate = estimates[name]
        low, high = estimate - two_sided * error, estimate + two_sided * error
        found[name] = Difference(estimate, low, high, error, detect * error)
    return found


__all__ = ["AVERAGE", "Difference", "bootstrap_differences", "t_quantile"]
