"""The demo's picture of its students' trajectories: ``mta inspect`` on the models it trained.

After evaluation the demo inspects the pruned start and its three students against the teacher on
its Dolly dev annotations (rows no student trained on), into ``runs/demo/inspect/``
(``results.json``, ``results.md``, ``cka-<granularity>.png``); the demo's ``results.json`` names
them and its ``results.md`` shows the phrase-span heatmap. A finished inspection of the same
models' weights (their fingerprints) is reused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mta.reporting import Reporter

INSPECT_DIR = "inspect"


def inspect_students(
    teacher: Path,
    students: Mapping[str, Path],
    annotations: Path,
    root: Path,
    *,
    precision: str,
    rows: int | None = None,
    reporter: Reporter,
) -> dict[str, Any]:
    """``mta inspect`` of ``students`` ({label: directory}) against ``teacher`` on the first
    ``rows`` of ``annotations`` (None: every row), written to ``root/inspect``; returns what the
    demo's results record of it."""
    from mta.inspection import InspectSettings, inspect_models
    from mta.inspection.report import RESULTS_JSON, heatmap_name, write_inspection
    from mta.models.weights import checkpoint_fingerprint

    out = root / INSPECT_DIR
    fingerprints = [checkpoint_fingerprint(str(path))[0] for path in students.values()]
    previous = out / RESULTS_JSON
    results = json.loads(previous.read_text()) if previous.is_file() else None
    wanted = rows if rows is not None else 1_000_000  # None: every dev row
    if (
        results is None
        or [s["fingerprint"] for s in results["students"]] != fingerprints
        or results["settings"]["rows"] != wanted
    ):
        reporter.message("inspect: the students' layers against the teacher's, on the dev rows")
        settings = InspectSettings(rows=wanted, dtype=precision, names=list(students))
        results = inspect_models(
            str(teacher), [str(p) for p in students.values()], annotations, settings, reporter=reporter
        )
        write_inspection(results, out)
    else:
        reporter.message(f"inspect: already done ({out})")
    return {
        "directory": str(out),
        "pictures": {g: str(out / heatmap_name(g)) for g in results["granularities"]},
        "aligned": {s["label"]: s["aligned"] for s in results["students"]},
        "suggested": {s["label"]: s["layer_map"]["suggested"] for s in results["students"]},
    }


def inspect_lines(results: Mapping[str, Any]) -> list[str]:
    """The demo's results.md paragraph on the inspection (none for results without one)."""
    inspected = results.get("inspect")
    if not inspected:
        return []
    directory = Path(inspected["directory"])
    picture = Path(inspected["pictures"].get("phrase", next(iter(inspected["pictures"].values()))))
    return [
        f"Layer similarity of each student to the teacher on the Dolly dev rows (`mta inspect`; "
        f"{directory.name}/results.md has every granularity, the aligned pairs and the suggested layer maps):",
        "",
        f"![phrase-span CKA]({directory.name}/{picture.name})",
        "",
    ]


__all__ = ["INSPECT_DIR", "inspect_lines", "inspect_students"]
