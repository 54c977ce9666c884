"""`mta inspect`: stream held-out annotated rows through a teacher and students, and measure.

For every student, one pass over the rows (the teacher's forward runs again for each student, so
memory holds one student's accumulators at a time):

1. linear CKA (:mod:`mta.inspection.cka`) between every student layer and every teacher layer
   (``hidden_states`` indices, 0 = the embeddings), per granularity: ``word`` and ``phrase`` spans
   pooled as MTA pools them (``mta.losses``: each layer's own attention importance, then
   :func:`~mta.losses.pooling.pool_spans`), and ``token`` states when both models share one
   tokenizer (else ``boundary`` spans: the spans both tokenisations agree on). Token positions
   leave out special tokens (BOS, EOS, padding, chat markers), whose outlier activations dominate
   linear CKA, and keep at most ``tokens_per_row`` evenly spaced positions of a row.
2. at each pair of the layer map: the structure agreement DSA aims at and HRA's held-out linear
   fit (:mod:`mta.inspection.structure`; the first half of the rows fits, the second measures).
3. a suggested layer map (:mod:`mta.inspection.layer_map`) from each student's span CKA.

The teacher's side comes from the teacher model, or from an ``mta teacher`` cache
(``teacher_cache``), which holds only the layers its recipe aligns: the CKA matrix then covers
those teacher layers only. Results are data (:func:`inspect_models` returns a dict);
:mod:`mta.inspection.report` writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mta.data.annotations import read_annotations
from mta.errors import MtaError
from mta.inspection.checks import SPAN_GRANULARITIES, granularities_of, held_out_statement, layer_map_source
from mta.inspection.cka import ESTIMATORS, LinearCKA
from mta.inspection.items import off_sink, pooled_spans, token_positions
from mta.inspection.layer_map import suggested_map
from mta.inspection.structure import ITEMS_PER_INPUT, HeldOutLinearFit, finite_or_none, structure_agreement
from mta.inspection.teacher_side import CachedTeacherSide, ModelTeacher, TeacherSide
from mta.losses.dsa import dynamic_structural_alignment
from mta.losses.importance import IMPORTANCE
from mta.losses.span_masks import SpanBatch
from mta.reporting import Reporter, SilentReporter
from mta.versions import MTA_VERSION


@dataclass
class InspectSettings:
    """What ``mta inspect`` measures and how (its options)."""

    rows: int = 200  # the first N rows of the annotations
    batch_size: int = 8
    layers: list[tuple[int, int, str]] | None = None  # the layer map; None: the recipe's
    recipe: str | None = None  # where the layer map comes from; None: a student's recipe.yaml
    estimator: str = "debiased"  # the CKA drawn and used for the suggestion (both are stored)
    tokens_per_row: int = 64
    include_special: bool = False
    allow_training_rows: bool = False
    teacher_cache: str | None = None
    device: str = "auto"
    dtype: str = "fp32"
    names: list[str] | None = None
    importance: str = "attention"
    notes: list[str] = field(default_factory=list)

    def check(self) -> None:
        if self.rows < 2:
            raise MtaError(f"--rows {self.rows}: give at least 2 (half the rows fit the linear map, half measure it)")
        if self.batch_size < 1:
            raise MtaError(f"--batch-size {self.batch_size}: give at least 1")
        if self.estimator not in ESTIMATORS:
            raise MtaError(f"--estimator {self.estimator}: choose {' or '.join(ESTIMATORS)}")
        if self.tokens_per_row < 1:
            raise MtaError(f"--tokens-per-row {self.tokens_per_row}: give at least 1")
        if self.importance not in IMPORTANCE:
            raise MtaError(f"importance '{self.importance}' is not one of {', '.join(IMPORTANCE)}")


def _fingerprint(path: str) -> str:
    from mta.models.weights import checkpoint_fingerprint

    return checkpoint_fingerprint(path)[0]


# --------------------------------------------------------------------------- the run


def _checked_inputs(
    teacher: str | None, students: Sequence[str], data: Path, settings: InspectSettings
) -> tuple[Any, int, list[str], bool]:
    """The annotations (of these tokenizers: their token ranges index these ids), how many rows
    are measured, the students' labels, and whether both sides share a tokenizer."""
    from mta.evaluation.models_under_test import check_checkpoint, checkpoint_names
    from mta.models.tokenizers import load_tokenizer, tokenizer_fingerprint

    if not students:
        raise MtaError("give at least one student")
    if teacher is None and settings.teacher_cache is None:
        raise MtaError("give the teacher, or --teacher-cache (the layers a recipe aligns only)")
    annotations = read_annotations(data)
    count = min(settings.rows, len(annotations))
    if count < 2:
        raise MtaError(f"{data} has {len(annotations)} rows; inspect needs at least 2")
    for checkpoint in ([teacher] if teacher else []) + list(students):
        check_checkpoint(checkpoint)
    labels = checkpoint_names(students, settings.names)
    manifest = annotations.manifest

    # The annotations must be of these tokenizers: their token ranges index these ids.
    for role, path in [("student", s) for s in students] + ([("teacher", teacher)] if teacher else []):
        found = tokenizer_fingerprint(load_tokenizer(path))
        if found != manifest[role]["fingerprint"]:
            raise MtaError(
                f"{path}'s tokenizer is not the {role} tokenizer {data} was annotated for "
                f"({manifest[role]['name']}); annotate held-out rows for this pair: "
                f"`mta annotate DATA.jsonl --teacher TEACHER --student STUDENT -o NEW_DIR`"
            )
    same_tokenizer = manifest["teacher"]["fingerprint"] == manifest["student"]["fingerprint"]
    same_tokenizer = manifest["teacher"]["fingerprint"] == manifest["student"]["fingerprint"]
    return annotations, count, labels, same_tokenizer


def _item_notes(settings: InspectSettings, same_tokenizer: bool) -> list[str]:
    """What the measured items leave out (the sink, special tokens) or keep, in words."""
    notes = []
    if settings.include_special:
        notes.append("CKA items include the first position and special tokens (--include-special)")
    else:
        notes.append(
            "CKA and the linear fit leave out each row's first position (the attention sink) and the spans "
            "covering it" + ("" if not same_tokenizer else ", and special-token positions (BOS, EOS, chat markers)")
        )
    if same_tokenizer:
        notes.append(f"token positions: at most {settings.tokens_per_row} evenly spaced per row")

    return notes


def _examples_and_batches(
    annotations: Any, count: int, student_tokenizer: Any, teacher_tokenizer: Any, boundary: bool, batch_size: int
) -> tuple[Any, list[tuple[str, np.ndarray]]]:
    """The first ``count`` rows as the loop batches them, and the batches: the first half's fit
    HRA's linear map, the second half's measure it."""
    from mta.training.batching import AnnotatedExamples

    pads = [t.pad_token_id if t.pad_token_id is not None else 0 for t in (student_tokenizer, teacher_tokenizer)]
    examples = AnnotatedExamples(
        annotations.table.slice(0, count),
        student_pad_id=pads[0],
        teacher_pad_id=pads[1],
        granularities=SPAN_GRANULARITIES,
        boundary=boundary,
    )
    half = count // 2
    batches = [
        (phase, np.arange(start, min(start + batch_size, end)))
        for phase, (begin, end) in (("fit", (0, half)), ("measure", (half, count)))
        for start in range(begin, end, batch_size)
    ]
    return examples, batches


def inspect_models(
    teacher: str | None,
    students: Sequence[str],
    data: str | Path,
    settings: InspectSettings | None = None,
    *,
    reporter: Reporter | None = None,
) -> dict[str, Any]:
    """Measure each student against the teacher on held-out annotated rows; returns the results
    (every matrix, the rows used, the models' fingerprints, mta's version) as plain data."""
    from mta.distributed import resolve_device
    from mta.dtypes import resolve_dtype
    from mta.evaluation.models_under_test import loaded_checkpoint
    from mta.models.tokenizers import load_tokenizer

    settings = settings or InspectSettings()
    settings.check()
    reporter = reporter or SilentReporter()
    annotations, count, labels, same_tokenizer = _checked_inputs(teacher, students, Path(data), settings)
    data = Path(data)
    notes = list(settings.notes)
    granularities = granularities_of(annotations, same_tokenizer, notes)
    boundary = "boundary" in granularities
    held_out = held_out_statement(students, data, annotations, allow=settings.allow_training_rows)

    layer_map, map_source = layer_map_source(settings.layers, settings.recipe, students)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    first_tokenizer = load_tokenizer(students[0])
    teacher_tokenizer = load_tokenizer(teacher) if teacher else first_tokenizer
    examples, batches = _examples_and_batches(
        annotations, count, first_tokenizer, teacher_tokenizer, boundary, settings.batch_size
    )
    half = count // 2
    special = [] if settings.include_special else sorted(set(first_tokenizer.all_special_ids))
    notes += _item_notes(settings, same_tokenizer)
    results: dict[str, Any] = {
        "mta_version": MTA_VERSION,
        "estimator": settings.estimator,
        "granularities": granularities,
        "rows": {
            "data": str(data),
            "count": count,
            "ids": [int(i) for i in annotations.table.column("id").slice(0, count).to_pylist()],
            "fit": half,
            "measure": count - half,
            "held_out": held_out,
        },
        "layer_map_source": map_source,
        "settings": {k: v for k, v in asdict(settings).items() if k not in ("notes", "names")},
        "notes": notes,
        "students": [],
    }

    teacher_context = (
        loaded_checkpoint(teacher, device, dtype) if teacher and settings.teacher_cache is None else nullcontext()
    )
    with teacher_context as loaded:
        if settings.teacher_cache is not None:
            side: TeacherSide = CachedTeacherSide(Path(settings.teacher_cache), annotations)
            notes.append(f"teacher layers from the cache {settings.teacher_cache}: {side.layers} only")
        else:
            assert loaded is not None  # the teacher's context yields (model, tokenizer)
            side = ModelTeacher(loaded[0], {})
        teacher_layers = side.layers
        teacher_depth = max(teacher_layers) if settings.teacher_cache is None else None
        results["teacher"] = {
            "path": teacher,
            "fingerprint": _fingerprint(teacher) if teacher else None,
            "layers": teacher_layers,
            **side.description,
        }
        for label, student in zip(labels, students, strict=True):
            entry = _inspect_student(
                label,
                student,
                side,
                teacher_depth if teacher_depth is not None else max(teacher_layers),
                layer_map,
                examples,
                batches,
                granularities=granularities,
                special=special,
                settings=settings,
                device=device,
                dtype=dtype,
                reporter=reporter,
            )
            results["students"].append(entry)
            thin = [f"{p['student']}→{p['teacher']}" for p in entry["aligned"] if p["underdetermined"]]
            if thin:
                notes.append(
                    f"{label}: the linear fit of {', '.join(thin)} saw fewer than {ITEMS_PER_INPUT} items per input "
                    "(the student's width + 1): it fits noise, and its HRA and 1 − R² on the other half overstate "
                    "the residual (1 − R² can exceed 1); give more --rows"
                )
    return results


def _inspect_student(
    label: str,
    student: str,
    side: TeacherSide,
    teacher_depth: int,
    layer_map: Any,
    examples: Any,
    batches: list[tuple[str, np.ndarray]],
    *,
    granularities: list[str],
    special: list[int],
    settings: InspectSettings,
    device: torch.device,
    dtype: torch.dtype,
    reporter: Reporter,
) -> dict[str, Any]:
    """One student measured against the teacher's side: its matrices, aligned pairs and
    suggested layer map."""
    from mta.evaluation.models_under_test import loaded_checkpoint
    from mta.training.config.layers import resolve_layer_map

    teacher_layers = side.layers
    with loaded_checkpoint(student, device, dtype) as (model, _):
        depth = int(model.config.num_hidden_layers)
        pairs = resolve_layer_map(layer_map, depth, teacher_depth)
        missing = sorted({p.teacher for p in pairs} - set(teacher_layers))
        if missing:
            raise MtaError(
                f"the layer map aligns teacher layer(s) {missing}, which the teacher cache does not hold "
                f"({teacher_layers}); give the teacher, or --layers within those"
            )
        reporter.start(f"inspect {label}", total=len(examples), unit="rows")
        try:
            measured = _stream_student(
                model,
                side,
                examples,
                batches,
                pairs=[(p.student, p.teacher, p.granularity) for p in pairs],
                granularities=granularities,
                special=special,
                settings=settings,
                device=device,
                reporter=reporter,
            )
        finally:
            reporter.stop()
    entry = {
        "label": label,
        "path": student,
        "fingerprint": _fingerprint(student),
        "layers": list(range(depth + 1)),
        **measured,
    }
    entry["layer_map"] = suggested_map(entry, teacher_layers, settings.estimator)
    return entry


class PairMeasures:
    """What is measured at each aligned pair ``(student, teacher, granularity)``, summed over
    batches: the structure agreement (Σ per-row Pearson, rows), DSA (Σ per-batch value ×
    contributing rows, rows) and HRA's held-out linear fit (fitted on the ``fit`` batches,
    measured on the others)."""

    def __init__(self, pairs: list[tuple[int, int, str]], student_dim: int, teacher_dim: int, device: torch.device):
        self.pairs = pairs
        self.fits = [HeldOutLinearFit(student_dim, teacher_dim, device=device) for _ in pairs]
        self.agreement = [[0.0, 0] for _ in pairs]
        self.dsa = [[0.0, 0] for _ in pairs]

    def update(
        self,
        phase: str,
        student_pooled: dict[str, Any],
        teacher_pooled: dict[str, Any],
        span_batches: dict[str, SpanBatch],
        kept: dict[str, torch.Tensor],
    ) -> None:
        for index, (s, t, g) in enumerate(self.pairs):
            student_spans = student_pooled[g][s][0]
            teacher_spans, salience = teacher_pooled[g][t]
            mask = span_batches[g].mask
            correlation, counted = structure_agreement(student_spans, teacher_spans, mask)
            self.agreement[index][0] += float(correlation[counted].sum())
            self.agreement[index][1] += int(counted.sum())
            contributing = int(((mask.sum(dim=1) >= 2) & ((salience * mask).sum(dim=1) > 0)).sum())
            if contributing:
                value = dynamic_structural_alignment(student_spans, teacher_spans, salience, mask)
                self.dsa[index][0] += float(value) * contributing
                self.dsa[index][1] += contributing
            if phase == "fit":  # the linear fit is least squares: without the sink's outliers
                self.fits[index].fit(student_spans, teacher_spans, kept[g])
            else:
                self.fits[index].measure(student_spans, teacher_spans, salience, kept[g])

    def results(
        self, matrices: dict[str, dict[str, Any]], estimator: str, teacher_layers: list[int]
    ) -> list[dict[str, Any]]:
        """One entry per pair: its CKA (from ``matrices``), agreement, DSA and the fit's result."""
        aligned = []
        for index, (s, t, g) in enumerate(self.pairs):
            agreement, dsa = self.agreement[index], self.dsa[index]
            aligned.append(
                {
                    "student": s,
                    "teacher": t,
                    "granularity": g,
                    "cka": matrices[g][estimator][s][teacher_layers.index(t)],
                    "structure_agreement": agreement[0] / agreement[1] if agreement[1] else None,
                    "structure_rows": agreement[1],
                    "dsa": dsa[0] / dsa[1] if dsa[1] else None,
                    **self.fits[index].result(),
                }
            )
        return aligned


def _stream_student(
    model: Any,
    side: TeacherSide,
    examples: Any,
    batches: list[tuple[str, np.ndarray]],
    *,
    pairs: list[tuple[int, int, str]],
    granularities: list[str],
    special: list[int],
    settings: InspectSettings,
    device: torch.device,
    reporter: Reporter,
) -> dict[str, Any]:
    depth = int(model.config.num_hidden_layers)
    student_layers = list(range(depth + 1))
    teacher_layers = side.layers
    student_dim, teacher_dim = int(model.config.hidden_size), side.hidden_size
    cka = {
        name: LinearCKA([student_dim] * len(student_layers), [teacher_dim] * len(teacher_layers), device=device)
        for name in granularities
    }
    measures = PairMeasures(pairs, student_dim, teacher_dim, device)
    span_names = [name for name in granularities if name != "token"]
    for phase, rows in batches:
        batch = examples.batch(rows).to(device)
        assert batch.teacher is not None
        with torch.no_grad():
            student_states = model(
                input_ids=batch.student.input_ids,
                attention_mask=batch.student.attention_mask,
                output_hidden_states=True,
            ).hidden_states
            teacher_states = side.hidden(batch.teacher.input_ids, batch.teacher.attention_mask, batch.row_ids)
        student_states = [state.float() for state in student_states]
        span_batches: dict[str, SpanBatch] = {name: batch.spans[name] for name in span_names}
        s_len, t_len = batch.student.input_ids.shape[1], batch.teacher.input_ids.shape[1]
        student_pooled = pooled_spans(
            student_states,
            student_layers,
            batch.student.attention_mask,
            {n: s.student_token_mask(s_len).float() for n, s in span_batches.items()},
            settings.importance,
        )
        teacher_pooled = pooled_spans(
            teacher_states,
            teacher_layers,
            batch.teacher.attention_mask,
            {n: s.teacher_token_mask(t_len).float() for n, s in span_batches.items()},
            settings.importance,
        )
        kept = {name: off_sink(span_batches[name], not settings.include_special) for name in span_names}
        for name in span_names:
            real = kept[name]
            cka[name].update(
                [student_pooled[name][layer][0][real] for layer in student_layers],
                [teacher_pooled[name][layer][0][real] for layer in teacher_layers],
            )
        if "token" in cka:
            chosen = token_positions(
                batch.student.input_ids,
                batch.student.attention_mask,
                special,
                settings.tokens_per_row,
                skip_first=not settings.include_special,
            )
            cka["token"].update(
                [student_states[layer][chosen] for layer in student_layers],
                [teacher_states[layer][chosen] for layer in teacher_layers],
            )
        measures.update(phase, student_pooled, teacher_pooled, span_batches, kept)
        reporter.advance(len(rows))
    matrices: dict[str, dict[str, Any]] = {
        name: {
            "items": accumulator.items,
            **{estimator: _listed(accumulator.matrix(estimator)) for estimator in ESTIMATORS},  # type: ignore[arg-type]
        }
        for name, accumulator in cka.items()
    }
    aligned = measures.results(matrices, settings.estimator, teacher_layers)
    return {"cka": matrices, "aligned": aligned}


def _listed(matrix: np.ndarray) -> list[list[float | None]]:
    return [[finite_or_none(float(value)) for value in row] for row in matrix]


__all__ = ["InspectSettings", "inspect_models"]
