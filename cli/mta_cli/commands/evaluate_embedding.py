"""`mta evaluate --task embedding`: parse the embedding options, run the library, draw the table."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from mta_cli.consoles import stderr_console, stdout_console
from mta_cli.reporting import make_reporter
from mta_cli.results import comparison_table


def rich_table(results: dict) -> Table:
    """The comparison table of results.md (the same cells), for the terminal."""
    from mta.embedding.evaluation import table_rows

    return comparison_table("embedding evaluation", *table_rows(results))


def evaluate_embedding(
    checkpoints: Sequence[str],
    *,
    out: Path,
    names: list[str] | None,
    teacher: str | None,
    data: Path | None,
    teacher_embeddings: Path | None,
    pooling: str,
    tasks: list[str] | None,
    tasks_dir: Path | None,
    max_pairs: int,
    batch_size: int,
    limit: int | None,
    dtype: str,
    device: str,
) -> None:
    """Teacher agreement and the nine tasks of each encoder checkpoint (see
    :mod:`mta.embedding.evaluation`); writes OUT/results.json and OUT/results.md."""
    from mta.embedding.evaluation import EmbeddingEvalSettings, evaluate_embedding_checkpoints

    console = stdout_console()
    settings = EmbeddingEvalSettings(
        pooling=pooling,
        batch_size=batch_size,
        dtype=dtype,
        device=device,
        max_pairs=max_pairs,
        tasks=tuple(tasks) if tasks is not None else None,
        tasks_dir=str(tasks_dir) if tasks_dir else None,
        limit=limit,
    )
    with make_reporter(stderr_console()) as reporter:
        results = evaluate_embedding_checkpoints(
            checkpoints,
            out_dir=out,
            names=names,
            teacher=teacher,
            data=data,
            teacher_embeddings=teacher_embeddings,
            settings=settings,
            reporter=reporter,
        )
    if int(os.environ.get("RANK", 0)) == 0:
        console.print(rich_table(results))
        from mta.embedding.evaluation import unavailable_tasks

        for reason, titles in unavailable_tasks(results).items():
            console.print(f"[yellow]not run:[/] {', '.join(titles)}: {reason}", highlight=False)
        console.print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
