"""`mta inspect`: which student layer follows which teacher layer, and what MTA's terms achieve.

- :mod:`mta.inspection.cka`: streaming linear CKA (float64 sums; biased and debiased estimators);
- :mod:`mta.inspection.structure`: DSA's structure agreement, HRA's held-out linear fit;
- :mod:`mta.inspection.layer_map`: the monotone teacher-layer choice of highest total CKA;
- :mod:`mta.inspection.inspect`: rows streamed through the teacher and each student;
- :mod:`mta.inspection.report`: results.md, the heatmaps, results.json (written last).

:func:`inspect` is the Python entry (``mta.inspect``); the command line renders the same data.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mta.inspection.cka import LinearCKA, linear_cka
from mta.inspection.inspect import InspectSettings, inspect_models
from mta.inspection.layer_map import monotone_choice
from mta.inspection.structure import HeldOutLinearFit, structure_agreement
from mta.reporting import Reporter


def inspect(
    teacher: str | None,
    students: Sequence[str],
    data: str | Path,
    *,
    out: str | Path | None = None,
    rows: int = 200,
    layers: Sequence[tuple[int, int, str]] | None = None,
    recipe: str | None = None,
    estimator: str = "debiased",
    teacher_cache: str | None = None,
    batch_size: int = 8,
    device: str = "auto",
    dtype: str = "fp32",
    reporter: Reporter | None = None,
) -> dict[str, Any]:
    """Layer similarity (linear CKA, every student layer × every teacher layer, per granularity),
    structure agreement and held-out linear fit at the aligned pairs, and a suggested layer map,
    for each student on the first ``rows`` rows of the annotations ``data``; with ``out`` also
    results.json, results.md and one heatmap per granularity there. Returns the results."""
    settings = InspectSettings(
        rows=rows,
        batch_size=batch_size,
        layers=[tuple(pair) for pair in layers] if layers else None,  # type: ignore[misc]
        recipe=recipe,
        estimator=estimator,
        teacher_cache=teacher_cache,
        device=device,
        dtype=dtype,
    )
    results = inspect_models(teacher, list(students), data, settings, reporter=reporter)
    if out is not None:
        from mta.inspection.report import write_inspection

        write_inspection(results, out)
    return results


__all__ = [
    "HeldOutLinearFit",
    "InspectSettings",
    "LinearCKA",
    "inspect",
    "inspect_models",
    "linear_cka",
    "monotone_choice",
    "structure_agreement",
]
