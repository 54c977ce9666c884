"""`mta demo`: the whole pipeline on a real instruction model, in one process."""

from __future__ import annotations

from pathlib import Path

import typer

from mta_cli.quiet import VERBOSE_HELP, quiet_third_party
from mta_cli.results import run_demo_command


def demo(
    quick: bool = typer.Option(
        False, "--quick", help="fewer steps, 8 rows per set, 1 seed (~2 min with bf16, ~5 in fp32)"
    ),
    out_dir: Path = typer.Option(Path("runs/demo"), "--out", "-o", help="where every stage writes"),
    data_dir: Path | None = typer.Option(
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

    settings = DemoSettings.quick() if quick else DemoSettings.full()
    run_demo_command(
        f"mta demo ({settings.name})",
        settings.estimated_seconds(),
        out_dir,
        lambda reporter: run_demo(settings, out_dir, data_dir=data_dir, reporter=reporter),
        write_report,
        table,
    )
