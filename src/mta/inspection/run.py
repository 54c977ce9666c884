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

import os
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mta.errors import MtaError
from mta.inspection.cka import ESTIMATORS, LinearCKA
from mta.inspection.layer_map import monotone_choice
from mta.inspection.structure import HeldOutLinearFit, finite_or_none, structure_agreement
from mta.losses.dsa import dynamic_structural_alignment
from mta.losses.importance import IMPORTANCE
from mta.losses.pooling import pool_spans
from mta.losses.span_masks import SpanBatch
from mta.reporting import Reporter, SilentReporter
from mta.store.read import Annotations, read_annotations
from mta.versions import MTA_VERSION

SPAN_GRANULARITIES = ("word", "phrase")
RECIPE_FILE = "recipe.yaml"  # what `mta distill` saves beside final/, best/ and every checkpoint


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


# --------------------------------------------------------------------------- the teacher's side


class TeacherSide:
    """Hidden states of the teacher for a batch: ``layers`` and ``hidden(batch)`` -> {layer: [B, T, d]}."""

    layers: list[int]
    hidden_size: int
    description: dict[str, Any]

    def hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, row_ids: Sequence[str]
    ) -> dict[int, torch.Tensor]:
        raise NotImplementedError


class ModelTeacher(TeacherSide):
    def __init__(self, model: Any, description: dict[str, Any]):
        self.model = model
        self.layers = list(range(model.config.num_hidden_layers + 1))
        self.hidden_size = int(model.config.hidden_size)
        self.description = description

    @torch.no_grad()
    def hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, row_ids: Sequence[str]
    ) -> dict[int, torch.Tensor]:
        states = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
        return {layer: state.float() for layer, state in enumerate(states)}


class CachedTeacherSide(TeacherSide):
    """The teacher layers an ``mta teacher`` cache holds, for the annotations it was built from."""

    def __init__(self, directory: Path, annotations: Annotations):
        from mta.store.read import read_stage_manifest
        from mta.training.teacher_cache.content import ARTEFACT, CACHE_VERSION, CONTENT_KEYS, teacher_tokens_fingerprint
        from mta.training.teacher_cache.read import TeacherCache

        manifest = read_stage_manifest(
            directory,
            artefact=ARTEFACT,
            version_key="teacher_cache_version",
            version=CACHE_VERSION,
            command="mta teacher",
            build=f"mta teacher --recipe RECIPE -o {directory.parent}",
            what="--teacher-cache: ",
        )
        # Everything as stored, but the teacher tokens of these annotations and no logits:
        # a cache of other annotations is refused naming data.train / data.dev.
        expected = {key: manifest.get(key) for key in CONTENT_KEYS}
        expected.update(
            teacher_weights=None, logits=False, teacher_tokens=teacher_tokens_fingerprint(annotations.table)
        )
        try:
            self.cache = TeacherCache(directory, expected)
        except MtaError as error:
            raise MtaError(
                f"--teacher-cache {directory} was not built from {annotations.directory} (give the split "
                f"directory of the cache built from these annotations, e.g. DIR/dev): {error}"
            ) from error
        self.layers = list(self.cache.stored_layers)
        self.cache.layers = self.layers
        self.hidden_size = self.cache.hidden_size
        self.description = {"teacher_cache": str(directory), "layers": self.layers, "teacher": manifest.get("teacher")}

    @torch.no_grad()
    def hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, row_ids: Sequence[str]
    ) -> dict[int, torch.Tensor]:
        from mta.training.batching import TokenBatch, TrainBatch

        side = TokenBatch(input_ids, attention_mask, input_ids)
        output = self.cache.outputs(TrainBatch(list(row_ids), side, side, {}))
        return dict(output.hidden_states)


# --------------------------------------------------------------------------- features of a batch


def pooled_spans(
    hidden: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
    layers: Sequence[int],
    attention_mask: torch.Tensor,
    span_masks: Mapping[str, torch.Tensor],
    importance: str = "attention",
) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """``{granularity: {layer: (spans [B, K, d], salience [B, K])}}``: every layer's spans pooled
    as MTA pools them (that layer's token importance, ``mta.losses.importance``, then
    ``pool_spans``). span_masks: ``{granularity: [B, K, T] float}``."""
    weigh = IMPORTANCE[importance]
    out: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {name: {} for name in span_masks}
    for layer in layers:
        state = hidden[layer]
        weights = weigh(state, attention_mask)
        for name, mask in span_masks.items():
            out[name][layer] = pool_spans(state, weights, mask)
    return out


def token_positions(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    special_ids: Sequence[int],
    per_row: int,
    *,
    skip_first: bool = True,
) -> torch.Tensor:
    """``[B, T]`` bool: the real positions of each row that are not special tokens nor (with
    ``skip_first``) the row's first real position, at most ``per_row`` of them, evenly spaced
    over the row (the first eligible one always kept)."""
    eligible = attention_mask.bool()
    if special_ids:
        eligible &= ~torch.isin(input_ids, torch.tensor(list(special_ids), device=input_ids.device))
    if skip_first:  # the attention sink: BOS where the tokenizer adds one, else the first token
        first = attention_mask.long().argmax(dim=1)
        eligible &= torch.arange(input_ids.shape[1], device=input_ids.device)[None, :] != first[:, None]
    rank = eligible.long().cumsum(dim=1) - 1  # the position's index among its row's eligible ones
    count = eligible.sum(dim=1, keepdim=True)
    bucket = rank * per_row // count.clamp(min=1)  # which of per_row evenly spaced slots it falls in
    previous = (rank - 1) * per_row // count.clamp(min=1)
    first_of_bucket = (rank == 0) | (bucket != previous)
    return eligible & ((count <= per_row) | first_of_bucket)


# --------------------------------------------------------------------------- rows and checks


def held_out_problem(student: str, data: Path, annotations: Annotations) -> str | None:
    """Why ``data`` looks like rows ``student`` was trained on (from its ``recipe.yaml``), or None."""
    recipe_path = Path(student) / RECIPE_FILE
    if not recipe_path.is_file():
        return None
    from mta.training.config.loading import load_recipe

    try:
        recipe = load_recipe(recipe_path)
    except MtaError:
        return None  # not a recipe this mta reads: nothing to compare
    written = recipe.data.train  # type: ignore[attr-defined]
    train = Path(recipe.resolve(written, "data.train"))
    same = _same_path(train, data) or _same_path(Path(recipe.output_dir) / "data" / "train", data)  # type: ignore[attr-defined]
    if not same and train.is_dir():
        try:
            theirs = read_annotations(train).manifest.get("input", {}).get("sha256")
        except MtaError:
            theirs = None
        same = theirs is not None and theirs == annotations.manifest.get("input", {}).get("sha256")
    if same:
        return f"{student} was trained on {train} (its {RECIPE_FILE}: data.train), the rows of {data}"
    return None


def _same_path(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def held_out_statement(students: Sequence[str], data: Path, annotations: Annotations, *, allow: bool) -> str:
    """What the results say about the rows: held out as far as the students' ``recipe.yaml``
    tell, or not checkable; training rows of a student are refused unless ``allow``."""
    problems = [p for p in (held_out_problem(s, data, annotations) for s in students) if p]
    if problems and not allow:
        raise MtaError(
            "; ".join(problems) + ". Inspect on held-out rows (e.g. the dev annotations), or pass "
            "--allow-training-rows to measure on training rows anyway"
        )
    if problems:
        return "training rows, measured with --allow-training-rows: " + "; ".join(problems)
    if any((Path(s) / RECIPE_FILE).is_file() for s in students):
        return "held out as far as the students' recipe.yaml tell (their data.train is another set)"
    return "not checked: no student carries a recipe.yaml naming its training rows"


def granularities_of(annotations: Annotations, same_tokenizer: bool, notes: list[str]) -> list[str]:
    """``token`` (one tokenizer) or ``boundary`` (two, when the annotations hold boundary spans),
    then ``word`` and ``phrase``; a note says which across tokenizers."""
    if same_tokenizer:
        return ["token", *SPAN_GRANULARITIES]
    table = annotations.table
    boundary = "boundary_spans" in table.column_names and table.column("boundary_spans").null_count == 0
    notes.append(
        "the tokenizers differ: no token-level CKA; "
        + (
            "boundary spans (both tokenisations agree on them) instead"
            if boundary
            else "the annotations hold no boundary spans"
        )
    )
    return (["boundary"] if boundary else []) + list(SPAN_GRANULARITIES)


def layer_map_source(settings: InspectSettings, students: Sequence[str]) -> tuple[Any, str]:
    """The layer map (``"auto"`` or [LayerPair]) and where it came from: --layers, --recipe, the
    first student's recipe.yaml, or ``auto``."""
    from mta.training.config.schema import LayerPair

    if settings.layers:
        return [LayerPair(student=s, teacher=t, granularity=g) for s, t, g in settings.layers], "--layers"
    from mta.training.config.loading import load_recipe

    if settings.recipe:
        from mta.training.config.catalog import find_recipe

        recipe = load_recipe(find_recipe(settings.recipe).path)
        return recipe.loss.layers, f"recipe {settings.recipe} (loss.layers)"  # type: ignore[attr-defined]
    for student in students:
        path = Path(student) / RECIPE_FILE
        if path.is_file():
            recipe = load_recipe(path)
            return recipe.loss.layers, f"{path} (loss.layers)"  # type: ignore[attr-defined]
    return "auto", "auto (no recipe: the docs/method.md §4 rule)"


def _fingerprint(path: str) -> str:
    from mta.evaluation.model_files import checkpoint_fingerprint

    return checkpoint_fingerprint(path)[0]


# --------------------------------------------------------------------------- the run


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
    from mta.evaluation.models_under_test import check_checkpoint, checkpoint_names, loaded_checkpoint
    from mta.models.tokenizers import load_tokenizer, tokenizer_fingerprint
    from mta.training.batching import AnnotatedExamples
    from mta.training.config.layers import resolve_layer_map

    settings = settings or InspectSettings()
    settings.check()
    reporter = reporter or SilentReporter()
    if not students:
        raise MtaError("give at least one student")
    if teacher is None and settings.teacher_cache is None:
        raise MtaError("give the teacher, or --teacher-cache (the layers a recipe aligns only)")
    data = Path(data)
    annotations = read_annotations(data)
    count = min(settings.rows, len(annotations))
    if count < 2:
        raise MtaError(f"{data} has {len(annotations)} rows; inspect needs at least 2")
    for checkpoint in ([teacher] if teacher else []) + list(students):
        check_checkpoint(checkpoint)
    labels = checkpoint_names(students, settings.names)
    manifest = annotations.manifest
    notes = list(settings.notes)

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
    granularities = granularities_of(annotations, same_tokenizer, notes)
    boundary = "boundary" in granularities
    held_out = held_out_statement(students, data, annotations, allow=settings.allow_training_rows)

    layer_map, map_source = layer_map_source(settings, students)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    first_tokenizer = load_tokenizer(students[0])
    student_pad = first_tokenizer.pad_token_id if first_tokenizer.pad_token_id is not None else 0
    teacher_tokenizer = load_tokenizer(teacher) if teacher else first_tokenizer
    teacher_pad = teacher_tokenizer.pad_token_id if teacher_tokenizer.pad_token_id is not None else 0
    examples = AnnotatedExamples(
        annotations.table.slice(0, count),
        student_pad_id=student_pad,
        teacher_pad_id=teacher_pad,
        granularities=SPAN_GRANULARITIES,
        boundary=boundary,
    )
    half = count // 2
    batches = [
        (phase, np.arange(start, min(start + settings.batch_size, end)))
        for phase, (begin, end) in (("fit", (0, half)), ("measure", (half, count)))
        for start in range(begin, end, settings.batch_size)
    ]
    special = [] if settings.include_special else sorted(set(first_tokenizer.all_special_ids))
    if settings.include_special:
        notes.append("CKA items include the first position and special tokens (--include-special)")
    else:
        notes.append(
            "CKA and the linear fit leave out each row's first position (the attention sink) and the spans "
            "covering it" + ("" if not same_tokenizer else ", and special-token positions (BOS, EOS, chat markers)")
        )
    if same_tokenizer:
        notes.append(f"token positions: at most {settings.tokens_per_row} evenly spaced per row")

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
            with loaded_checkpoint(student, device, dtype) as (model, tokenizer):
                depth = int(model.config.num_hidden_layers)
                pairs = resolve_layer_map(
                    layer_map, depth, teacher_depth if teacher_depth is not None else max(teacher_layers)
                )
                missing = sorted({p.teacher for p in pairs} - set(teacher_layers))
                if missing:
                    raise MtaError(
                        f"the layer map aligns teacher layer(s) {missing}, which the teacher cache does not hold "
                        f"({teacher_layers}); give the teacher, or --layers within those"
                    )
                reporter.start(f"inspect {label}", total=count, unit="rows")
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
            results["students"].append(entry)
    return results


def off_sink(spans: SpanBatch, skip_first: bool) -> torch.Tensor:
    """``[B, K]`` bool: the real spans that cover neither side's first position (the attention
    sink, whose state is an outlier hundreds of times the others' norm in LLMs), or all real
    spans without ``skip_first``. Rows are right-padded: the first position is 0."""
    real = spans.mask.bool()
    if not skip_first:
        return real
    return real & (spans.student_start > 0) & (spans.teacher_start > 0)


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
        name: LinearCKA([student_dim] * len(student_layers), [teacher_dim] * len(teacher_layers))
        for name in granularities
    }
    fits = [HeldOutLinearFit(student_dim, teacher_dim) for _ in pairs]
    agreement = [[0.0, 0] for _ in pairs]  # Σ per-row Pearson, rows
    dsa = [[0.0, 0] for _ in pairs]  # Σ per-batch DSA × contributing rows, rows
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
        for index, (s, t, g) in enumerate(pairs):
            student_spans = student_pooled[g][s][0]
            teacher_spans, salience = teacher_pooled[g][t]
            mask = span_batches[g].mask
            correlation, counted = structure_agreement(student_spans, teacher_spans, mask)
            agreement[index][0] += float(correlation[counted].sum())
            agreement[index][1] += int(counted.sum())
            contributing = int(((mask.sum(dim=1) >= 2) & ((salience * mask).sum(dim=1) > 0)).sum())
            if contributing:
                value = dynamic_structural_alignment(student_spans, teacher_spans, salience, mask)
                dsa[index][0] += float(value) * contributing
                dsa[index][1] += contributing
            if phase == "fit":  # the linear fit is least squares: without the sink's outliers
                fits[index].fit(student_spans, teacher_spans, kept[g])
            else:
                fits[index].measure(student_spans, teacher_spans, salience, kept[g])
        reporter.advance(len(rows))
    matrices: dict[str, dict[str, Any]] = {
        name: {
            "items": accumulator.items,
            **{estimator: _listed(accumulator.matrix(estimator)) for estimator in ESTIMATORS},  # type: ignore[arg-type]
        }
        for name, accumulator in cka.items()
    }
    aligned = []
    for index, (s, t, g) in enumerate(pairs):
        aligned.append(
            {
                "student": s,
                "teacher": t,
                "granularity": g,
                "cka": matrices[g][settings.estimator][s][teacher_layers.index(t)],
                "structure_agreement": agreement[index][0] / agreement[index][1] if agreement[index][1] else None,
                "structure_rows": agreement[index][1],
                "dsa": dsa[index][0] / dsa[index][1] if dsa[index][1] else None,
                **fits[index].result(),
            }
        )
    return {"cka": matrices, "aligned": aligned}


def _listed(matrix: np.ndarray) -> list[list[float | None]]:
    return [[finite_or_none(float(value)) for value in row] for row in matrix]


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


__all__ = [
    "InspectSettings",
    "inspect_models",
    "layer_map_yaml",
    "pooled_spans",
    "suggested_map",
    "token_positions",
]
