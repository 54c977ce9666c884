"""`make evidence`: does MTA help DistiLLM under the paper's protocol, at the largest scale this
CPU reaches? (issue 47; the first design, issue 33, answered with an untuned teacher and no
sampling: docs/evidence-results.md)

The protocol's shape (docs/method.md §4): a teacher fine-tuned on Dolly's training rows teaches a
smaller student that starts from a pretrained model. Here SmolLM2-135M-Instruct is both sources:

1. **prepare**: the shipped model (converted once into the model cache) and its 15-layer copy
   (every other block, first and last kept), the start of every run; Dolly rows copied and
   annotated: all train rows for the teacher, ``train_rows`` drawn with seed 0 for the students,
   the first ``dev_rows`` dev rows, the first ``inspect_rows`` Dolly test rows (trajectory only);
2. **teacher pilot** (:mod:`mta.demo.evidence_teacher`): the shipped model fine-tuned with
   cross-entropy (``teacher: null``, ``loss.base: ce``) for ``teacher_pilot_steps`` at each of
   ``teacher_pilot_lrs``; the lr of the lowest dev loss wins (dev rows only);
3. **teacher fine-tune**: ``teacher_epochs`` over every train row at that lr, dev ROUGE-L at
   ``teacher_evals`` points, ``best/`` (chosen on dev) is the teacher;
4. **token cap**: the teacher's outputs on the selection's dev rows (one seed, ``cap_limit`` new
   tokens): their ``cap_quantile`` rounded up to 32 is the cap of every evaluation; the budget is
   checked again with it (cuts in the plan's order);
5. **teacher cache** (``mta teacher``): the fine-tuned teacher's top-k logits and aligned states on
   the students' train and dev rows, read by every run's reference micro batches (a generated
   micro batch runs the teacher online);
6. **training**: two variants x ``train_seeds``, ``train_steps`` of batch ``batch_size``, each with
   DistiLLM's adaptive off-policy sampling as ``mta distill`` implements it (``off_policy.mode:
   adaptive``, the published settings), the loss reduced per micro batch (DistiLLM's); dev loss and
   dev ROUGE-L every ``eval_interval`` steps, ``best/`` chosen on dev ROUGE-L;
7. **evaluate** (``mta evaluate``, the MiniLLM protocol at the cap): the shipped and the fine-tuned
   teacher, the pruned start and every chosen student on the first ``eval_rows`` rows of Dolly,
   SelfInst, S-NI and all of Vicuna under each sampling seed, and on the selection's dev rows;
8. **teacher agreement** (:mod:`mta.evaluation.teacher_agreement`): the teacher-forced fkl, srkl
   and top-1 agreement from the fine-tuned teacher to each student on the same test rows'
   references;
9. **trajectory** (:mod:`mta.inspection`): structure agreement and CKA at the aligned layer pairs
   on the inspect rows, per student;
10. **comparison** (:mod:`mta.evaluation.bootstrap`): for every outcome, MTA − base with a 95 %
    interval and the smallest difference detectable at 80 % power; :mod:`mta.demo.evidence_report`
    writes results.md, results.json and the pictures.

Each stage is reused when its output is complete (Ctrl-C anywhere, or SIGTERM / SIGUSR1 during a
training run, stops it; the same command continues: a training run resumes from its newest
checkpoint, the evaluations are keyed on the weights' fingerprints). The directory is stamped with
the design, the recipe's content, the overrides and the teacher; a directory of other ones, or of
the first design (layout 1), is refused, never overwritten. The plan's estimate
(:mod:`mta.demo.evidence_budget`) must fit ``budget_hours`` before anything runs.

:func:`plan_lines` is the plan (``mta demo --evidence --plan``, ``make -n evidence``);
:func:`run_evidence` runs it; :func:`summarise` reads a finished directory back
(``mta demo --evidence --report``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

from mta.data.annotate import AnnotateSettings, annotate_file
from mta.demo.evidence_budget import cap_from_lengths, cheaper_engine, estimated_seconds, fit_budget
from mta.demo.evidence_outcomes import (
    TRAJECTORY_MEASURES,
    agreement_scores,
    agreement_stage,
    trajectory_scores,
    trajectory_stage,
)
from mta.demo.evidence_teacher import fine_tune_teacher
from mta.demo.pipeline import DEMO_RECIPE, SETTINGS_FILE, StudentDirectory, claim_demo_directory, copy_dolly_rows
from mta.distributed import local_device
from mta.dtypes import resolve_precision
from mta.errors import MtaError
from mta.evaluation import EvalSettings, evaluate_checkpoints
from mta.evaluation.bootstrap import bootstrap_differences
from mta.evaluation.datasets import default_data_dir
from mta.evaluation.layout import CheckpointPaths
from mta.evaluation.teacher_agreement import MEASURES as AGREEMENT_MEASURES
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
from mta.training.teacher_cache.teacher import run_teacher_stage
from mta.training.trainer import run_distillation
from mta.versions import source_commit

# Bumped when a directory written earlier cannot be continued (2: issue 47's design: a fine-tuned
# teacher, DistiLLM's sampling, the agreement and trajectory outcomes; a layout-1 directory is refused).
EVIDENCE_LAYOUT = 2
TEST_SETS = ("dolly", "self-inst", "vicuna", "sinst")
DEV_SET = "dolly-dev"
TEACHER = "teacher"  # the fine-tuned teacher
ORIGINAL = "teacher-original"  # SmolLM2-135M-Instruct as shipped
START = "pruned-start"  # every run's start
TEACHER_LAYERS = 30  # SmolLM2-135M-Instruct's
DOLLY_TRAIN_ROWS = 9568  # ../shared/data/instruct/dolly/train.jsonl
TIMINGS_FILE = "timings.json"
SESSIONS_FILE = "sessions.json"
CAP_FILE = "token-cap.json"
BUDGET_CUTS = (
    "the token cap first (by 32, down to cap_floor), then the rows of each test set (by 40, down to "
    "rows_floor); never the training seeds"
)


@dataclass(frozen=True)
class EvidenceVariant:
    """One side of the comparison: its label (also its runs' directory prefix), the recipe
    overrides that make it from the shared ones, and what it is."""

    label: str
    overrides: tuple[str, ...]
    description: str


BASE = EvidenceVariant(
    "distillm",
    ("loss.dsa_weight=0", "loss.hra_weight=0"),
    "DistiLLM as published: skew reverse KL (α 0.1) + adaptive off-policy sampling",
)
MTA = EvidenceVariant("distillm+mta", (), "distillm + 2·DSA + 0.2·HRA, layers auto")
VARIANTS = (BASE, MTA)


@dataclass(frozen=True)
class EvidenceSettings:
    """The design, fixed before its runs (``full()`` is ``make evidence``).

    The student's training settings not named here (lr 2e-4 cosine with 4 warm-up steps, AdamW,
    ZeRO-1, projectors at 5e-4) are the demo recipe's, smollm2-demo.yaml; the sampling settings
    are the published DistiLLM scripts' (recipes/gpt2.yaml's ``off_policy:``).
    """

    name: str = "full"
    student_layers: int = 15
    # data.max_length of the teacher and the students: the first design's (measured), not the GPT-2
    # row's 256, which the budget cannot hold (x1.33 on every training step)
    max_length: int = 192
    max_prompt_length: int = 128
    # the teacher
    teacher_rows: int | None = None  # None: every Dolly train row
    teacher_pilot_lrs: tuple[float, ...] = (1e-5, 3e-5, 1e-4)
    teacher_pilot_steps: int = 64
    teacher_epochs: float = 1.0
    teacher_evals: int = 4  # dev evaluations over the fine-tune (and at step 0); best/ by dev ROUGE-L
    # the students
    train_steps: int = 512
    eval_interval: int = 128  # dev loss, the sampling threshold's update and the dev ROUGE-L pass
    train_seeds: tuple[int, ...] = (1, 2, 3)
    batch_size: int = 8  # train.batch_size = train.micro_batch_size (one process, no accumulation)
    init_threshold: float = 0.0  # DistiLLM's --init-threshold
    threshold_step: float = 0.1
    loss_eps: float = 0.1
    schedule: str = "decreasing"
    buffer_size: int = 1000  # DistiLLM's --capacity
    dev_rows: int = 128  # dev loss and the threshold's cross-entropy on these
    select_rows: int = 64  # dev ROUGE-L (selection, the token cap, "writes text") on the first ones
    # the outcomes
    eval_rows: int = 200  # first rows of each test set (Vicuna: its 80)
    sampling_seeds: tuple[int, ...] = (10, 20)
    cap_limit: int = 256  # the protocol's new tokens; the cap is at most this
    cap_quantile: float = 0.9
    cap_floor: int = 128
    # The estimate's cap before the teacher has written anything: Dolly dev references' 90th
    # percentile in SmolLM2 tokens (175, EOS counted; measured for the plan) rounded up to 32.
    planned_tokens: int = 192
    budget_cap: int | None = None  # set by the budget's cuts
    rows_floor: int = 120
    max_prompt_length_eval: int = 256  # the protocol's prompt cut (generation, agreement)
    inspect_rows: int = 200  # Dolly test rows the trajectory outcome is measured on
    eval_batch_size: int = 16
    engine: Literal["auto", "hf", "vllm"] = "auto"  # auto: vLLM where it is installed and pays
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    replicates: int = 2000
    test_sets: tuple[str, ...] = TEST_SETS
    budget_hours: float = 8.0

    @classmethod
    def full(cls) -> EvidenceSettings:
        return cls()

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> EvidenceSettings:
        """The settings a stamp or results.json recorded (JSON lists back to tuples; other keys,
        such as the stamp's recipe hash, ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k in names}
        return cls(**values)

    @property
    def teacher_row_count(self) -> int:
        return self.teacher_rows if self.teacher_rows is not None else DOLLY_TRAIN_ROWS

    def teacher_steps(self, rows: int | None = None) -> int:
        """Optimizer steps of the teacher's fine-tune over ``rows`` annotated rows (default: all)."""
        return math.ceil((rows or self.teacher_row_count) * self.teacher_epochs / self.batch_size)

    @property
    def train_rows(self) -> int:
        """Dolly train rows drawn for the students: one pass of a run, a few more for prompts over
        the length limit (skipped); every run sees the same rows in its own order."""
        return int(self.train_steps * self.batch_size * 1.1)

    def planned_cap(self) -> int:
        """The cap the estimate counts: the planned (or measured) one, after the budget's cuts."""
        return min(self.planned_tokens, self.budget_cap) if self.budget_cap is not None else self.planned_tokens

    def runs(self) -> list[tuple[EvidenceVariant, int]]:
        """Every training run, interleaved by seed (base, MTA, base, ...) so a run stopped halfway
        leaves the two variants equally far."""
        return [(variant, seed) for seed in self.train_seeds for variant in VARIANTS]

    def resolved_precision(self) -> str:
        return resolve_precision(self.precision, local_device())

    def engines(self, vllm: bool) -> dict[str, str]:
        """The generation engine of the test and the dev evaluation: the setting, or (auto) vLLM
        where it is installed (``vllm``) and its start-ups are paid back."""
        if self.engine != "auto":
            return {"test": self.engine, "dev": self.engine}
        from mta.demo.evidence_budget import set_rows

        students = len(self.runs())
        seeds = len(self.sampling_seeds)
        test = {name: rows * seeds for name, rows in set_rows(self).items()}
        cap = self.planned_cap()
        return {
            "test": cheaper_engine(test, cap, 2, students + 1, vllm),
            "dev": cheaper_engine({DEV_SET: self.select_rows * seeds}, cap, 1, students, vllm),
        }

    def estimated_seconds(self, *, vllm: bool | None = None, precision: str | None = None) -> dict[str, float]:
        """The plan's estimate per stage (:mod:`mta.demo.evidence_budget`)."""
        return estimated_seconds(
            self, precision=precision or self.resolved_precision(), vllm=vllm_installed() if vllm is None else vllm
        )


def vllm_installed() -> bool:
    from mta.generation.vllm_engine import vllm_available

    return vllm_available()


def run_label(variant: EvidenceVariant, seed: int) -> str:
    """``distillm-seed1``: a run's directory under ``runs/`` and its name in the evaluation."""
    return f"{variant.label}-seed{seed}"


@dataclass(frozen=True)
class EvidencePaths(StudentDirectory):
    @property
    def teacher_cache(self) -> Path:
        return self.root / "teacher-cache"

    def teacher_pilot(self, lr: float) -> Path:
        return self.root / "teacher" / "pilot" / f"lr-{lr:g}"

    @property
    def teacher_run(self) -> Path:
        return self.root / "teacher" / "fine-tune"

    def run(self, label: str) -> Path:
        return self.root / "runs" / label

    @property
    def eval_test(self) -> Path:
        return self.root / "eval" / "test"

    @property
    def eval_dev(self) -> Path:
        return self.root / "eval" / "dev"

    @property
    def eval_cap(self) -> Path:
        return self.root / "eval" / "token-cap"

    @property
    def agreement(self) -> Path:
        return self.root / "agreement.json"

    @property
    def inspect(self) -> Path:
        return self.root / "inspect"

    @property
    def cap(self) -> Path:
        return self.root / CAP_FILE

    @property
    def timings(self) -> Path:
        return self.root / TIMINGS_FILE

    @property
    def sessions(self) -> Path:
        return self.root / SESSIONS_FILE


def plan_lines(
    settings: EvidenceSettings,
    out_dir: str | Path = "runs/evidence",
    *,
    precision: str | None = None,
    vllm: bool | None = None,
) -> list[str]:
    """What :func:`run_evidence` will do, and for about how long, before it does it. precision:
    what ``settings.precision`` resolved to where the runs ran (default: on this machine); vllm:
    whether the vLLM engine is there for the run (default: unless ``settings.engine`` is hf, as
    ``make evidence`` installs it before the run)."""
    precision = precision or settings.resolved_precision()
    vllm = settings.engine != "hf" if vllm is None else vllm
    cut, cuts, fits = fit_budget(settings, precision=precision, vllm=vllm)
    estimate = cut.estimated_seconds(vllm=vllm, precision=precision)
    engines = cut.engines(vllm)
    passes = settings.train_steps // settings.eval_interval + 1
    rows = "every Dolly train row" if settings.teacher_rows is None else f"{settings.teacher_rows} Dolly train rows"
    lrs = ", ".join(f"{lr:g}" for lr in settings.teacher_pilot_lrs)
    student_tokens = f"{settings.max_length} tokens of which <= {settings.max_prompt_length} prompt"
    lines = [
        f"mta evidence ({settings.name}, layout {EVIDENCE_LAYOUT}): DistiLLM against DistiLLM + MTA under the "
        f"paper's protocol, output in {out_dir}/",
        f"  teacher: SmolLM2-135M-Instruct (30 layers) fine-tuned on {rows} "
        f"(teacher: null, loss.base: ce, batch {settings.batch_size}, {student_tokens}); pilot: "
        f"{settings.teacher_pilot_steps} steps at each lr of [{lrs}], the lowest dev loss on the first "
        f"{settings.dev_rows} Dolly dev rows wins; then {settings.teacher_epochs:g} epoch(s) "
        f"(~{settings.teacher_steps()} steps) at that lr, dev ROUGE-L on the first {settings.select_rows} "
        f"dev rows at step 0 and {settings.teacher_evals} more points, best/ chosen on dev; its ROUGE-L on "
        "the test sets is reported before and after",
        f"  students: the {settings.student_layers}-layer pruned copy of the ORIGINAL SmolLM2-135M-Instruct "
        "(not of the fine-tuned teacher), the same start for every run",
        f"  runs: {len(VARIANTS)} variants x {len(settings.train_seeds)} training seeds "
        f"{list(settings.train_seeds)} = {len(settings.runs())} runs of {settings.train_steps} steps "
        f"(batch {settings.batch_size}, {student_tokens}, {settings.train_rows} Dolly train rows drawn with "
        "seed 0), teacher from its cache on reference micro batches, online on generated ones",
    ]
    lines += [f"    {variant.label}: {variant.description}" for variant in VARIANTS]
    lines.append(
        f"    sampling (both): off_policy.mode adaptive, init_threshold {settings.init_threshold:g}, "
        f"threshold_step {settings.threshold_step:g}, loss_eps {settings.loss_eps:g}, schedule {settings.schedule}, "
        f"buffer_size {settings.buffer_size}, new tokens data.max_length - data.max_prompt_length; the loss "
        "is reduced per micro batch (over its response tokens), as DistiLLM does"
    )
    pairs = auto_layer_map(settings.student_layers, TEACHER_LAYERS)
    aligned = ", ".join(f"{p.student}->{p.teacher} {p.granularity}" for p in pairs)
    lines += [
        f"    auto layers (student -> teacher): {aligned}",
        f"  selection: dev ROUGE-L (1 sample, <= {settings.max_length - settings.max_prompt_length} new tokens) "
        f"on the first {settings.select_rows} annotated Dolly dev rows at step 0 and every "
        f"{settings.eval_interval} steps ({passes} passes a run; step 0 is never chosen); dev loss and the "
        f"sampling threshold's cross-entropy on the annotated ones of the first {settings.dev_rows} dev rows",
        f"  token cap: the fine-tuned teacher's outputs on those {settings.select_rows} dev rows "
        f"(<= {settings.cap_limit} new tokens, seed {settings.sampling_seeds[0]}): their "
        f"{settings.cap_quantile * 100:.0f} % quantile rounded up to 32, within "
        f"[{settings.cap_floor}, {settings.cap_limit}]; "
        f"planned {settings.planned_tokens} (Dolly dev references' 90 % quantile, 175 tokens, rounded up), "
        f"{cut.planned_cap()} after the budget's cuts",
        f"  ROUGE-L: the original and the fine-tuned teacher, the pruned start and the {len(settings.runs())} "
        f"chosen students on the first {cut.eval_rows} rows of {', '.join(settings.test_sets)} (Vicuna: all 80), "
        f"sampling seeds {list(settings.sampling_seeds)}, MiniLLM protocol at the cap; the same on the first "
        f"{settings.select_rows} dev rows (does the student write text?); engines: test {engines['test']}, "
        f"dev {engines['dev']} (vLLM where installed and its start-ups pay; the training's dev samples stay "
        "on the HF engine)",
        f"  teacher agreement: teacher-forced fkl, srkl (α 0.1) and top-1 agreement from the fine-tuned "
        f"teacher to each student on the same rows' first references (prompt <= {settings.max_prompt_length_eval}, "
        "response <= the cap); the teacher runs online there (the cache holds train and dev rows only)",
        f"  trajectory: mta inspect on the first {settings.inspect_rows} Dolly test rows (annotated, never "
        "trained on or chosen by): structure agreement and CKA at the aligned pairs, per student",
        f"  statistics: hierarchical bootstrap ({settings.replicates} replicates: training seeds, then "
        "sampling seeds, then rows), 95 % intervals, smallest difference detectable at 80 % power, for "
        "every outcome (the trajectory's: over training seeds only, one value per student and pair)",
        f"  precision: {precision} (requested {settings.precision})",
        "  estimate: "
        + ", ".join(f"{stage} {seconds / 60:.0f} min" for stage, seconds in estimate.items())
        + f"; total about {sum(estimate.values()) / 3600:.2f} h (finished stages are reused)",
        f"  budget: {settings.budget_hours:g} h; cut order: {BUDGET_CUTS}; "
        + (f"cuts: {'; '.join(cuts)}" if cuts else "no cut needed")
        + ("" if fits else " -- DOES NOT FIT: nothing runs"),
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

    teacher: a Hugging Face model directory instead of the converted SmolLM2 as the model the
    teacher is fine-tuned from and the students are pruned from (the test's tiny model);
    recipe_overrides: ``key=value`` strings applied to every run (the teacher's too) and to the
    teacher stage. A design whose estimate does not fit its budget, cut as the plan says, is
    refused before anything is written.
    """
    reporter = reporter or SilentReporter()
    paths = EvidencePaths(Path(out_dir))
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    precision, vllm = settings.resolved_precision(), vllm_installed()
    design = settings
    settings, cuts, fits = fit_budget(design, precision=precision, vllm=vllm)
    if not fits:
        raise MtaError(
            f"the design's estimate exceeds its budget of {design.budget_hours:g} h even after the cuts "
            f"({'; '.join(cuts) or 'none possible'}): `mta demo --evidence --plan` shows it"
            + ("" if vllm or settings.engine == "hf" else "; the plan counts on the vLLM engine: `make install-vllm`")
        )
    stamp = {
        **asdict(design),
        "layout": EVIDENCE_LAYOUT,
        "resolved_precision": precision,
        "recipe_sha256": file_sha256(recipe_path),
        "recipe_overrides": list(recipe_overrides),
        "teacher": str(teacher) if teacher is not None else None,
    }
    claim_demo_directory(paths.root, stamp, reporter, restart=False)
    record_session(paths)

    def timed(stage: str, work: Callable[[], Result]) -> Result:
        return timed_stage(paths, stage, work, done=False)

    def prepare() -> tuple[Path, Recipe]:
        model = Path(teacher) if teacher is not None else convert_smollm2(report=lambda line: reporter.message(line))
        if not (paths.student_init / "config.json").exists():
            reporter.message(f"student: keeping {settings.student_layers} of the original model's layers")
            init_student(model, paths.student_init, num_layers=settings.student_layers, force=True)
        source = data_dir / "dolly"
        teacher_rows = settings.teacher_rows if settings.teacher_rows is not None else 10**9
        copy_dolly_rows(source / "train.jsonl", paths.data("teacher-train"), teacher_rows, sample=True, demo="evidence")
        copy_dolly_rows(source / "train.jsonl", paths.data("train"), settings.train_rows, sample=True, demo="evidence")
        copy_dolly_rows(source / "dev.jsonl", paths.data("dev"), settings.dev_rows, sample=False, demo="evidence")
        copy_dolly_rows(
            source / "valid.jsonl", paths.data("inspect"), settings.inspect_rows, sample=False, demo="evidence"
        )
        recipe = _load_recipe(recipe_path, _shared_overrides(model, paths, settings, recipe_overrides))
        annotate = AnnotateSettings.from_recipe(recipe)
        for split in SPLITS:
            reporter.message(f"annotate: Dolly {split} rows")
            annotate_file(paths.data(split), paths.annotations(split), annotate)
        return model, recipe

    prepared = all((paths.annotations(s) / ".mta" / "manifest.json").exists() for s in SPLITS)
    original, _ = timed_stage(paths, "prepare", prepare, done=prepared)

    def load(overrides: Sequence[str]) -> Recipe:
        return _load_recipe(recipe_path, [*overrides, *recipe_overrides])

    annotated = _annotated_rows(paths.annotations("teacher-train"))
    fine_tuned, teacher_record = fine_tune_teacher(original, paths, settings, load, reporter, timed, annotated)
    # The measured cap replaces the planned one in the design as written (not as the plan cut it),
    # and the budget's cuts are made again from there.
    settings, cap_record = _token_cap(design, paths, fine_tuned, data_dir, reporter, precision=precision, vllm=vllm)

    shared = _shared_overrides(fine_tuned, paths, settings, recipe_overrides)
    recipe = _load_recipe(recipe_path, shared)
    cached = all((paths.teacher_cache / s / ".mta" / "manifest.json").exists() for s in ("train", "dev"))
    timed_stage(paths, "teacher cache", lambda: run_teacher_stage(recipe, reporter=reporter), done=cached)

    chosen = _train_runs(settings, paths, fine_tuned, recipe_path, recipe_overrides, reporter)
    students = {START: paths.student_init, **chosen}
    _evaluate_runs(settings, paths, {ORIGINAL: original, TEACHER: fine_tuned, **students}, data_dir, reporter, vllm)
    agreement_done = paths.agreement.is_file()
    timed_stage(
        paths,
        "teacher agreement",
        lambda: agreement_stage(fine_tuned, students, data_dir, paths.agreement, settings, cap_record["cap"], reporter),
        done=agreement_done and _agreement_complete(paths, settings),
    )
    timed_stage(
        paths,
        "trajectory",
        lambda: trajectory_stage(fine_tuned, students, paths.annotations("inspect"), paths.inspect, settings, reporter),
        done=(paths.inspect / "results.json").is_file(),
    )
    return summarise(design, paths)


SPLITS = ("teacher-train", "train", "dev", "inspect")


def _annotated_rows(annotations: Path) -> int:
    """Rows an annotate output directory holds (its manifest's count)."""
    manifest = json.loads((annotations / ".mta" / "manifest.json").read_text())
    rows = manifest.get("rows")
    if isinstance(rows, dict):
        rows = rows.get("written")
    if not isinstance(rows, int):
        raise MtaError(f"{annotations}/.mta/manifest.json names no row count; annotate it again")
    return rows


def _agreement_complete(paths: EvidencePaths, settings: EvidenceSettings) -> bool:
    record = json.loads(paths.agreement.read_text())
    return all(name in record.get("sets", {}) for name in settings.test_sets)


def _token_cap(
    settings: EvidenceSettings,
    paths: EvidencePaths,
    teacher: Path,
    data_dir: Path,
    reporter: Reporter,
    *,
    precision: str,
    vllm: bool,
) -> tuple[EvidenceSettings, dict[str, Any]]:
    """The cap from the fine-tuned teacher's dev outputs (stored in token-cap.json once), and the
    settings with it, cut again if the budget needs it."""
    if paths.cap.is_file():
        record = json.loads(paths.cap.read_text())
    else:
        seed = settings.sampling_seeds[0]
        eval_settings = EvalSettings(
            benchmarks=[DEV_SET],
            seeds=[seed],
            max_new_tokens=settings.cap_limit,
            batch_size=settings.eval_batch_size,
            limit=settings.select_rows,
            dtype=settings.precision,
        )
        reporter.message(f"token cap: the teacher's outputs on {settings.select_rows} dev rows")
        timed_stage(
            paths,
            "token cap",
            functools.partial(
                evaluate_checkpoints, [str(teacher)], [TEACHER], data_dir, paths.eval_cap, eval_settings, reporter
            ),
            done=False,
        )
        lengths = output_lengths(paths.eval_cap, TEACHER, DEV_SET, seed)
        rule = cap_from_lengths(
            lengths, quantile=settings.cap_quantile, limit=settings.cap_limit, floor=settings.cap_floor
        )
        measured = dataclasses.replace(settings, planned_tokens=rule, budget_cap=None)
        cut, cuts, fits = fit_budget(measured, precision=precision, vllm=vllm)
        record = {
            "lengths_quantile": float(np.quantile(lengths, settings.cap_quantile)),
            "reached_limit": int(sum(n >= settings.cap_limit for n in lengths)),
            "outputs": len(lengths),
            "rule": rule,
            "cap": cut.planned_cap(),
            "eval_rows": cut.eval_rows,
            "cuts": cuts,
            "fits": fits,
        }
        atomic_write_json(paths.cap, record)
    if not record["fits"]:
        raise MtaError(
            f"with the measured token cap ({record['rule']}) the design no longer fits its budget even after "
            f"the cuts ({'; '.join(record['cuts'])}); see {paths.cap}"
        )
    return dataclasses.replace(
        settings, planned_tokens=record["cap"], budget_cap=None, eval_rows=record["eval_rows"]
    ), record


def output_lengths(eval_dir: Path, label: str, set_name: str, seed: int) -> list[int]:
    """New tokens of every prediction (EOS counted) in a predictions file of ``mta evaluate``."""
    path = CheckpointPaths.of(eval_dir, label).predictions(set_name, seed)
    return [
        int(json.loads(line)["new_tokens"]) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
    ]


def _train_runs(
    settings: EvidenceSettings,
    paths: EvidencePaths,
    teacher: Path,
    recipe_path: str | Path,
    recipe_overrides: Sequence[str],
    reporter: Reporter,
) -> dict[str, Path]:
    """Train (or resume, or skip when finished) every variant and seed; ``{label: its best/}``."""
    chosen: dict[str, Path] = {}
    for variant, seed in settings.runs():
        label = run_label(variant, seed)
        overrides = [*_shared_overrides(teacher, paths, settings, recipe_overrides), *variant.overrides]
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
    settings: EvidenceSettings,
    paths: EvidencePaths,
    checkpoints: dict[str, Path],
    data_dir: Path,
    reporter: Reporter,
    vllm: bool,
) -> None:
    """Evaluate ``checkpoints`` ({label: directory}) on the test sets, and the fine-tuned teacher
    and the runs on dev (each skipped when done)."""
    engines = settings.engines(vllm)
    on_dev = {label: path for label, path in checkpoints.items() if label not in (ORIGINAL, START)}
    evaluations = {
        "test": (paths.eval_test, list(settings.test_sets), settings.eval_rows, checkpoints),
        "dev": (paths.eval_dev, [DEV_SET], settings.select_rows, on_dev),
    }
    for split, (directory, sets, limit, models) in evaluations.items():
        eval_settings = EvalSettings(
            benchmarks=sets,
            seeds=list(settings.sampling_seeds),
            max_new_tokens=settings.planned_cap(),
            batch_size=settings.eval_batch_size,
            limit=limit,
            dtype=settings.precision,
            engine=engines[split],
        )
        reporter.message(f"evaluate: {', '.join(sets)} ({limit} rows, seeds {list(settings.sampling_seeds)})")
        timed_stage(
            paths,
            f"evaluate {split}",
            functools.partial(
                evaluate_checkpoints,
                [str(p) for p in models.values()],
                list(models),
                data_dir,
                directory,
                eval_settings,
                reporter,
            ),
            done=(directory / "results.json").exists(),
        )


def read_back(out_dir: str | Path) -> dict[str, Any]:
    """What :func:`run_evidence` returned, read from a finished directory with the settings it
    was stamped with (``mta demo --evidence --report``: the report again, nothing run)."""
    paths = EvidencePaths(Path(out_dir))
    stamp_path = paths.root / SETTINGS_FILE
    if not stamp_path.exists():
        raise MtaError(f"{paths.root} holds no evidence run ({stamp_path} is missing)")
    stamp = json.loads(stamp_path.read_text())
    if stamp.get("layout") != EVIDENCE_LAYOUT:
        raise MtaError(
            f"{paths.root} holds an evidence run of layout {stamp.get('layout', 1)} (the first design); this mta "
            f"reads layout {EVIDENCE_LAYOUT}: its report is docs/evidence-results.md"
        )
    return summarise(EvidenceSettings.from_record(stamp), paths)


def _load_recipe(path: str | Path, overrides: Sequence[str]) -> Recipe:
    recipe = load_recipe(path, list(overrides))
    if not isinstance(recipe, Recipe):
        raise MtaError(f"{path}: the evidence compares language-model students; give a recipe of task llm")
    return recipe


def _data_overrides(settings: EvidenceSettings) -> list[str]:
    return [f"data.max_length={settings.max_length}", f"data.max_prompt_length={settings.max_prompt_length}"]


def _shared_overrides(
    teacher: Path, paths: EvidencePaths, settings: EvidenceSettings, extra: Sequence[str]
) -> list[str]:
    return [
        f"teacher.path={teacher}",
        f"student.path={paths.student_init}",
        "student.config=null",
        f"data.train={paths.annotations('train')}",
        f"data.dev={paths.annotations('dev')}",
        *_data_overrides(settings),
        f"teacher_cache.dir={paths.teacher_cache}",
        f"train.precision={settings.precision}",
        f"train.batch_size={settings.batch_size}",
        f"train.micro_batch_size={settings.batch_size}",
        f"train.max_steps={settings.train_steps}",
        f"train.eval_interval={settings.eval_interval}",
        f"train.save_interval={settings.eval_interval}",
        "train.select_by=rouge",
        f"train.select_rows={settings.select_rows}",
        "off_policy.mode=adaptive",
        f"off_policy.init_threshold={settings.init_threshold}",
        f"off_policy.threshold_step={settings.threshold_step}",
        f"off_policy.loss_eps={settings.loss_eps}",
        f"off_policy.schedule={settings.schedule}",
        f"off_policy.buffer_size={settings.buffer_size}",
        "off_policy.max_new_tokens=null",
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
    """Every outcome from the files on disk (every stage finished): per-run curves and choices,
    the teacher before and after, ROUGE-L, teacher agreement and trajectory with their bootstrap
    differences, the "writes text" check, the token cap, the stage times and the sessions'
    commits. What results.json holds."""
    needed = [
        paths.eval_test / "results.json",
        paths.eval_dev / "results.json",
        paths.cap,
        paths.agreement,
        paths.inspect / "results.json",
    ]
    missing = [str(p) for p in needed if not p.exists()]
    if missing:
        raise MtaError(f"{paths.root} is not finished ({', '.join(missing)} missing): run `mta demo --evidence` first")
    cap = json.loads(paths.cap.read_text())
    run_settings = dataclasses.replace(settings, planned_tokens=cap["cap"], budget_cap=None, eval_rows=cap["eval_rows"])
    seeds = run_settings.sampling_seeds
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
    labels = {v.label: [run_label(v, s) for s in settings.train_seeds] for v in VARIANTS}

    def rouge(label: str, name: str) -> np.ndarray:
        return row_scores(paths.eval_test, label, name, seeds)

    scores = {v: {name: np.stack([rouge(r, name) for r in labels[v]]) for name in settings.test_sets} for v in labels}
    differences = bootstrap_differences(scores[BASE.label], scores[MTA.label], replicates=settings.replicates)
    models = {
        label: {name: float(rouge(label, name).mean()) for name in settings.test_sets}
        for label in (ORIGINAL, TEACHER, START)
    }
    dev_teacher = float(row_scores(paths.eval_dev, TEACHER, DEV_SET, seeds).mean())
    for label, run in runs.items():
        run["dev_rouge"] = float(row_scores(paths.eval_dev, label, DEV_SET, seeds).mean())
        run["writes_text"] = run["dev_rouge"] >= dev_teacher / 2
    agreement = _agreement_outcome(json.loads(paths.agreement.read_text()), labels, settings)
    trajectory = _trajectory_outcome(json.loads((paths.inspect / "results.json").read_text()), labels, settings)
    teacher_dir = paths.teacher_run
    return {
        "settings": {**asdict(settings), "train_rows": settings.train_rows},
        "run_settings": {"max_new_tokens": cap["cap"], "eval_rows": cap["eval_rows"]},
        "token_cap": cap,
        "variants": {v.label: v.description for v in VARIANTS},
        "teacher": {
            "sets": models[TEACHER],
            "original": models[ORIGINAL],
            "dev_rouge": dev_teacher,
            "fine_tune": _teacher_record(teacher_dir),
        },
        "start": models[START],
        "means": {v: {name: float(values.mean()) for name, values in per_set.items()} for v, per_set in scores.items()},
        "differences": {name: asdict(d) for name, d in differences.items()},
        "agreement": agreement,
        "trajectory": trajectory,
        "runs": runs,
        "timings": json.loads(paths.timings.read_text()) if paths.timings.exists() else {},
        "protocol": json.loads((paths.eval_test / "results.json").read_text()).get("protocol"),
        "precision": json.loads((paths.root / SETTINGS_FILE).read_text())["resolved_precision"],
        "out_dir": str(paths.root),
        "sessions": json.loads(paths.sessions.read_text()),
    }


def _teacher_record(run_dir: Path) -> dict[str, Any]:
    from mta.demo.evidence_teacher import PILOT_FILE

    selection = json.loads((run_dir / "best" / "selection.json").read_text())
    pilot = run_dir.parent / "pilot" / PILOT_FILE
    return {
        "pilot": json.loads(pilot.read_text()) if pilot.is_file() else None,
        "chosen_step": selection["step"],
        "dev_rouge_at_selection": selection["value"],
        "curve": dev_curve(run_dir),
    }


def _agreement_outcome(record: dict, labels: dict[str, list[str]], settings: EvidenceSettings) -> dict[str, Any]:
    """Per measure: each variant's and the start's mean per set, and MTA − base bootstrapped."""
    outcome: dict[str, Any] = {}
    for measure in AGREEMENT_MEASURES:
        per_variant = {v: agreement_scores(record, labels[v], measure, settings.test_sets) for v in labels}
        start = agreement_scores(record, [START], measure, settings.test_sets)
        found = bootstrap_differences(per_variant[BASE.label], per_variant[MTA.label], replicates=settings.replicates)
        outcome[measure] = {
            "means": {v: {n: float(a.mean()) for n, a in sets.items()} for v, sets in per_variant.items()},
            "start": {n: float(a.mean()) for n, a in start.items()},
            "differences": {name: asdict(d) for name, d in found.items()},
        }
    return outcome


def _trajectory_outcome(results: dict, labels: dict[str, list[str]], settings: EvidenceSettings) -> dict[str, Any]:
    """Per measure: each variant's and the start's value per aligned pair, MTA − base bootstrapped
    over the training seeds."""
    outcome: dict[str, Any] = {"estimator": results.get("estimator"), "rows": results["rows"]["count"]}
    for measure in TRAJECTORY_MEASURES:
        per_variant = {v: trajectory_scores(results, labels[v], measure) for v in labels}
        start = trajectory_scores(results, [START], measure)
        found = bootstrap_differences(per_variant[BASE.label], per_variant[MTA.label], replicates=settings.replicates)
        outcome[measure] = {
            "means": {v: {p: float(a.mean()) for p, a in pairs.items()} for v, pairs in per_variant.items()},
            "start": {p: float(a.mean()) for p, a in start.items()},
            "differences": {name: asdict(d) for name, d in found.items()},
        }
    return outcome


__all__ = [
    "BASE",
    "MTA",
    "VARIANTS",
    "EvidencePaths",
    "EvidenceSettings",
    "EvidenceVariant",
    "dev_curve",
    "output_lengths",
    "plan_lines",
    "read_back",
    "record_session",
    "row_scores",
    "run_evidence",
    "run_label",
    "summarise",
    "timed_stage",
]
