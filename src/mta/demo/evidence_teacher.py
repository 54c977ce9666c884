"""The evidence's teacher (issue 47): SmolLM2-135M-Instruct fine-tuned on Dolly's training rows,
as the protocol's teachers are (docs/method.md §4), its lr chosen by a pilot on dev rows only.

``mta distill`` with ``teacher: null`` and ``loss.base: ce`` trains the shipped model itself. The
pilot trains ``teacher_pilot_steps`` at each candidate lr (the same schedule shape, shortened: a
short pilot favours the larger rates, which the plan says) and keeps the lr of the lowest dev
loss at its last evaluation; the fine-tune then runs ``teacher_epochs`` over every training row
at that lr, with dev ROUGE-L at ``teacher_evals`` points, and ``best/`` is the teacher. Every run
resumes from its newest checkpoint and a finished one is reused.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mta.errors import MtaError
from mta.files import atomic_write_json
from mta.reporting import Reporter
from mta.training.lifecycle.checkpointing import latest_checkpoint
from mta.training.lifecycle.metrics import read_metrics
from mta.training.lifecycle.selection import ROUGE_KEY
from mta.training.trainer import run_distillation

if TYPE_CHECKING:
    from mta.demo.evidence import EvidencePaths, EvidenceSettings
    from mta.training.config.schema import Recipe

PILOT_FILE = "pilot.json"
SAVE_EVERY = 100  # the fine-tune's checkpoints: about 8 min of its steps on the development machine


def teacher_overrides(original: Path, paths: EvidencePaths, settings: EvidenceSettings) -> list[str]:
    """What makes the demo recipe a supervised fine-tune of ``original`` on the teacher's rows."""
    return [
        "teacher=null",
        "loss.base=ce",
        "loss.dsa_weight=0",
        "loss.hra_weight=0",
        f"student.path={original}",
        "student.config=null",
        f"data.train={paths.annotations('teacher-train')}",
        f"data.dev={paths.annotations('dev')}",
        f"data.max_length={settings.max_length}",
        f"data.max_prompt_length={settings.max_prompt_length}",
        f"train.precision={settings.precision}",
        f"train.batch_size={settings.batch_size}",
        f"train.micro_batch_size={settings.batch_size}",
        "off_policy.mode=off",
        "teacher_cache.dir=null",
    ]


def dev_losses(run_dir: Path) -> list[tuple[int, float]]:
    """``(step, dev loss)`` of a run's dev evaluations, in order."""
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if r.get("split") == "dev"]


def choose_lr(curves: dict[float, list[tuple[int, float]]]) -> float:
    """The lr whose last dev loss is lowest (the first listed among equals); a pilot without a dev
    evaluation after step 0 is an error."""
    finals = {}
    for lr, curve in curves.items():
        trained = [loss for step, loss in curve if step > 0]
        if not trained:
            raise MtaError(f"the teacher pilot at lr {lr:g} logged no dev loss after step 0")
        finals[lr] = trained[-1]
    return min(finals, key=lambda lr: finals[lr])


def _train(recipe: Recipe, run_dir: Path, what: str, reporter: Reporter, timed: Callable[..., Any]) -> None:
    if (run_dir / "final" / "config.json").exists():
        reporter.message(f"{what}: already trained")
        return
    resumed = latest_checkpoint(run_dir) is not None
    reporter.message(f"{what}" + (" (resumed)" if resumed else ""))
    timed(functools.partial(run_distillation, recipe, resume="auto", reporter=reporter))


def fine_tune_teacher(
    original: Path,
    paths: EvidencePaths,
    settings: EvidenceSettings,
    load: Callable[[Sequence[str]], Recipe],
    reporter: Reporter,
    timed: Callable[[str, Callable[[], Any]], Any],
    annotated_rows: int,
) -> tuple[Path, dict[str, Any]]:
    """The pilot, then the fine-tune; returns the teacher (``best/``) and what the report records
    of both. ``load(overrides)``: the demo recipe with the evidence's and the caller's overrides;
    ``timed(stage, work)``: the stage's timer; ``annotated_rows``: the teacher's training rows
    after annotation (those over the length limits are skipped)."""
    shared = teacher_overrides(original, paths, settings)
    pilot_root = paths.teacher_pilot(settings.teacher_pilot_lrs[0]).parent
    curves: dict[float, list[tuple[int, float]]] = {}
    for lr in settings.teacher_pilot_lrs:
        run_dir = paths.teacher_pilot(lr)
        interval = max(1, settings.teacher_pilot_steps // 2)
        recipe = load(
            [
                *shared,
                f"train.lr={lr}",
                f"train.max_steps={settings.teacher_pilot_steps}",
                f"train.eval_interval={interval}",
                f"train.save_interval={interval}",
                "train.select_by=loss",
                f"output_dir={run_dir}",
            ]
        )
        _train(recipe, run_dir, f"teacher pilot: lr {lr:g}", reporter, lambda work: timed("teacher pilot", work))
        curves[lr] = dev_losses(run_dir)
    lr = choose_lr(curves)
    pilot = {"curves": {f"{k:g}": v for k, v in curves.items()}, "chosen_lr": lr}
    atomic_write_json(pilot_root / PILOT_FILE, pilot)

    steps = settings.teacher_steps(annotated_rows)
    interval = max(1, math.ceil(steps / settings.teacher_evals))
    recipe = load(
        [
            *shared,
            f"train.lr={lr}",
            "train.max_steps=null",
            f"train.epochs={settings.teacher_epochs}",
            f"train.eval_interval={interval}",
            f"train.save_interval={min(interval, SAVE_EVERY)}",  # a stop loses at most SAVE_EVERY steps
            "train.select_by=rouge",
            f"train.select_rows={settings.select_rows}",
            f"output_dir={paths.teacher_run}",
        ]
    )
    _train(
        recipe, paths.teacher_run, f"teacher fine-tune: lr {lr:g}", reporter, lambda w: timed("teacher fine-tune", w)
    )
    best = paths.teacher_run / "best"
    if not (best / "config.json").exists():
        raise MtaError(f"{paths.teacher_run} has no best/ checkpoint: its dev selection never ran")
    selection = json.loads((best / "selection.json").read_text())
    record = {
        "pilot": pilot,
        "steps": steps,
        "eval_interval": interval,
        "chosen_step": selection["step"],
        "dev_rouge_at_selection": selection["value"],
        "curve": [
            {"step": r["step"], "loss": r.get("loss"), "rougeL": r.get(ROUGE_KEY)}
            for r in read_metrics(paths.teacher_run / "metrics.jsonl")
            if r.get("split") == "dev"
        ],
    }
    return best, record


__all__ = ["PILOT_FILE", "choose_lr", "dev_losses", "fine_tune_teacher", "teacher_overrides"]
