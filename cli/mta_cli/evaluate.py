"""`mta evaluate`: ROUGE-L of several checkpoints under the MiniLLM protocol, side by side."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from mta.errors import MtaError


class _RatesColumn(ProgressColumn):
    """rows/s and generated tokens/s of the running task."""

    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        if elapsed <= 0:
            return Text("")
        tokens = task.fields.get("tokens", 0)
        return Text(f"{task.completed / elapsed:.2f} rows/s · {tokens / elapsed:.0f} tok/s", style="cyan")


class RichProgress:
    """The library's ``Progress`` as rich bars, one per (checkpoint, set, seed); use it as a
    context manager around the whole run so the bars share one live display."""

    def __init__(self, console: Console):
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            _RatesColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        self._task = None

    def __enter__(self) -> "RichProgress":
        self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.stop()

    def start(self, description: str, total_rows: int) -> None:
        self._task = self._bar.add_task(description, total=total_rows, tokens=0)

    def advance(self, rows: int, tokens: int) -> None:
        task = self._bar.tasks[self._task]
        self._bar.update(self._task, advance=rows, tokens=task.fields["tokens"] + tokens)

    def stop(self) -> None:
        self._bar.stop_task(self._task)


def _csv(value: str, what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise MtaError(f"{what} is empty; give a comma-separated list")
    return items


def evaluate(
    checkpoints: List[str] = typer.Argument(..., help="Model directories (with their tokenizer) or hub names."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory: predictions/, results.json, results.md."),
    data_dir: Optional[Path] = typer.Option(
        None, "--data-dir", help="Evaluation sets, as DIR/SET/valid.jsonl. Default: $MTA_DATA_DIR, else ./data."
    ),
    names: Optional[str] = typer.Option(
        None, "--names", help="Comma-separated labels, one per checkpoint. Default: derived from each whole path."
    ),
    benchmarks: Optional[str] = typer.Option(
        None, "--benchmarks", help="Comma-separated sets [default: dolly,self-inst,vicuna,sinst,uinst; missing ones skipped]."
    ),
    seeds: str = typer.Option("10,20,30,40,50", "--seeds", help="Comma-separated sampling seeds."),
    max_prompt_length: int = typer.Option(256, help="Prompt tokens kept (a longer prompt keeps its first ones)."),
    max_new_tokens: int = typer.Option(256, help="Most tokens generated per row."),
    batch_size: int = typer.Option(16, help="Prompts per generation batch."),
    limit: Optional[int] = typer.Option(None, help="Evaluate only the first N rows of every set (quick runs)."),
    dtype: str = typer.Option("auto", help="auto (bf16 on GPU, fp32 on CPU), fp32, bf16 or fp16."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:1, ..."),
    perplexity: Optional[str] = typer.Option(
        None, "--perplexity", help="Also score teacher-forced perplexity on a set, e.g. dolly-dev (DIR/dolly/dev.jsonl)."
    ),
    perplexity_limit: Optional[int] = typer.Option(None, help="First N rows of the perplexity set."),
) -> None:
    """Sample answers from each checkpoint on Dolly, SelfInst, Vicuna, S-NI and UnNI and compare
    their ROUGE-L (mean ± std over seeds), as in the MiniLLM / DistiLLM papers.

    Sampling follows the protocol (top_k 0, top_p 1.0, temperature 1.0, five seeds); a rerun
    with the same -o reuses every finished predictions file and resumes a half-finished one.
    Under torchrun each rank generates its share and rank 0 writes the results.
    """
    from mta.evaluation import EvalSettings, evaluate_checkpoints
    from mta.evaluation.report import rich_table

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # our bars only: no per-checkpoint weight-loading bar
    console = Console()
    logger = logging.getLogger("mta.evaluation")
    if not logger.handlers:
        logger.addHandler(RichHandler(console=console, show_time=False, show_path=False))
        logger.setLevel(logging.INFO)
        logger.propagate = False  # other libraries configure the root logger; print once
    try:
        seed_list = [int(s) for s in _csv(seeds, "--seeds")]
    except ValueError as error:
        raise MtaError(f"--seeds must be integers separated by commas, got '{seeds}'") from error
    try:
        settings = EvalSettings(
            benchmarks=_csv(benchmarks, "--benchmarks") if benchmarks is not None else None,
            seeds=seed_list,
            max_prompt_length=max_prompt_length,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            limit=limit,
            dtype=dtype,
            device=device,
            perplexity=perplexity,
            perplexity_limit=perplexity_limit,
        )
    except ValueError as error:  # pydantic's ValidationError names the option and the bound
        raise MtaError(f"invalid option: {error}") from error
    with RichProgress(console) as progress:
        results = evaluate_checkpoints(
            checkpoints,
            names=_csv(names, "--names") if names is not None else None,
            data_dir=data_dir,
            out_dir=out,
            settings=settings,
            progress=progress,
        )
    if int(os.environ.get("RANK", 0)) == 0:
        console.print(rich_table(results))
        console.print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
