"""`mta embed`: parse arguments, run :func:`mta.embedding.embed.run_embed`, report."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from mta.errors import MtaError
from mta_cli.consoles import stderr_console, stdout_console
from mta_cli.options import FORCE_CACHE_OPTION, OnError, parse_shard
from mta_cli.quiet import VERBOSE_HELP, quiet_third_party
from mta_cli.reporting import make_reporter


class PoolingChoice(str, Enum):  # mta.embedding.pooling: AUTO + POOLINGS
    auto = "auto"
    mean = "mean"
    cls = "cls"
    max = "max"
    last = "last"


def embed(
    data: Path = typer.Argument(
        ...,
        help="Texts: JSONL, Parquet or CSV rows (or a datasets save_to_disk directory) with a 'text' "
        "field, or instruction rows (MiniLLM, Dolly: instruction + input/context + response), or prompt/response rows.",
    ),
    teacher: str = typer.Option(
        ..., "--teacher", help="Teacher encoder: a Hugging Face or sentence-transformers directory, or a hub name."
    ),
    out_dir: Path = typer.Option(..., "-o", "--out", help="Output directory (Parquet parts + .mta/manifest.json)."),
    pooling: PoolingChoice = typer.Option(
        PoolingChoice.auto,
        help="auto: a sentence-transformers directory's own pooling and Normalize "
        "(mean for a plain encoder); or mean, cls, max, last (the last real token).",
    ),
    normalize: bool | None = typer.Option(
        None, "--normalize/--no-normalize", help="L2-normalise the vectors [default: as the teacher's config says]."
    ),
    max_length: int | None = typer.Option(
        None, help="Tokens per text, special ones included [default: the teacher's max_seq_length, else 256]."
    ),
    batch_size: int = typer.Option(64, help="Texts per forward pass (batches are length-sorted)."),
    dtype: str = typer.Option(
        "auto",
        help="auto (bf16 where the device computes it natively, else fp32), fp32, bf16 or fp16; "
        "vectors are stored as float32.",
    ),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:1, ..."),
    text_field: str | None = typer.Option(None, help="Embed this column as the text (instead of the rule above)."),
    on_error: OnError = typer.Option(OnError.fail, help="Stop at a row without a text, or skip and count it."),
    shard: str | None = typer.Option(
        None,
        help="Embed every N-th row starting at row I (I/N), for array jobs [default: under torchrun, "
        "this rank's share].",
    ),
    force: bool = FORCE_CACHE_OPTION,
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Compute a teacher's sentence embedding of every text of DATA, once, for TALAS distillation.

    Writes one row per text into OUT (id, text, embedding as float32; pandas, pyarrow and
    datasets read OUT as one table) and OUT/.mta/manifest.json, written last, naming the
    teacher (and its fingerprint), its pooling, the max length, the precision and the input's
    sha256. Batches are sorted by length. A killed run resumes where it stopped when the same
    command is run again (finished chunks are journalled, none is computed or written twice);
    a finished artefact with the same input and settings is reused unless --force. Under
    torchrun every rank embeds its share and the last one writes the manifest.

    Example: mta embed train.jsonl --teacher ~/.cache/mta/models/all-mpnet-base-v2 -o runs/emb/train
    """
    quiet_third_party(verbose)
    from mta.embedding.embed import run_embed

    console = stderr_console()
    shard_spec = parse_shard(shard) if shard else None
    if batch_size < 1:
        raise MtaError(f"--batch-size must be at least 1, got {batch_size}")
    with make_reporter(console) as reporter:
        outcome = run_embed(
            teacher,
            data,
            out_dir,
            pooling=pooling.value,
            normalize=normalize,
            max_length=max_length,
            batch_size=batch_size,
            dtype=dtype,
            device=device,
            text_field=text_field,
            on_error=on_error.value,
            reporter=reporter,
            shard=shard_spec,
            force=force,
        )
    if outcome.reused:
        console.print(f"reused {out_dir} (same teacher, input and settings; --force recomputes)")
    if outcome.manifest is None:
        console.print("this shard is written; .mta/manifest.json appears when every shard of the set is")
        return
    _print_summary(stdout_console(), outcome.manifest)  # the summary and the final line: stdout
    stdout_console().print(f"wrote {out_dir}")


def _print_summary(console: Console, manifest: dict) -> None:
    table = Table(title="embed")
    table.add_column("", justify="left")
    table.add_column("", justify="right")
    rows = manifest["rows"]
    teacher = manifest["teacher"]
    for key, value in (
        ("texts read", rows.get("read")),
        ("texts embedded", rows.get("written")),
        ("skipped", rows.get("skipped")),
        ("cut at max length", rows.get("truncated")),
        ("teacher", teacher.get("name")),
        (
            "pooling",
            "{mode}{norm}".format(
                mode=manifest["pooling"]["mode"], norm=" + normalize" if manifest["pooling"]["normalize"] else ""
            ),
        ),
        ("dimension", manifest["dimension"]),
        ("max length", manifest["max_length"]),
        ("precision", manifest["precision"]),
    ):
        table.add_row(key, str(value))
    for reason, count in sorted(manifest.get("skipped", {}).items()):
        table.add_row(f"  skipped: {reason}", str(count))
    console.print(table)
