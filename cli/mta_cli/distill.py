"""`mta distill`: train a student with a base loss + MTA as a recipe describes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from mta.training.recipe import load_recipe


def distill(
    recipe: Path = typer.Option(..., "--recipe", "-r", help="recipe YAML (see recipes/)"),
    overrides: Optional[List[str]] = typer.Argument(
        None, help="key=value overrides, e.g. train.lr=5e-5 train.zero_stage=3", show_default=False
    ),
    resume: Optional[str] = typer.Option(
        None, "--resume", help="'auto' (newest complete checkpoint in output_dir) or a checkpoint dir"
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="validate, plan (models on the meta device, memory) and exit"
    ),
) -> None:
    """Distill a student from a teacher with DSA + HRA on top of a base loss (DeepSpeed).

    Single process: `mta distill --recipe R`. Several GPUs or nodes: launch the same command with
    `deepspeed --no_local_rank --num_gpus N $(which mta) distill ...` or `torchrun --nproc-per-node N $(which mta)
    distill ...`; the global batch stays train.batch_size. Writes OUT/checkpoints/step-N/,
    OUT/final/ (Hugging Face format) and OUT/metrics.jsonl.
    """
    loaded = load_recipe(recipe, overrides or [])
    console = Console(stderr=True)
    if dry_run:
        from mta.training.dry_run import plan_run, render_plan

        console.print(render_plan(plan_run(loaded, world_size=int(os.environ.get("WORLD_SIZE", 1)))))
        return
    from mta.training.metrics import RichReporter
    from mta.training.trainer import run_distillation

    is_main = int(os.environ.get("RANK", 0)) == 0
    reporter = RichReporter(console) if is_main else None
    final = run_distillation(loaded, resume=resume, reporter=reporter)
    if is_main:
        console.print(f"[green]done:[/] {final}  (load it with AutoModelForCausalLM.from_pretrained)")
