"""`make evidence`: does MTA help its base loss at the largest scale this CPU reaches? (issue 33)

The demo's pair with less pruning: SmolLM2-135M-Instruct (30 layers) teaches its 15-layer copy
(every other block, first and last kept), which every run starts from. Two variants, with the
published GPT-2 row's loss settings where they apply (docs/method.md §4): ``srkl``, DistiLLM's
skew reverse KL (α 0.1) on the reference responses, and ``srkl+mta``, the same + 2·DSA + 0.2·HRA
with the ``auto`` layer map. Sampling during training is off (``generation.mode: off``, the
recipe's): every step trains on the gold responses, so the two variants differ in the MTA terms
only. Each variant trains ``train_seeds`` runs; a seed (the recipe's ``seed``) changes the data
order, the HRA projectors' initialisation and the sampling noise of the dev selection, never the
start.

The stages, each reused when its output is complete (Ctrl-C anywhere, or SIGTERM / SIGUSR1 during a
training run, stops it; running the same command again continues: a training run resumes from its
newest checkpoint, the evaluation is keyed on the weights' fingerprints). The directory is stamped
with the settings, the recipe's content, the overrides and the teacher; a directory of other ones
is refused, never overwritten:

1. the teacher (converted once into the model cache), the pruned start;
2. ``train_rows`` Dolly train rows drawn with seed 0 and the first ``dev_rows`` Dolly **dev**
   rows, annotated once;
3. the teacher stage (``mta teacher``): its hidden states at the aligned layers and its top-k
   logits, stored once for every run (no teacher forward in a training step);
4. the training runs, ``train_steps`` steps each; at every ``eval_interval`` the dev loss on the
   annotated dev rows (those of the first ``dev_rows`` whose prompt fits ``data.max_prompt_length``)
   and the dev ROUGE-L of one sampled response on the first ``select_rows`` of them
   (``train.select_by: rouge``): ``OUT/runs/<run>/best/`` is the chosen checkpoint. No test row
   chooses anything;
5. the evaluation (``mta evaluate``, MiniLLM protocol: top_k 0, top_p 1, T 1): the teacher and
   every chosen checkpoint on the first ``eval_rows`` rows of Dolly, SelfInst, Vicuna and S-NI
   under each of ``sampling_seeds``, and on the first ``select_rows`` rows of Dolly dev (the
   "writes text" check: a student's dev ROUGE-L at its chosen checkpoint against half the
   teacher's; ``mta evaluate`` keeps a long prompt's first 256 tokens where the annotation skips it,
   so these rows overlap the selection's without being the same);
6. the comparison (:mod:`mta.evaluation.bootstrap`): per set and on average, MTA − base with a
   95 % interval from a hierarchical bootstrap and the smallest difference detectable at 80 %
   power; :mod:`mta.demo.evidence_report` writes results.md, results.json and the picture.

:func:`plan_lines` is the plan with its estimate (``mta demo --evidence --plan``, ``make -n
evidence``); :func:`run_evidence` runs it; :func:`summarise` reads a finished directory back
(``mta demo --evidence --report``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

from mta.data.annotate import AnnotateSettings, annotate_file
from mta.demo.pipeline import DEMO_RECIPE, SETTINGS_FILE, StudentDirectory, claim_demo_directory, copy_dolly_rows
from mta.distributed import local_device
from mta.dtypes import resolve_precision
from mta.errors import MtaError
from mta.evaluation import EvalSettings, evaluate_checkpoints
from mta.evaluation.bootstrap import bootstrap_differences
from mta.evaluation.datasets import default_data_dir
from mta.evaluation.layout import CheckpointPaths
from mta.files import atomic_write_json
from mta.hashing import file_sha256
from mta.models.pruning import init_student
from mta.models.smollm2 import convert_smollm2
from mta.reporting import Reporter, SilentReporter
from mta.training.config.layers import auto_layer_map
from mta.training.config.loading import load_recipe
from mta.training.config.schema import Recipe
from mta.training.lifecycle.checkpointing import latest_checkpoint
from mta.training.lifecycle.metrics import read_metrics
from mta.training.lifecycle.selection import ROUGE_KEY
from mta.training.teacher_cache.build import run_teacher_stage
from mta.training.trainer import run_distillation
from mta.versions import source_commit

EVIDENCE_LAYOUT = 1  # bumped when a directory written earlier cannot be continued
TEST_SETS = ("dolly", "self-inst", "vicuna", "sinst")
DEV_SET = "dolly-dev"
TEACHER = "teacher"
TEACHER_LAYERS = 30  # SmolLM2-135M-Instruct's
TIMINGS_FILE = "timings.json"
SESSIONS_FILE = "sessions.json"

# Seconds per unit on the 2-core development machine in bf16 (AVX512-BF16), for the plan's
# estimate: the base step measured by a 160-step pilot of the evidence's sizes (15-layer student,
# batch 8 x <= 192 tokens, the teacher from its cache); the MTA step (its hidden states and three
# DSA/HRA pairs) and the generation costs scaled from the demo's measurements. fp32 takes about
# BF16_SPEEDUP times as long.
SECONDS_PER_STEP = {"srkl": 2.5, "srkl+mta": 3.2}
SECONDS_PER_TEACHER_ROW = 0.16  # the teacher stage, per train or dev row (pilot: 217 s, 1,468 rows)
SECONDS_PER_SELECTION_ROW = 0.6  # a dev pass, per selection row: its sampled response + the dev loss
SECONDS_PER_EVAL_TOKEN = {"student": 0.006, "teacher": 0.010}  # per row and new token, batch 16
FIXED_SECONDS = 150  # pruning, annotation, loading the models
BF16_SPEEDUP = 1.8


@dataclass(frozen=True)
class EvidenceVariant:
    """One side of the comparison: its label (also its runs' directory prefix), the recipe
    overrides that make it from the demo recipe, and what it is."""

    label: str
    overrides: tuple[str, ...]
    description: str


BASE = EvidenceVariant(
    "srkl", ("loss.dsa_weight=0", "loss.hra_weight=0"), "DistiLLM's skew reverse KL (α 0.1) on the references"
)
MTA = EvidenceVariant("srkl+mta", (), "srkl + 2·DSA + 0.2·HRA, layers auto")
VARIANTS = (BASE, MTA)


@dataclass(frozen=True)
class EvidenceSettings:
    """Sizes of the comparison, fixed before its runs (``full()`` is ``make evidence``).

    The training settings not named here (lr 2e-4 cosine with 4 warm-up steps, 192 tokens of
    which 128 prompt, ZeRO-1) are the demo recipe's, smollm2-demo.yaml.
    """

    name: str = "full"
    student_layers: int = 15
    train_steps: int = 128
    eval_interval: int = 32  # dev loss and the dev ROUGE-L selection pass
    train_seeds: tuple[int, ...] = (1, 2, 3, 4)
    batch_size: int = 8  # train.batch_size = train.micro_batch_size (one process, no accumulation)
    dev_rows: int = 64  # dev loss on these; selection on the first select_rows of them
    select_rows: int = 32
    eval_rows: int = 40  # first rows of each test set
    sampling_seeds: tuple[int, ...] = (10, 20)
    max_new_tokens: int = 64  # = data.max_length - data.max_prompt_length, as the selection samples
    eval_batch_size: int = 16
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    replicates: int = 2000
    test_sets: tuple[str, ...] = TEST_SETS

    @classmethod
    def full(cls) -> EvidenceSettings:
        return cls()

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> EvidenceSettings:
        """The settings a stamp or results.json recorded (JSON lists back to tuples; other keys,
        such as the stamp's recipe hash, ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k in names})

    @property
    def train_rows(self) -> int:
        """Dolly train rows drawn: one pass of a run, a few more for prompts over the length limit
        (skipped); every run sees the same rows in its own order."""
        return int(self.train_steps * self.batch_size * 1.1)

    def runs(self) -> list[tuple[EvidenceVariant, int]]:
        """Every training run, interleaved by seed (base, MTA, base, ...) so a run stopped halfway
        leaves the two variants equally far."""
        return [(variant, seed) for seed in self.train_seeds for variant in VARIANTS]

    def resolved_precision(self) -> str:
        return resolve_precision(self.precision, local_device())

    def estimated_seconds(self) -> dict[str, float]:
        """The plan's estimate per stage, from the measured costs above."""
        fp32_slowdown = 1.0 if self.resolved_precision() == "bf16" else BF16_SPEEDUP
        passes = self.train_steps // self.eval_interval + 1  # and the step-0 baseline
        models = len(self.runs())
        eval_rows = len(self.test_sets) * self.eval_rows + self.select_rows
        tokens = eval_rows * len(self.sampling_seeds) * self.max_new_tokens
        steps = self.train_steps * self.batch_size / 8  # the costs are per step of batch 8
        estimate = {
            "prepare": FIXED_SECONDS,
            "teacher stage": (self.train_rows + self.dev_rows) * SECONDS_PER_TEACHER_ROW,
            "training": sum(SECONDS_PER_STEP[v.label] for v, _ in self.runs()) * steps,
            "selection": models * passes * self.select_rows * SECONDS_PER_SELECTION_ROW,
            "evaluation": tokens * (models * SECONDS_PER_EVAL_TOKEN["student"] + SECONDS_PER_EVAL_TOKEN["teacher"]),
        }
        return {stage: seconds * (1.0 if stage == "prepare" else fp32_slowdown) for stage, seconds in estimate.items()}


def run_label(variant: EvidenceVariant, seed: int) -> str:
    """``srkl-seed1``: a run's directory under ``runs/`` and its name in the evaluation."""
    return f"{variant.label}-seed{seed}"


@dataclass(frozen=True)
class EvidencePaths(StudentDirectory):
    @property
    def teacher_cache(self) -> Path:
        return self.root / "teacher-cache"

    def run(self, label: str) -> Path:
        return self.root / "runs" / label

    @property
    def eval_test(self) -> Path:
        return self.root / "eval" / "test"

    @property
    def eval_dev(self) -> Path:
        return self.root / "eval" / "dev"

    @property
    def timings(self) -> Path:
        return self.root / TIMINGS_FILE

    @property
    def sessions(self) -> Path:
        return self.root / SESSIONS_FILE


def plan_lines(
    settings: EvidenceSettings, out_dir: str | Path = "runs/evidence", *, precision: str | None = None
) -> list[str]:
    """What :func:`run_evidence` will do, and for about how long, before it does it. precision:
    what ``settings.precision`` resolved to where the runs ran (default: on this machine)."""
    precision = precision or settings.resolved_precision()
    estimate = settings.estimated_seconds()
    passes = settings.train_steps // settings.eval_interval + 1
    lines = [
        f"mta evidence ({settings.name}): MTA against its base loss, output in {out_dir}/",
        f"  pair: SmolLM2-135M-Instruct (30 layers) -> its {settings.student_layers}-layer copy, "
        "the same start for every run",
        f"  runs: {len(VARIANTS)} variants x {len(settings.train_seeds)} training seeds "
        f"{list(settings.train_seeds)} = {len(settings.runs())} runs of {settings.train_steps} steps "
        f"(batch {settings.batch_size}, {settings.train_rows} Dolly train rows drawn with seed 0), "
        "sampling during training off",
    ]
    lines += [f"    {variant.label}: {variant.description}" for variant in VARIANTS]
    pairs = auto_layer_map(settings.student_layers, TEACHER_LAYERS)
    lines.append(
        "    auto layers (student -> teacher): " + ", ".join(f"{p.student}->{p.teacher} {p.granularity}" for p in pairs)
    )
    lines += [
        f"  selection: dev ROUGE-L (1 sample, <= {settings.max_new_tokens} new tokens) on the first "
        f"{settings.select_rows} annotated Dolly dev rows at step 0 and every {settings.eval_interval} steps "
        f"({passes} passes a run; step 0 is never chosen); dev loss on the annotated ones of the first "
        f"{settings.dev_rows} dev rows (a prompt over data.max_prompt_length is skipped)",
        f"  evaluation: the teacher and the {len(settings.runs())} chosen checkpoints on the first "
        f"{settings.eval_rows} rows of {', '.join(settings.test_sets)}, sampling seeds "
        f"{list(settings.sampling_seeds)}, <= {settings.max_new_tokens} new tokens; the same on the first "
        f"{settings.select_rows} Dolly dev rows (does the student write text?)",
        f"  statistics: hierarchical bootstrap ({settings.replicates} replicates: training seeds, then "
        "sampling seeds, then rows), 95 % intervals, smallest difference detectable at 80 % power",
        f"  precision: {precision} (requested {settings.precision})",
        "  estimate: "
        + ", ".join(f"{stage} {seconds / 60:.0f} min" for stage, seconds in estimate.items())
        + f"; total about {sum(estimate.values()) / 60:.0f} min (finished stages are reused)",
    ]
    return lines


Result = TypeVar("Result")


def timed_stage(paths: EvidencePaths, stage: str, work: Callable[[], Result], *, done: bool) -> Result:
    """``work()``, its wall time added to the stage's in timings.json unless the stage was
    already ``done`` (then only reused: the time of the run that did it stays). A stage stopped
    midway (Ctrl-C, a crash) keeps the time it ran: the next session continues its work."""
    started = time.perf_counter()
    try:
        return work()
    finally:
        if not done:
            timings = json.loads(paths.timings.read_text()) if paths.timings.exists() else {}
            timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - started
            atomic_write_json(paths.timings, timings)


def record_session(paths: EvidencePaths) -> list[dict]:
    """Add this session (its start and the commit of the code it runs) to sessions.json, so the
    results name the code every stage came from; returns every session so far."""
    sessions = json.loads(paths.sessions.read_text()) if paths.sessions.exists() else []
    sessions.append({"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **source_commit()})
    atomic_write_json(paths.sessions, sessions)
    return sessions


def run_evidence(
    settings: EvidenceSettings,
    out_dir: str | Path = "runs/evidence",
    *,
    data_dir: str | Path | None = None,
    recipe_path: str | Path = DEMO_RECIPE,
    teacher: str | Path | None = None,
    recipe_overrides: Sequence[str] = (),
    reporter: Reporter | None = None,
) -> dict[str, Any]:
    """Run (or finish) every stage; returns what results.json holds.

    teacher: a Hugging Face model directory instead of the converted SmolLM2 (the test's tiny
    model); recipe_overrides: ``key=value`` strings applied to every run and to the teacher stage.
    """
    reporter = reporter or SilentReporter()
    paths = EvidencePaths(Path(out_dir))
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    stamp = {
        **asdict(settings),
        "layout": EVIDENCE_LAYOUT,
        "resolved_precision": settings.resolved_precision(),
        "recipe_sha256": file_sha256(recipe_path),
        "recipe_overrides": list(recipe_overrides),
        "teacher": str(teacher) if teacher is not None else None,
    }
    claim_demo_directory(paths.root, stamp, reporter, restart=False)
    record_session(paths)

    def prepare() -> tuple[Path, Recipe]:
        model = Path(teacher) if teacher is not None else convert_smollm2(report=lambda line: reporter.message(line))
        if not (paths.student_init / "config.json").exists():
            reporter.message(f"student: keeping {settings.student_layers} of the teacher's layers")
            init_student(model, paths.student_init, num_layers=settings.student_layers, force=True)
        recipe = _load_recipe(recipe_path, _shared_overrides(model, paths, settings, recipe_overrides))
        source = data_dir / "dolly"
        copy_dolly_rows(source / "train.jsonl", paths.data("train"), settings.train_rows, sample=True, demo="evidence")
        copy_dolly_rows(source / "dev.jsonl", paths.data("dev"), settings.dev_rows, sample=False, demo="evidence")
        annotate = AnnotateSettings.from_recipe(recipe)
        for split in ("train", "dev"):
            reporter.message(f"annotate: Dolly {split} rows")
            annotate_file(paths.data(split), paths.annotations(split), annotate)
        return model, recipe

    prepared = all((paths.annotations(s) / ".mta" / "manifest.json").exists() for s in ("train", "dev"))
    model, recipe = timed_stage(paths, "prepare", prepare, done=prepared)
    cached = all((paths.teacher_cache / s / ".mta" / "manifest.json").exists() for s in ("train", "dev"))
    timed_stage(paths, "teacher stage", lambda: run_teacher_stage(recipe, reporter=reporter), done=cached)

    chosen = _train_runs(settings, paths, model, recipe_path, recipe_overrides, reporter)
    _evaluate_runs(settings, paths, {TEACHER: model, **chosen}, data_dir, reporter)
    return summarise(settings, paths)


def _train_runs(
    settings: EvidenceSettings,
    paths: EvidencePaths,
    model: Path,
    recipe_path: str | Path,
    recipe_overrides: Sequence[str],
    reporter: Reporter,
) -> dict[str, Path]:
    """Train (or resume, or skip when finished) every variant and seed; ``{label: its best/}``."""
    chosen: dict[str, Path] = {}
    for variant, seed in settings.runs():
        label = run_label(variant, seed)
        overrides = [*_shared_overrides(model, paths, settings, recipe_overrides), *variant.overrides]
        run_recipe = _load_recipe(recipe_path, [*overrides, f"seed={seed}", f"output_dir={paths.run(label)}"])
        if (paths.run(label) / "final" / "config.json").exists():
            reporter.message(f"{label}: already trained")
        else:
            resumed = latest_checkpoint(paths.run(label)) is not None
            reporter.message(f"distill: {label}" + (" (resumed)" if resumed else ""))
            timed_stage(
                paths,
                f"train {label}",
                functools.partial(run_distillation, run_recipe, resume="auto", reporter=reporter),
                done=False,
            )
        best = paths.run(label) / "best"
        if not (best / "config.json").exists():
            raise MtaError(f"{paths.run(label)} has no best/ checkpoint: its dev selection never ran")
        chosen[label] = best
    return chosen


def _evaluate_runs(
    settings: EvidenceSettings, paths: EvidencePaths, checkpoints: dict[str, Path], data_dir: Path, reporter: Reporter
) -> None:
    """Evaluate ``checkpoints`` ({label: directory}) on the test sets and on dev (each skipped when done)."""
    evaluations = {
        "test": (paths.eval_test, list(settings.test_sets), settings.eval_rows),
        "dev": (paths.eval_dev, [DEV_SET], settings.select_rows),
    }
    for directory, sets, limit in evaluations.values():
        eval_settings = EvalSettings(
            benchmarks=sets,
            seeds=list(settings.sampling_seeds),
            max_new_tokens=settings.max_new_tokens,
            batch_size=settings.eval_batch_size,
            limit=limit,
            dtype=settings.precision,
        )
        reporter.message(f"evaluate: {', '.join(sets)} ({limit} rows, seeds {list(settings.sampling_seeds)})")
        done = (directory / "results.json").exists()
        timed_stage(
            paths,
            f"evaluate {directory.name}",
            functools.partial(
                evaluate_checkpoints,
                [str(p) for p in checkpoints.values()],
                list(checkpoints),
                data_dir,
                directory,
                eval_settings,
                reporter,
            ),
            done=done,
        )


def read_back(out_dir: str | Path) -> dict[str, Any]:
    """What :func:`run_evidence` returned, read from a finished directory with the settings it
    was stamped with (``mta demo --evidence --report``: the report again, nothing run)."""
    paths = EvidencePaths(Path(out_dir))
    stamp_path = paths.root / SETTINGS_FILE
    if not stamp_path.exists():
        raise MtaError(f"{paths.root} holds no evidence run ({stamp_path} is missing)")
    return summarise(EvidenceSettings.from_record(json.loads(stamp_path.read_text())), paths)


def _load_recipe(path: str | Path, overrides: Sequence[str]) -> Recipe:
    recipe = load_recipe(path, list(overrides))
    if not isinstance(recipe, Recipe):
        raise MtaError(f"{path}: the evidence compares language-model students; give a recipe of task llm")
    return recipe


def _shared_overrides(
    teacher: Path, paths: EvidencePaths, settings: EvidenceSettings, extra: Sequence[str]
) -> list[str]:
    return [
        f"teacher.path={teacher}",
        f"student.path={paths.student_init}",
        "student.config=null",
        f"data.train={paths.annotations('train')}",
        f"data.dev={paths.annotations('dev')}",
        f"teacher_cache.dir={paths.teacher_cache}",
        f"train.precision={settings.precision}",
        f"train.batch_size={settings.batch_size}",
        f"train.micro_batch_size={settings.batch_size}",
        f"train.max_steps={settings.train_steps}",
        f"train.eval_interval={settings.eval_interval}",
        f"train.save_interval={settings.eval_interval}",
        "train.select_by=rouge",
        f"train.select_rows={settings.select_rows}",
        "generation.mode=off",
        *extra,
    ]


def row_scores(eval_dir: Path, label: str, set_name: str, seeds: Sequence[int]) -> np.ndarray:
    """ROUGE-L (F x 100) of every row of ``set_name`` under each seed: ``[seeds, rows]``, read
    from the predictions files ``mta evaluate`` wrote, columns in row order (the bootstrap pairs
    the variants' scores by column: a file whose rows are not 0, 1, 2, ... is refused)."""
    paths = CheckpointPaths.of(eval_dir, label)
    scores = []
    for seed in seeds:
        path = paths.predictions(set_name, seed)
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if [record["index"] for record in records] != list(range(len(records))):
            raise MtaError(
                f"{path}: its rows are not in order 0..{len(records) - 1}; evaluate again into a new directory"
            )
        scores.append([record["rougeL"] for record in records])
    if len({len(row) for row in scores}) > 1:
        raise MtaError(f"{paths.root / set_name}: the seeds' predictions hold different numbers of rows")
    return np.asarray(scores, dtype=np.float64)


def dev_curve(run_dir: Path) -> list[dict]:
    """The dev records of a run's metrics.jsonl: step, loss (the run's objective), base_loss (the
    base loss alone, which both variants share), dev ROUGE-L (None where a record lacks one)."""
    return [
        {"step": r["step"], "loss": r.get("loss"), "base_loss": r.get("loss/base"), "rougeL": r.get(ROUGE_KEY)}
        for r in read_metrics(run_dir / "metrics.jsonl")
        if r.get("split") == "dev"
    ]


def summarise(settings: EvidenceSettings, paths: EvidencePaths) -> dict[str, Any]:
    """The comparison from the files on disk (every stage finished): per-run curves and choices,
    per-variant scores, the bootstrap differences, the "writes text" check, the stage times and
    the sessions' commits. What results.json holds."""
    missing = [str(p) for p in (paths.eval_test / "results.json", paths.eval_dev / "results.json") if not p.exists()]
    if missing:
        raise MtaError(f"{paths.root} is not finished ({', '.join(missing)} missing): run `mta demo --evidence` first")
    runs: dict[str, dict] = {}
    for variant, seed in settings.runs():
        label = run_label(variant, seed)
        selection = json.loads((paths.run(label) / "best" / "selection.json").read_text())
        runs[label] = {
            "variant": variant.label,
            "seed": seed,
            "chosen_step": selection["step"],
            "dev_rouge_at_selection": selection["value"],
            "curve": dev_curve(paths.run(label)),
        }
    scores = {
        variant.label: {
            name: np.stack(
                [
                    row_scores(paths.eval_test, run_label(variant, seed), name, settings.sampling_seeds)
                    for seed in settings.train_seeds
                ]
            )
            for name in settings.test_sets
        }
        for variant in VARIANTS
    }
    differences = bootstrap_differences(scores[BASE.label], scores[MTA.label], replicates=settings.replicates)
    teacher = {
        name: float(row_scores(paths.eval_test, TEACHER, name, settings.sampling_seeds).mean())
        for name in settings.test_sets
    }
    dev_teacher = float(row_scores(paths.eval_dev, TEACHER, DEV_SET, settings.sampling_seeds).mean())
    for label, run in runs.items():
        run["dev_rouge"] = float(row_scores(paths.eval_dev, label, DEV_SET, settings.sampling_seeds).mean())
        run["writes_text"] = run["dev_rouge"] >= dev_teacher / 2
    means = {
        variant: {name: float(values.mean()) for name, values in per_set.items()} for variant, per_set in scores.items()
    }
    return {
        "settings": {**asdict(settings), "train_rows": settings.train_rows},
        "variants": {v.label: v.description for v in VARIANTS},
        "teacher": {"sets": teacher, "dev_rouge": dev_teacher},
        "means": means,
        "differences": {name: asdict(d) for name, d in differences.items()},
        "runs": runs,
        "timings": json.loads(paths.timings.read_text()) if paths.timings.exists() else {},
        "protocol": json.loads((paths.eval_test / "results.json").read_text()).get("protocol"),
        "precision": json.loads((paths.root / SETTINGS_FILE).read_text())["resolved_precision"],
        "out_dir": str(paths.root),
        "sessions": json.loads(paths.sessions.read_text()),
    }


__all__ = [
    "BASE",
    "MTA",
    "VARIANTS",
    "EvidencePaths",
    "EvidenceSettings",
    "EvidenceVariant",
    "dev_curve",
    "plan_lines",
    "read_back",
    "row_scores",
    "run_evidence",
    "run_label",
    "record_session",
    "summarise",
    "timed_stage",
]
