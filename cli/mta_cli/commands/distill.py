"""`mta distill`: train a student with a base loss + MTA as a recipe describes."""

from __future__ import annotations

import contextlib
import os
import shlex
from pathlib import Path

import typer
from rich.text import Text

from mta.errors import MtaError
from mta_cli.consoles import stderr_console, stdout_console
from mta_cli.exit_codes import INTERRUPTED, stopped_exit_code
from mta_cli.quiet import VERBOSE_HELP, quiet_third_party


def resume_command(recipe: str, overrides: list[str], *, verbose: bool = False) -> str:
    """The shell command that continues this run: the same recipe and overrides, ``--resume auto``."""
    argv = ["mta", "distill", "--recipe", recipe, *overrides, "--resume", "auto"]
    return shlex.join(argv + (["--verbose"] if verbose else []))


def _last_checkpoint(output_dir: Path) -> str:
    from mta.training.lifecycle.checkpointing import checkpoints_dir, complete_checkpoints

    found = complete_checkpoints(output_dir)
    if found:
        step, path = found[-1]
        return f"last complete checkpoint {path} (step {step})"
    return f"no complete checkpoint yet under {checkpoints_dir(output_dir)}"


def _resume_with(command: str) -> str:
    launcher = " (under the same launcher)" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    return f"resume with{launcher}: {command}"


def interrupted_line(output_dir: Path, command: str) -> str:
    """One line for Ctrl-C: the newest complete checkpoint under ``output_dir`` and the command
    that continues from it (``--resume auto`` finds it, or starts at step 0 when there is none)."""
    return f"interrupted: {_last_checkpoint(output_dir)}; {_resume_with(command)}"


def stopped_line(stopped, output_dir: Path, command: str) -> str:
    """One line for a run stopped by a signal (``mta.training.lifecycle.stopping.RunStopped``):
    the checkpoint it wrote, or why it wrote none and the newest complete one; the command that
    continues."""
    if stopped.checkpoint is not None:
        return (
            f"stopped by {stopped.signal_name} after step {stopped.step}: saved {stopped.checkpoint}; "
            + _resume_with(command)
        )
    return (
        f"stopped by {stopped.signal_name} without saving ({stopped.reason}): "
        f"{_last_checkpoint(output_dir)}; {_resume_with(command)}"
    )


def with_output_dir(overrides: list[str], out: Path | None) -> list[str]:
    """``overrides`` with ``-o/--out DIR`` as ``output_dir=DIR`` (one spelling of the output, as
    every command has); an ``output_dir=`` override of another value as well is an ``MtaError``."""
    if out is None:
        return overrides
    given = [item.partition("=")[2] for item in overrides if item.partition("=")[0].strip() == "output_dir"]
    if any(value != str(out) for value in given):
        raise MtaError(f"-o {out} and the override output_dir={given[-1]} name two directories; give one of them")
    return [*overrides, f"output_dir={out}"] if not given else overrides


def distill(
    recipe: str = typer.Option(
        ...,
        "--recipe",
        "-r",
        show_default=False,
        help="recipe YAML file, or the name of a shipped recipe (`mta recipes list`); "
        "an existing file (NAME, then NAME.yaml) wins over a shipped name",
    ),
    overrides: list[str] | None = typer.Argument(
        None, help="key=value overrides, e.g. train.lr=5e-5 train.zero_stage=3", show_default=False
    ),
    out: Path | None = typer.Option(
        None,
        "-o",
        "--out",
        help="Output directory: the recipe's output_dir (the same as the override output_dir=DIR) "
        "[default: the recipe's output_dir].",
        show_default=False,
    ),
    resume: str | None = typer.Option(
        None, "--resume", help="'auto' (newest complete checkpoint in output_dir) or a checkpoint dir"
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="start over: remove the run in output_dir (run.json, checkpoints/, final/, metrics.jsonl; "
        "the data/ and models/ caches stay) before the first step; not --force, which elsewhere recomputes a cache",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="validate, plan (models on the meta device, memory) and exit"
    ),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Distill a student from a teacher with DSA + HRA on top of a base loss (DeepSpeed).

    Single process: `mta distill --recipe R`. Several GPUs or nodes: launch the same command with
    `deepspeed --no_local_rank --num_gpus N $(which mta) distill ...` or `torchrun --nproc-per-node N $(which mta)
    distill ...`; the global batch stays train.batch_size. Writes OUT/checkpoints/step-N/,
    OUT/final/ (Hugging Face format) and OUT/metrics.jsonl.

    One run per output_dir: a directory that holds another run's outputs is refused unless
    --resume auto continues that run or --overwrite starts over, and so is a second run while
    one trains into it (a lock naming its pid and host). Ctrl-C exits with code 130 and one line
    naming the last complete checkpoint and the command that resumes from it.

    Signals (Slurm: docs/slurm.md): SIGUSR1 finishes the current step, saves a checkpoint of it,
    prints the line and exits with code 75 (requeue); SIGTERM does the same when the last
    checkpoint's save time fits in 20 s (MTA_SIGTERM_BUDGET_S), else stops at once, and exits
    with code 143 and the line either way.

    Progress: rich bars on a terminal; elsewhere (Slurm, `> log`, CI) one plain line per
    train.log_interval steps. MTA_PROGRESS=plain or MTA_PROGRESS=rich chooses instead. Progress
    and the log go to stderr; the --dry-run plan and the final "done:" line to stdout.
    """
    quiet_third_party(verbose)
    from mta.training.config.catalog import find_recipe
    from mta.training.config.loading import load_recipe

    console = stderr_console()
    overrides = with_output_dir(list(overrides or []), out)
    chosen = find_recipe(recipe)
    if int(os.environ.get("RANK", "0")) == 0:
        shipped = f"shipped {chosen.shipped.name} ({chosen.path})" if chosen.shipped else chosen.path
        console.print(f"recipe: {shipped}", highlight=False, soft_wrap=True)
    loaded = load_recipe(chosen.path, overrides or [])
    if dry_run:
        from mta.training.dry_run import plan_run
        from mta_cli.dry_run_tables import render_plan

        stdout_console().print(render_plan(plan_run(loaded, world_size=int(os.environ.get("WORLD_SIZE", 1)))))
        return
    from mta.reporting import SilentReporter
    from mta.training.lifecycle import run_directory
    from mta.training.lifecycle.stopping import RunStopped
    from mta_cli.reporting import make_reporter

    is_main = int(os.environ.get("RANK", 0)) == 0
    output_dir = loaded.resolve(loaded.output_dir, "output_dir")
    try:
        if is_main:  # a second run into output_dir is refused now, not after the models load
            from mta import tracking

            tracking.require(loaded.train.report_to)  # before the directory is made: nothing left behind
            run_directory.lock(output_dir)
        from mta.training.trainer import run_distillation

        with make_reporter(console) if is_main else contextlib.nullcontext(SilentReporter()) as reporter:
            final = run_distillation(loaded, resume=resume, reporter=reporter, overwrite=overwrite)
    except KeyboardInterrupt:
        if is_main:
            line = interrupted_line(
                output_dir,
                resume_command(recipe, list(overrides or []), verbose=verbose),
            )
            console.print(Text(line, style="yellow"), soft_wrap=True)
        raise typer.Exit(INTERRUPTED) from None
    except RunStopped as stopped:
        if is_main:
            line = stopped_line(
                stopped,
                output_dir,
                resume_command(recipe, list(overrides or []), verbose=verbose),
            )
            console.print(Text(line, style="yellow"), soft_wrap=True)
        raise typer.Exit(stopped_exit_code(stopped)) from None
    finally:
        run_directory.release(output_dir)  # a no-op once the run has released it
    if is_main:
        how = "AutoModelForCausalLM.from_pretrained"
        if loaded.task == "embedding":
            how = (
                "SentenceTransformer"
                + (", trust_remote_code=True" if loaded.student.pooling == "cls_attention" else "")
                + ", or AutoModel.from_pretrained"
            )
        stdout_console().print(f"[green]done:[/] {final}  (load it with {how})", highlight=False, soft_wrap=True)
