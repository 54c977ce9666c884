"""`mta evaluate`: ROUGE-L of several checkpoints under the MiniLLM protocol, side by side."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import typer
from rich.logging import RichHandler
from rich.table import Table

from mta.errors import MtaError
from mta_cli.consoles import stderr_console, stdout_console
from mta_cli.options import (
    ENGINE_OPTION,
    REVISION_OPTION,
    SUBSET_OPTION,
    EngineChoice,
    TemplateChoice,
    deprecated_alias,
    parse_fields,
)
from mta_cli.quiet import VERBOSE_HELP, quiet_third_party
from mta_cli.reporting import make_reporter
from mta_cli.results import comparison_table


def rich_table(results: dict) -> Table:
    """The comparison table of results.md (the same cells), for the terminal."""
    from mta.evaluation.report import table_rows

    return comparison_table("ROUGE-L (mean ± std over seeds)", *table_rows(results))


def _csv(value: str, what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise MtaError(f"{what} is empty; give a comma-separated list")
    return items


def evaluate(
    checkpoints: list[str] = typer.Argument(..., help="Model directories (with their tokenizer) or hub names."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory: predictions/, results.json, results.md."),
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="Evaluation sets, as DIR/SET/valid.jsonl. Default: $MTA_DATA_DIR, else ./data."
    ),
    names: str | None = typer.Option(
        None,
        "--names",
        help="Comma-separated labels, one per checkpoint. Default: each run directory's name "
        "(runs/x/final → x), lengthened only where two collide.",
    ),
    benchmarks: str | None = typer.Option(
        None,
        "--benchmarks",
        help="Comma-separated sets [default: dolly,self-inst,vicuna,sinst,uinst; missing ones skipped]; "
        "also another split of one as <set>-<split> (dolly-dev: DIR/dolly/dev.jsonl), JSONL files, "
        "each named by its file stem (dolly,path/to/mine.jsonl), and Hub dataset ids, each named by its "
        "name (acme/qa: qa; --split, --subset, --revision, --field).",
    ),
    engine: EngineChoice = ENGINE_OPTION,
    split: str = typer.Option("test", "--split", help="The split of a Hub dataset id in --benchmarks."),
    subset: str | None = SUBSET_OPTION,
    revision: str | None = REVISION_OPTION,
    field: list[str] | None = typer.Option(
        None, "--field", help="A Hub set's column COLUMN read as row key KEY (KEY=COLUMN, repeatable)."
    ),
    seeds: str = typer.Option("10,20,30,40,50", "--seeds", help="Comma-separated sampling seeds."),
    max_prompt_length: int = typer.Option(256, help="Prompt tokens kept (a longer prompt keeps its first ones)."),
    max_new_tokens: int = typer.Option(256, help="Most tokens generated per row."),
    batch_size: int = typer.Option(16, help="Prompts per generation batch."),
    limit: int | None = typer.Option(None, help="Evaluate only the first N rows of every set (quick runs)."),
    dtype: str = typer.Option(
        "auto", help="auto (bf16 on a GPU or a CPU with bf16 instructions, else fp32), fp32, bf16 or fp16."
    ),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:1, ..."),
    perplexity: str | None = typer.Option(
        None,
        "--perplexity",
        help="Also score teacher-forced perplexity on a set, e.g. dolly-dev (DIR/dolly/dev.jsonl).",
    ),
    perplexity_limit: int | None = typer.Option(None, help="First N rows of the perplexity set."),
    template: TemplateChoice = typer.Option(
        TemplateChoice.alpaca,
        help="How prompts are built from rows: alpaca (the Alpaca prompt for rows "
        "without a 'prompt'), chat (each checkpoint's own chat template), none (each row's 'prompt' as given).",
    ),
    report_to: str | None = typer.Option(
        None,
        "--report-to",
        help="Also send the results to experiment trackers, comma-separated: tensorboard (OUT/tensorboard/), "
        "wandb, mlflow (each: pip install 'mta-distill[NAME]').",
    ),
    task: str = typer.Option(
        "llm",
        "--task",
        help="llm (the default: generation, ROUGE-L) or embedding (sentence encoders: "
        "teacher agreement on held-out texts and the TALAS author's nine tasks: --teacher, "
        "--held-out or --teacher-embeddings, --tasks-dir).",
    ),
    teacher: str | None = typer.Option(
        None, "--teacher", help="--task embedding: the teacher that embeds --held-out's texts."
    ),
    held_out: Path | None = typer.Option(
        None, "--held-out", help="--task embedding: held-out texts (any input `mta embed` reads)."
    ),
    held_out_old: Path | None = typer.Option(None, "--data", hidden=True),  # deprecated: --held-out
    teacher_embeddings: Path | None = typer.Option(
        None,
        "--teacher-embeddings",
        help="--task embedding: an `mta embed` directory of held-out texts (instead of --teacher/--held-out).",
    ),
    pooling: str = typer.Option(
        "auto",
        "--pooling",
        help="--task embedding: auto (each checkpoint's sentence-transformers pooling, else mean), "
        "mean, cls, max, last.",
    ),
    tasks: str | None = typer.Option(
        None, "--tasks", help="--task embedding: comma-separated tasks of the nine [default: all], or none."
    ),
    tasks_dir: Path | None = typer.Option(
        None, "--tasks-dir", help="--task embedding: the author's CSVs (phongdq/TALAS-M-Datasets multi-data/)."
    ),
    max_pairs: int = typer.Option(
        1_000_000, "--max-pairs", help="--task embedding: most text pairs the agreement uses (all pairs when fewer)."
    ),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Sample answers from each checkpoint on Dolly, SelfInst, Vicuna, S-NI and UnNI and compare
    their ROUGE-L (mean ± std over seeds), as in the MiniLLM / DistiLLM papers.

    Sampling follows the protocol (top_k 0, top_p 1.0, temperature 1.0, five seeds); a rerun
    with the same -o reuses every finished predictions file and resumes a half-finished one,
    while the checkpoint's weight, tokenizer and config files are unchanged: they are hashed on
    every run (and checked against the checkpoint's checksums.sha256 when it has one), and
    predictions of other weights at the same path are refused, naming the file that changed.
    Under torchrun each rank generates its share and rank 0 writes the results.

    Example: mta evaluate runs/base/final runs/mta/final -o runs/eval --perplexity dolly-dev
    (rows labelled base and mta: each run directory's name, unless --names).

    With --task embedding the checkpoints are sentence encoders: teacher agreement on held-out
    texts (--teacher T --held-out FILE, or --teacher-embeddings DIR from `mta embed`: Spearman of
    the pairwise cosines, nearest-neighbour recall@k) and the TALAS author's nine tasks
    (--tasks-dir: his CSVs; unreachable ones are listed with the reason), into the same
    results.json and results.md. Example: mta evaluate --task embedding runs/talas/final
    --teacher-embeddings runs/emb/dev -o runs/eval-embed

    The results table and the final line go to stdout; progress and the log to stderr.
    """
    quiet_third_party(verbose)  # our bars only: no per-checkpoint weight-loading bar
    held_out = deprecated_alias(held_out, held_out_old, old="--data", new="--held-out")
    if task == "embedding":
        from mta_cli.commands.evaluate_embedding import evaluate_embedding

        return evaluate_embedding(
            checkpoints,
            out=out,
            names=_csv(names, "--names") if names is not None else None,
            teacher=teacher,
            data=held_out,
            teacher_embeddings=teacher_embeddings,
            pooling=pooling,
            tasks=_csv(tasks, "--tasks") if tasks is not None else None,
            tasks_dir=tasks_dir,
            max_pairs=max_pairs,
            batch_size=batch_size,
            limit=limit,
            dtype=dtype,
            device=device,
        )
    if task != "llm":
        raise MtaError(f"--task '{task}': choose llm or embedding")
    from mta.evaluation import EvalSettings, evaluate_checkpoints

    console = stderr_console()  # progress and the log; the table and the final line: stdout
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
            template=template.value,
            engine=engine.value,
            split=split,
            subset=subset,
            revision=revision,
            fields=parse_fields(field) or {},
        )
    except ValueError as error:  # pydantic's ValidationError names the option and the bound
        raise MtaError(f"invalid option: {error}") from error
    with make_reporter(console) as reporter:
        results = evaluate_checkpoints(
            checkpoints,
            names=_csv(names, "--names") if names is not None else None,
            data_dir=data_dir,
            out_dir=out,
            settings=settings,
            reporter=reporter,
            report_to=_csv(report_to, "--report-to") if report_to is not None else (),
        )
    if int(os.environ.get("RANK", 0)) == 0:
        stdout_console().print(rich_table(results))
        stdout_console().print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
