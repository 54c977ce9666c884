"""The demo's stages, each reused when its output is already complete.

convert teacher -> prune student -> sample Dolly -> annotate -> distill x3 -> evaluate -> report.
Everything is written under ``out_dir`` except the converted teacher, which lives in the model
cache so that deleting the demo's directory never forces a reconversion.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mta.data.annotate import AnnotateSettings, annotate_file
from mta.demo.inspect_students import inspect_students
from mta.demo.settings import VARIANTS, DemoSettings, Variant
from mta.distributed import local_device
from mta.dtypes import auto_reason, resolve_precision
from mta.errors import MtaError
from mta.evaluation import EvalSettings, evaluate_checkpoints
from mta.evaluation.datasets import default_data_dir
from mta.files import atomic_write_json, atomic_write_text
from mta.models.pruning import init_student
from mta.models.smollm2 import convert_smollm2
from mta.reporting import Reporter, SilentReporter
from mta.training.config.catalog import SHIPPED_DIR
from mta.training.config.loading import load_recipe
from mta.training.config.schema import Recipe
from mta.training.engine import resolve_training_precision
from mta.training.lifecycle.checkpointing import latest_checkpoint
from mta.training.trainer import run_distillation

DEMO_RECIPE = SHIPPED_DIR / "smollm2-demo.yaml"
SETTINGS_FILE = "demo.json"
# Bumped when a demo directory written earlier cannot be continued (2: run.json, fingerprints).
DEMO_LAYOUT = 2


@dataclass(frozen=True)
class StudentDirectory:
    """What every LLM demo directory starts with: the pruned start, the sampled Dolly rows and
    their annotations (``mta demo`` and ``mta demo --evidence``)."""

    root: Path

    @property
    def student_init(self) -> Path:
        return self.root / "student-init"

    def data(self, split: str) -> Path:
        return self.root / "data" / f"{split}.jsonl"

    def annotations(self, split: str) -> Path:
        return self.root / "annotations" / split


@dataclass(frozen=True)
class DemoPaths(StudentDirectory):
    def run(self, variant: Variant) -> Path:
        return self.root / "runs" / variant.name

    def eval_dir(self, group: int) -> Path:
        return self.root / "eval" / f"group-{group}"


def run_demo(
    settings: DemoSettings,
    out_dir: str | Path = "runs/demo",
    *,
    data_dir: str | Path | None = None,
    recipe_path: str | Path = DEMO_RECIPE,
    teacher: str | Path | None = None,
    recipe_overrides: tuple[str, ...] = (),
    reporter: Reporter | None = None,
) -> dict:
    """Run (or finish) the whole demo; returns the combined results that the report shows.

    teacher: a Hugging Face model directory to use instead of the converted SmolLM2 (tests use
    a tiny random model); recipe_overrides: ``key=value`` strings applied to every run.
    """
    reporter = reporter or SilentReporter()
    paths = DemoPaths(Path(out_dir))
    given = data_dir is not None
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    require_dolly(data_dir, given=given)  # before any work: the sets every later stage reads
    _claim(paths, settings, reporter)
    stages = StageClock()

    with stages("teacher"):
        if teacher is None:
            teacher = convert_smollm2(report=lambda line: reporter.message(f"teacher: {line}"))
        teacher = Path(teacher)
    with stages("student"):
        if not (paths.student_init / "config.json").exists():
            reporter.message(f"student: keeping {settings.student_layers} of the teacher's layers")
            init_student(teacher, paths.student_init, num_layers=settings.student_layers, force=True)

    overrides = _path_overrides(teacher, paths) + settings.recipe_overrides() + list(recipe_overrides)
    with stages("data"):
        base = load_recipe(recipe_path, overrides)
        _sample_dolly(data_dir, paths, settings, base)
        annotate = AnnotateSettings.from_recipe(base)
        for split in ("train", "dev"):
            reporter.message(f"annotate: Dolly {split} rows")
            annotate_file(paths.data(split), paths.annotations(split), annotate)

    finals, timings = {}, {}
    for variant in VARIANTS:
        recipe = load_recipe(
            recipe_path,
            overrides
            + [f"output_dir={paths.run(variant)}", f"train.max_steps={settings.train_steps}"]
            + list(variant.overrides),
        )
        with stages(f"train {variant.label}"):
            finals[variant.name], timings[variant.name] = _distill(recipe, variant, reporter)

    checkpoints = {"teacher": teacher, "pruned-start": paths.student_init}
    checkpoints.update({variant.label: finals[variant.name] for variant in VARIANTS})
    with stages("evaluate"):
        results = _evaluate(checkpoints, data_dir, paths, settings, reporter)
    students = {label: Path(path) for label, path in checkpoints.items() if label != "teacher"}
    with stages("inspect"):
        results["inspect"] = inspect_students(
            teacher,
            students,
            paths.annotations("dev"),
            paths.root,
            precision=settings.precision,
            rows=settings.inspect_rows,
            reporter=reporter,
        )
    results["training_seconds"] = {v.label: timings[v.name] for v in VARIANTS}
    # This session's wall time per stage (a stage reused from an earlier session: its check only).
    results["stage_seconds"] = stages.seconds
    results["metrics"] = {v.label: str(paths.run(v) / "metrics.jsonl") for v in VARIANTS}
    results["settings"] = {"demo": asdict(settings), "recipe": str(recipe_path)}
    device = local_device()
    results["precision"] = {
        "train": resolve_training_precision(base.train, device).name,
        "evaluate": resolve_precision(settings.precision, device),
        "requested": settings.precision,
        "reason": auto_reason(device),
    }
    return results


class StageClock:
    """Wall seconds per stage of this session, in order: ``with clock("evaluate"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = round(self.seconds.get(stage, 0.0) + time.perf_counter() - started, 2)


def require_dolly(data_dir: Path, *, given: bool) -> None:
    """``MtaError`` before any work when ``data_dir`` lacks Dolly's train and dev files, naming
    ``--data-dir`` when it was given, else ``MTA_DATA_DIR``."""
    missing = [data_dir / "dolly" / f"{split}.jsonl" for split in ("train", "dev")]
    missing = [path for path in missing if not path.is_file()]
    if not missing:
        return
    source = f"--data-dir {data_dir}" if given else f"{data_dir} ($MTA_DATA_DIR, else ./data)"
    raise MtaError(
        f"the demo reads the instruction sets from {source}, which lacks {', '.join(map(str, missing))}: "
        f"give {'another --data-dir' if given else '--data-dir DIR or set MTA_DATA_DIR'} holding dolly/, "
        "self-inst/, vicuna/ and sinst/ (`mta data download` fetches them where the Hugging Face Hub is reachable)"
    )


def _claim(paths: DemoPaths, settings: DemoSettings, reporter: Reporter) -> None:
    """Start over when the directory holds a demo of the other size (quick overwrites full), or
    one an mta with another directory layout wrote (its runs and predictions would be refused)."""
    # The precision as resolved here: on a machine where auto means another, the runs and the
    # predictions (whose claims name their dtype) are redone.
    precision = resolve_precision(settings.precision, local_device())
    claim_demo_directory(
        paths.root, {**asdict(settings), "layout": DEMO_LAYOUT, "resolved_precision": precision}, reporter
    )


def claim_demo_directory(root: Path, stamp: dict, reporter: Reporter, *, restart: bool = True) -> None:
    """Make ``root`` a demo's directory stamped ``stamp`` (its settings, in ``demo.json``). A
    directory stamped otherwise is deleted first (``reporter`` says so), so a demo of other
    settings is started over rather than continued; with ``restart=False`` (hours of runs) it is
    refused instead, naming the settings that differ."""
    stamp_path = root / SETTINGS_FILE
    wanted = json.dumps(stamp, sort_keys=True)
    found = json.loads(stamp_path.read_text()) if stamp_path.exists() else None
    if found is not None and json.dumps(found, sort_keys=True) != wanted:
        if not restart:
            written = json.loads(wanted)  # tuples as the JSON file holds them: lists
            differ = sorted(k for k in {*found, *written} if found.get(k) != written.get(k))
            raise MtaError(
                f"{root} holds a run of other settings ({', '.join(differ)} differ; {stamp_path} has "
                "its own): give another --out, or delete the directory to start over"
            )
        reporter.message(f"{root} holds a demo with other settings: starting it over")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(stamp_path, wanted + "\n")


def _path_overrides(teacher: Path, paths: DemoPaths) -> list[str]:
    return [
        f"teacher.path={teacher}",
        f"student.path={paths.student_init}",
        f"data.train={paths.annotations('train')}",
        f"data.dev={paths.annotations('dev')}",
    ]


def _sample_dolly(data_dir: Path, paths: DemoPaths, settings: DemoSettings, recipe: Recipe) -> None:
    """A fixed, seeded subset of Dolly train (one pass of training) and the first dev rows."""
    wanted = {
        # A few more rows than steps x batch: prompts over the length limit are skipped.
        "train": (data_dir / "dolly" / "train.jsonl", int(settings.train_steps * recipe.train.batch_size * 1.1)),
        "dev": (data_dir / "dolly" / "dev.jsonl", settings.dev_rows),
    }
    for split, (source, count) in wanted.items():
        copy_dolly_rows(source, paths.data(split), count, sample=split == "train", demo="the demo")


def copy_dolly_rows(source: Path, target: Path, count: int, *, sample: bool, demo: str) -> None:
    """``count`` rows of the Dolly file ``source`` into ``target``: drawn with seed 0 (kept in file
    order) when ``sample``, else the first ones; an existing ``target`` is kept. ``demo`` names
    the demo in the error for a missing ``source``."""
    if target.exists():
        return
    if not source.exists():
        raise MtaError(
            f"{demo} needs {source}; set MTA_DATA_DIR to a directory holding dolly/train.jsonl "
            "and dolly/dev.jsonl (`mta data download` fetches them where the Hugging Face Hub "
            "is reachable)"
        )
    lines = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    count = min(count, len(lines))
    chosen = sorted(random.Random(0).sample(range(len(lines)), count)) if sample else range(count)
    atomic_write_text(target, "".join(lines[i] + "\n" for i in chosen))


def _distill(recipe: Recipe, variant: Variant, reporter: Reporter) -> tuple[Path, float]:
    output_dir = recipe.resolve(recipe.output_dir, "output_dir")
    final, timing = output_dir / "final", output_dir / "demo-timing.json"
    if (final / "config.json").exists() and timing.exists():
        reporter.message(f"{variant.label}: already trained ({final})")
        return final, json.loads(timing.read_text())["seconds"]
    reporter.message(f"distill: {variant.label}")
    # The demo owns its run directories: an interrupted run is continued, never refused.
    resumed = latest_checkpoint(output_dir) is not None
    started = time.perf_counter()
    final = run_distillation(recipe, resume="auto", reporter=reporter)
    seconds = time.perf_counter() - started
    atomic_write_json(timing, {"seconds": seconds, "resumed": resumed})
    return final, seconds


def _evaluate(
    checkpoints: dict[str, Path], data_dir: Path, paths: DemoPaths, settings: DemoSettings, reporter: Reporter
) -> dict:
    """One `evaluate_checkpoints` call per distinct row limit, merged into one result."""
    groups: dict[int, list[str]] = {}
    for set_name, limit in settings.eval_limits.items():
        groups.setdefault(limit, []).append(set_name)
    merged: dict[str, Any] = {"checkpoints": {label: {"sets": {}} for label in checkpoints}, "perplexity": None}
    for index, (limit, set_names) in enumerate(sorted(groups.items(), key=lambda item: -item[0])):
        with_perplexity = index == 0
        reporter.message(f"evaluate: {', '.join(set_names)} ({limit} rows, {len(settings.seeds)} seed(s))")
        eval_settings = EvalSettings(
            benchmarks=set_names,
            seeds=list(settings.seeds),
            max_new_tokens=settings.max_new_tokens,
            batch_size=settings.eval_batch_size,
            limit=limit,
            dtype=settings.precision,
            perplexity="dolly-dev" if with_perplexity else None,
            perplexity_limit=settings.perplexity_rows if with_perplexity else None,
        )
        results = evaluate_checkpoints(
            [str(path) for path in checkpoints.values()],
            list(checkpoints),
            data_dir,
            paths.eval_dir(index),
            eval_settings,
            reporter,
        )
        for label, run in results["checkpoints"].items():
            merged["checkpoints"][label]["sets"].update(run["sets"])
            merged["checkpoints"][label]["checkpoint"] = run["checkpoint"]
            if with_perplexity:
                merged["checkpoints"][label]["perplexity"] = run["perplexity"]
        merged["protocol"] = results["protocol"]
        merged["versions"] = results["versions"]
    return merged
