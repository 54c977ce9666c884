"""`mta demo`: the whole pipeline on a real instruction model, in one process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from mta_cli.quiet import VERBOSE_HELP, quiet_third_party
from mta_cli.reporting import make_reporter


def demo(
    quick: bool = typer.Option(False, "--quick", help="fewer steps, 8 rows per set, 1 seed (~2 min with bf16, ~5 in fp32)"),
    out_dir: Path = typer.Option(Path("runs/demo"), "--out", "-o", help="where every stage writes"),
    data_dir: Optional[Path] = typer.Option(
        None, "--data-dir", help="instruction sets (dolly/, self-inst/, ...); default $MTA_DATA_DIR, else ./data"
    ),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Distill SmolLM2-135M-Instruct into a 10-layer student three ways and compare them.

    Converts the teacher (once, into the model cache), prunes it to 10 layers, annotates Dolly
    rows, trains SFT, skew-reverse-KL and skew-reverse-KL + MTA students from the same start,
    evaluates all five models (ROUGE-L and Dolly-dev perplexity) and writes results.md and
    summary.png. Re-running reuses every finished stage; --quick and full overwrite each other.
    """
    quiet_third_party(verbose)  # the demo draws its own bars
    from mta.demo.pipeline import run_demo
    from mta.demo.report import table, write_report
    from mta.demo.settings import DemoSettings

    console = Console(stderr=True)
    settings = DemoSettings.quick() if quick else DemoSettings.full()
    console.print(
        f"[bold]mta demo ({settings.name})[/]: about {settings.estimated_seconds() / 60:.0f} min on a "
        f"2-core CPU; output in {out_dir}/"
    )
    started = time.perf_counter()
    with make_reporter(console) as reporter:
        results = run_demo(settings, out_dir, data_dir=data_dir, reporter=reporter)
    markdown, picture = write_report(results, out_dir, time.perf_counter() - started)

    print_results(f"mta demo ({settings.name})", *table(results), markdown, picture)


def print_results(title: str, header, body, markdown, picture) -> None:
    """A demo's results table on stdout, then where its results.md and picture are (stderr)."""
    rich = Table(title=title)
    for index, column in enumerate(header):
        rich.add_column(column, justify="left" if index == 0 else "right")
    for row in body:
        rich.add_row(*row)
    Console().print(rich)
    Console(stderr=True).print(f"[green]table:[/] {markdown}\n[green]picture:[/] {picture}")
