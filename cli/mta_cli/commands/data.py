"""`mta data ...`: fetch the evaluation sets."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from mta_cli.consoles import stdout_console
from mta_cli.quiet import VERBOSE_HELP, quiet_third_party

app = typer.Typer(help="Fetch the evaluation sets.", no_args_is_help=True)


@app.command("download")
def download(
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="Where the sets go, as DIR/SET/valid.jsonl. Default: $MTA_DATA_DIR, else ./data."
    ),
    sets: str = typer.Option("dolly,self-inst,vicuna,sinst,uinst", "--sets", help="Comma-separated sets."),
    force: bool = typer.Option(False, "--force", help="Download again even where the set's file exists."),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Download the MiniLLM evaluation sets (Dolly, SelfInst, Vicuna, S-NI, UnNI) from the
    Hugging Face Hub into the layout `mta evaluate` reads. Needs network access."""
    quiet_third_party(verbose)
    from mta.evaluation.datasets import default_data_dir
    from mta.evaluation.download import download_sets

    target = data_dir if data_dir is not None else default_data_dir()
    files = download_sets(target, [s.strip() for s in sets.split(",") if s.strip()], force=force)
    table = Table(title=f"evaluation sets in {target}")
    table.add_column("set")
    table.add_column("file")
    for name, path in files.items():
        table.add_row(name, str(path))
    stdout_console().print(table)
