"""The evidence's mechanism outcomes (issue 47): teacher agreement and trajectory agreement, each
a resumable stage, and the arrays the bootstrap compares.

- **Teacher agreement** (:mod:`mta.evaluation.teacher_agreement`): the fine-tuned teacher and every
  student (the pruned start too) in memory, each test set's first rows teacher-forced on their
  first reference; ``agreement.json`` holds every row's fkl, srkl and top-1 agreement per student,
  keyed on the models' fingerprints, and is written after each set (a stopped stage keeps its
  finished sets).
- **Trajectory** (:mod:`mta.inspection`): ``mta inspect`` of every student against the fine-tuned
  teacher on the annotated inspect rows (Dolly test rows: no run trained on them or was chosen by
  them), at the ``auto`` layer pairs of the runs; ``inspect/results.json`` is reused when it holds
  the same students' fingerprints.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mta.errors import MtaError
from mta.files import atomic_write_json
from mta.reporting import Reporter

if TYPE_CHECKING:
    from mta.demo.evidence import EvidenceSettings

TRAJECTORY_MEASURES = ("structure_agreement", "cka")


def _fingerprints(models: Mapping[str, Path]) -> dict[str, str]:
    from mta.models.weights import checkpoint_fingerprint

    return {label: checkpoint_fingerprint(str(path))[0] for label, path in models.items()}


def agreement_stage(
    teacher: Path,
    students: Mapping[str, Path],
    data_dir: Path,
    out: Path,
    settings: EvidenceSettings,
    cap: int,
    reporter: Reporter,
) -> dict[str, Any]:
    """Every row's teacher agreement per set and student, into ``out`` (``agreement.json``);
    returns what it holds. Sets already in ``out`` for the same models are kept."""
    from mta.distributed import resolve_device
    from mta.dtypes import resolve_dtype
    from mta.evaluation.datasets import BENCHMARKS, find_set_file, load_eval_set
    from mta.evaluation.models_under_test import loaded_checkpoint
    from mta.evaluation.teacher_agreement import teacher_agreement

    key = {
        "teacher": _fingerprints({"teacher": teacher})["teacher"],
        "students": _fingerprints(students),
        "rows": settings.eval_rows,
        "max_prompt_length": settings.max_prompt_length_eval,
        "max_response_length": cap,
    }
    found = json.loads(out.read_text()) if out.is_file() else None
    record: dict[str, Any] = found if found is not None and found.get("key") == key else {"key": key, "sets": {}}
    missing = [name for name in settings.test_sets if name not in record["sets"]]
    if not missing:
        reporter.message("teacher agreement: already measured")
        return record
    device = resolve_device("auto")
    dtype = resolve_dtype(settings.resolved_precision(), device)
    with contextlib.ExitStack() as stack:
        loaded_teacher = stack.enter_context(loaded_checkpoint(str(teacher), device, dtype))
        loaded = {label: stack.enter_context(loaded_checkpoint(str(p), device, dtype)) for label, p in students.items()}
        for name in missing:
            benchmark = BENCHMARKS[name]
            path = find_set_file(data_dir, benchmark)
            if path is None:
                raise MtaError(f"teacher agreement needs the {benchmark.title} set under {data_dir}")
            rows = load_eval_set(benchmark, path, limit=settings.eval_rows).rows
            measured = teacher_agreement(
                loaded_teacher,
                loaded,
                rows,
                max_prompt_length=settings.max_prompt_length_eval,
                max_response_length=cap,
                batch_size=settings.batch_size,
                reporter=reporter,
                description=f"teacher agreement: {benchmark.title}",
            )
            record["sets"][name] = {label: rows_of.to_dict() for label, rows_of in measured.items()}
            atomic_write_json(out, record)
    return record


def agreement_scores(
    record: Mapping[str, Any], labels: Sequence[str], measure: str, sets: Sequence[str]
) -> dict[str, np.ndarray]:
    """``{set: [runs, 1, rows]}`` of one measure for the runs ``labels`` (the bootstrap's shape:
    teacher forcing has no sampling seed)."""
    return {
        name: np.asarray([[record["sets"][name][label][measure]] for label in labels], dtype=np.float64)
        for name in sets
    }


def layer_pairs(student: Path, teacher: Path) -> list[tuple[int, int, str]]:
    """The ``auto`` layer map of the two models' depths (the runs' ``loss.layers: auto``)."""
    from mta.training.config.layers import auto_layer_map

    def depth(path: Path) -> int:
        return int(json.loads((path / "config.json").read_text())["num_hidden_layers"])

    return [(p.student, p.teacher, p.granularity) for p in auto_layer_map(depth(student), depth(teacher))]


def trajectory_stage(
    teacher: Path,
    students: Mapping[str, Path],
    annotations: Path,
    out: Path,
    settings: EvidenceSettings,
    reporter: Reporter,
) -> dict[str, Any]:
    """``mta inspect`` of ``students`` against ``teacher`` on ``annotations`` into ``out``, reused
    when ``out`` holds the same students' fingerprints; returns the inspection's results."""
    from mta.inspection import InspectSettings, inspect_models
    from mta.inspection.report import RESULTS_JSON, write_inspection

    fingerprints = list(_fingerprints(students).values())
    previous = out / RESULTS_JSON
    results = json.loads(previous.read_text()) if previous.is_file() else None
    if results is not None and [s["fingerprint"] for s in results["students"]] == fingerprints:
        reporter.message(f"trajectory: already inspected ({out})")
        return results
    reporter.message("trajectory: the students' aligned layers against the teacher's, on held-out test rows")
    inspect = InspectSettings(
        rows=settings.inspect_rows,
        dtype=settings.resolved_precision(),
        names=list(students),
        layers=layer_pairs(next(iter(students.values())), teacher),
    )
    results = inspect_models(str(teacher), [str(p) for p in students.values()], annotations, inspect, reporter=reporter)
    write_inspection(results, out)
    return results


def pair_name(pair: Mapping[str, Any]) -> str:
    return f"{pair['student']}->{pair['teacher']} {pair['granularity']}"


def trajectory_scores(results: Mapping[str, Any], labels: Sequence[str], measure: str) -> dict[str, np.ndarray]:
    """``{aligned pair: [runs, 1, 1]}`` of one measure (a value per student and pair: the
    bootstrap then resamples the training seeds only). A pair without a value is an error."""
    by_label = {student["label"]: student for student in results["students"]}
    pairs = [pair_name(p) for p in by_label[labels[0]]["aligned"]]
    scores: dict[str, list[list[list[float]]]] = {name: [] for name in pairs}
    for label in labels:
        for pair in by_label[label]["aligned"]:
            value = pair[measure]
            if value is None:
                raise MtaError(f"mta inspect measured no {measure} for {label} at {pair_name(pair)}: give more rows")
            scores[pair_name(pair)].append([[float(value)]])
    return {name: np.asarray(values, dtype=np.float64) for name, values in scores.items()}


__all__ = [
    "TRAJECTORY_MEASURES",
    "agreement_scores",
    "agreement_stage",
    "layer_pairs",
    "pair_name",
    "trajectory_scores",
    "trajectory_stage",
]
