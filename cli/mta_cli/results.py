"""A stage's results on the terminal: the cells the library writes into ``results.md``, as rich tables.

- :func:`comparison_table`: an evaluation's comparison (``mta evaluate``, ``--task embedding``);
- :func:`run_demo_command`: what every demo command does (``mta demo``, ``mta demo-embed``):
  announce, run with progress, write the report, then :func:`print_results`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from mta_cli.consoles import stderr_console, stdout_console
from mta_cli.exit_codes import INTERRUPTED, stopped_exit_code
from mta_cli.reporting import make_reporter

Cells = tuple[list[str], list[list[str]]]  # header, body


def comparison_table(title: str, header: Sequence[str], body: Sequence[Sequence[str]]) -> Table:
    """Checkpoints as rows: the first column folds, the numbers are right-aligned and never wrap."""
    table = Table(title=title)
    for i, column in enumerate(header):
        if i == 0:
            table.add_column(column, overflow="fold", min_width=12)
        else:
            table.add_column(column, justify="right", no_wrap=True)
    for row in body:
        table.add_row(*row)
    return table


def print_results(title: str, header, body, markdown, picture) -> None:
    """A demo's results table on stdout, then where its results.md and picture are (stderr)."""
    rich = Table(title=title)
    for index, column in enumerate(header):
        rich.add_column(column, justify="left" if index == 0 else "right")
    for row in body:
        rich.add_row(*row)
    stdout_console().print(rich)
    stderr_console().print(f"[green]table:[/] {markdown}\n[green]picture:[/] {picture}")


def run_demo_command(
    title: str,
    estimated_seconds: float,
    out_dir: Path,
    run: Callable[[Any], dict],
    write_report: Callable[[dict, Path, float], tuple[Path, Path]],
    table: Callable[[dict], Cells],
) -> None:
    """Say what runs and for about how long, ``run(reporter)`` it with progress on stderr, write
    its report into ``out_dir`` and print its table. Ctrl-C or a stopping signal ends it with one
    line (what was saved, how to continue) and the exit code ``mta distill`` gives."""
    console = stderr_console()
    console.print(
        f"[bold]{title}[/]: estimated {estimated_seconds / 60:.0f} min on a 2-core CPU; output in {out_dir}/",
        soft_wrap=True,
    )
    from mta.training.lifecycle.stopping import RunStopped

    started = time.perf_counter()
    continue_hint = f"every finished stage is kept in {out_dir}/: run the same command again to continue"
    try:
        with make_reporter(console) as reporter:
            results = run(reporter)
    except KeyboardInterrupt:
        console.print(Text(f"interrupted: {continue_hint}", style="yellow"), soft_wrap=True)
        raise typer.Exit(INTERRUPTED) from None
    except RunStopped as stopped:
        saved = (
            f"saved {stopped.checkpoint}" if stopped.checkpoint is not None else f"without saving ({stopped.reason})"
        )
        when = f"after step {stopped.step}" if stopped.step is not None else "before its first step"
        line = f"stopped by {stopped.signal_name} {when}: {saved}; {continue_hint}"
        console.print(Text(line, style="yellow"), soft_wrap=True)
        raise typer.Exit(stopped_exit_code(stopped)) from None
    markdown, picture = write_report(results, out_dir, time.perf_counter() - started)
    print_results(title, *table(results), markdown, picture)
