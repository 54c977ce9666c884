"""`mta teacher`: parse arguments, run :func:`mta.training.teacher_cache.teacher.run_teacher_stage`, report."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.table import Table

from mta.errors import MtaError
from mta_cli.consoles import stderr_console, stdout_console
from mta_cli.options import parse_shard
from mta_cli.quiet import VERBOSE_HELP, quiet_third_party
from mta_cli.reporting import make_reporter


def teacher(
    recipe: str = typer.Option(
        ...,
        "--recipe",
        "-r",
        show_default=False,
        help="recipe YAML file, or the name of a shipped recipe (`mta recipes list`)",
    ),
    overrides: list[str] | None = typer.Argument(
        None, help="key=value overrides, as `mta distill` takes them", show_default=False
    ),
    out_dir: Path | None = typer.Option(
        None, "-o", "--out", help="Output directory [default: the recipe's teacher_cache.dir]."
    ),
    batch_size: int | None = typer.Option(
        None, help="Rows per teacher forward (length-sorted) [default: train.micro_batch_size]."
    ),
    shard: str | None = typer.Option(
        None,
        help="Run the teacher on every N-th row starting at row I (I/N), for array jobs [default: "
        "under torchrun, this rank's share].",
    ),
    force: bool = typer.Option(False, "--force", help="Recompute even if a matching cache exists."),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Run the recipe's teacher once over its annotated train and dev rows and store what the
    losses read from it, so `mta distill` with teacher_cache.dir trains without running it.

    Per row: the hidden states of the aligned teacher layers (MTA's DSA and HRA, SRA) at every
    token, and with a logit base loss the teacher's top-k next tokens at each response position
    with their log-probabilities and the tail's mass (teacher_cache.top_k, teacher_cache.storage), or
    with teacher_cache.logits=sampled a head of top_k and teacher_cache.samples tokens drawn from the
    rest (every base loss estimated without bias); teacher_cache.states=int8_token|int8_channel keeps
    the states in 8 bits. The table reports the bytes on disk per response position and per token.
    Writes OUT/train and OUT/dev (Parquet parts + .mta/manifest.json, written last, naming the
    teacher's weights, the annotated rows, the layers, k, τ and the precision). A killed run
    resumes where it stopped when the same command runs again; a finished cache that matches is
    reused unless --force. Under torchrun every rank computes its share. `mta distill --dry-run`
    estimates the size first. FDD cannot train from a cache (the recipe is refused, naming why).

    Example: mta teacher --recipe tiny teacher_cache.dir=runs/tiny/teacher
    """
    quiet_third_party(verbose)
    from mta.training.config.catalog import find_recipe
    from mta.training.config.loading import load_recipe
    from mta.training.teacher_cache.content import stored_per_token
    from mta.training.teacher_cache.teacher import cache_directory, run_teacher_stage

    console = stderr_console()
    shard_spec = parse_shard(shard) if shard else None
    if batch_size is not None and batch_size < 1:
        raise MtaError(f"--batch-size must be at least 1, got {batch_size}")
    loaded = load_recipe(find_recipe(recipe).path, overrides or [])
    root = cache_directory(loaded, out_dir)
    is_main = int(os.environ.get("RANK", "0")) == 0
    with make_reporter(console) as reporter:
        outcomes = run_teacher_stage(
            loaded, out_dir=root, shard=shard_spec, batch_size=batch_size, reporter=reporter, force=force
        )
    if not is_main:
        return
    table = Table(title="teacher")
    numbers = ("rows", "computed", "logits B/response", "states B/token")
    for column in ("split", "rows", "computed", "layers", "logits", "storage", *numbers[2:], "directory"):
        table.add_column(column, justify="right" if column in numbers else "left")
    for outcome in outcomes:
        manifest = outcome.manifest or {}
        rows = manifest.get("rows", {}).get("written", "-") if manifest else "(other shards missing)"
        computed = "reused" if outcome.reused else str(outcome.rows)
        per_token = stored_per_token(manifest)
        table.add_row(
            outcome.split,
            str(rows),
            computed,
            ", ".join(map(str, manifest.get("layers", []))) or "-",
            _logits(manifest),
            f"{manifest.get('storage', '-')}, states {manifest.get('states', 'storage')}",
            *(f"{per_token[part]:,.0f}" if per_token else "-" for part in ("logits", "states")),
            str(outcome.directory),
        )
    out = stdout_console()
    out.print(table)
    waiting = [outcome.split for outcome in outcomes if outcome.manifest is None]
    if waiting:
        count = shard_spec[1] if shard_spec else "N"
        out.print(
            f"wrote this shard of {root}; {', '.join(waiting)} is not complete until every shard is written: run "
            f"the others (--shard I/{count}; the last one writes the manifest), then train with "
            f"teacher_cache.dir={root}",
            highlight=False,
            soft_wrap=True,
        )
    else:
        out.print(f"wrote {root}; train from it with teacher_cache.dir={root}", highlight=False, soft_wrap=True)


def _logits(manifest: dict) -> str:
    """What the cache keeps of the logits: ``top 1024``, ``top 32 + 64 draws``, or ``-``."""
    if not manifest.get("top_k") and not manifest.get("sampling"):
        return "-"
    sampling = manifest.get("sampling")
    return f"top {manifest.get('top_k')}" + (f" + {sampling['samples']} draws" if sampling else "")
