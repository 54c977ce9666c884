"""`mta push`: check an exported student, then upload it to the Hub (:mod:`mta.models.push`)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from mta_cli.consoles import stderr_console, stdout_console
from mta_cli.quiet import VERBOSE_HELP, quiet_third_party


def push(
    directory: Path = typer.Argument(..., help="An exported student: OUT/final or OUT/best of `mta distill`."),
    repo_id: str = typer.Argument(..., help="The Hub repository, user/name or org/name (created when missing)."),
    private: bool = typer.Option(False, "--private", help="Create the repository private."),
    revision: str | None = typer.Option(None, "--revision", help="Push to this branch (created when missing)."),
    results: Path | None = typer.Option(
        None,
        "--results",
        help="An `mta evaluate` output that scored DIR: the uploaded card gains its model-index (ROUGE-L per set).",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check and list what would be pushed; send nothing."),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Push a trained student to the Hugging Face Hub, after checking it.

    The directory must match its checksums.sha256 (each file `mta distill` wrote, unchanged) and
    hold a model card whose front matter the Hub reads; otherwise nothing is sent and the
    message names each file. --results EVAL_DIR adds the ROUGE-L that `mta evaluate` measured
    for DIR to the uploaded card's model-index (DIR's own card is left as its checksums say).
    --dry-run prints the files, the repository and the card's metadata. The token comes from the
    usual places (HF_TOKEN, `hf auth login`).

    Example: mta push runs/gpt2-mta/final my-org/gpt2-mta --private --dry-run
    """
    quiet_third_party(verbose)
    from mta.models.push import plan_push
    from mta.models.push import push as upload

    plan = plan_push(directory, repo_id, private=private, revision=revision, results=results)
    table = Table(title=f"push {directory} -> {repo_id}" + (f"@{revision}" if revision else ""))
    table.add_column("file")
    table.add_column("bytes", justify="right")
    for name, size in plan.files.items():
        table.add_row(name, f"{size:,}")
    table.add_row("total", f"{plan.total_bytes:,}")
    out = stdout_console()
    out.print(table)
    card = ", ".join(f"{key}: {value}" for key, value in plan.card.items() if key not in ("tags", "model-index"))
    if "model-index" in plan.card:
        card += f"; model-index: {sum(len(r['metrics']) for r in plan.card['model-index'][0]['results'])} results"
    out.print(
        f"repository: {repo_id} ({'private' if private else 'public'}); card: {card}", highlight=False, soft_wrap=True
    )
    if dry_run:
        out.print("dry run: nothing was sent")
        return
    stderr_console().print(f"uploading {len(plan.files)} files ({plan.total_bytes / 1e6:.1f} MB)")
    out.print(f"pushed: {upload(plan)}", highlight=False, soft_wrap=True)
