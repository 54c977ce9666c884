"""The hierarchical bootstrap of ``make evidence`` (mta.evaluation.bootstrap) on simulated data
with a planted difference: its 95 % interval covers the truth 90-99 % of the time over 200
replications, and the detectable difference it states is the one found with 80 % power (within
0.1) when it is planted.

The simulation has the design's levels: a training run's effect (shared by every set it is scored
on), a sampling seed's effect, a row effect shared by both variants (the same prompts) and noise.
"""

from __future__ import annotations

import numpy as np
import pytest

from mta.evaluation.bootstrap import AVERAGE, Difference, bootstrap_differences

REPLICATIONS = 200
SETS = {"dolly": 60, "vicuna": 40}


def simulate(rng: np.random.Generator, difference: float, seeds: int = 4, samples: int = 3):
    """``(base, other)``: ``{set: [seeds, samples, rows]}`` with ``other`` better by ``difference``."""
    runs = {variant: rng.normal(0.0, 1.0, (seeds, 1, 1)) for variant in ("base", "other")}
    found: dict[str, dict[str, np.ndarray]] = {"base": {}, "other": {}}
    for name, rows in SETS.items():
        row_effect = rng.normal(0.0, 3.0, rows)  # the prompt's difficulty, the same for both
        for variant, shift in (("base", 0.0), ("other", difference)):
            sampling = rng.normal(0.0, 0.4, (seeds, samples, 1))
            noise = rng.normal(0.0, 4.0, (seeds, samples, rows))
            found[variant][name] = 20.0 + shift + runs[variant] + sampling + row_effect + noise
    return found["base"], found["other"]


def replicate(difference: float, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    results = []
    for index in range(REPLICATIONS):
        base, other = simulate(rng, difference)
        results.append(bootstrap_differences(base, other, replicates=400, seed=index))
    return results


def test_the_interval_covers_a_planted_difference_90_to_99_percent_of_the_time():
    truth = 0.7
    results = replicate(truth, seed=1)
    for name in (*SETS, AVERAGE):
        covered = np.mean([r[name].low <= truth <= r[name].high for r in results])
        assert 0.90 <= covered <= 0.99, (name, covered)


def excludes_zero(difference: Difference) -> bool:
    return difference.low > 0 or difference.high < 0


def test_the_stated_detectable_difference_is_found_with_80_percent_power():
    pilot = replicate(0.0, seed=2)
    detectable = float(np.median([r[AVERAGE].detectable for r in pilot]))
    assert np.mean([excludes_zero(r[AVERAGE]) for r in pilot]) <= 0.1  # no difference: rarely "found"
    planted = replicate(detectable, seed=3)
    found = np.mean([excludes_zero(r[AVERAGE]) for r in planted])
    assert abs(found - 0.8) <= 0.1, (detectable, found)


def test_the_estimate_is_the_difference_of_means_and_bad_shapes_are_refused():
    rng = np.random.default_rng(0)
    base, other = simulate(rng, 1.0)
    result = bootstrap_differences(base, other, replicates=100)
    for name in SETS:
        assert result[name].estimate == pytest.approx(other[name].mean() - base[name].mean())
    assert result[AVERAGE].estimate == pytest.approx(np.mean([result[n].estimate for n in SETS]))
    with pytest.raises(ValueError, match="same rows"):
        bootstrap_differences({"dolly": base["dolly"]}, {"dolly": other["dolly"][:, :, :5]})
    with pytest.raises(ValueError, match="at least 2 training seeds"):
        bootstrap_differences({"dolly": base["dolly"][:1]}, {"dolly": other["dolly"][:1]})
