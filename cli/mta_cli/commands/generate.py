"""`mta generate`: DistiLLM-2's pairs, a teacher (chosen) and a student (rejected) response per prompt."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from mta.errors import MtaError
from mta_cli.consoles import stderr_console, stdout_console
from mta_cli.options import (
    ENGINE_OPTION,
    REVISION_OPTION,
    SPLIT_OPTION,
    SUBSET_OPTION,
    EngineChoice,
    OnError,
    deprecated_alias,
    parse_fields,
)
from mta_cli.quiet import VERBOSE_HELP, quiet_third_party
from mta_cli.reporting import make_reporter

# The library's defaults (mta.pairs.generate.PairSettings), spelled out so --help needs no torch.
TEMPERATURE, TOP_P, TOP_K = 0.8, 0.95, 0
MAX_NEW_TOKENS, MAX_PROMPT_LENGTH, BATCH_SIZE, SEED = 256, 256, 16, 42


def generate(
    teacher: str = typer.Option(..., "--teacher", help="Teacher model directory (with its tokenizer) or hub name."),
    student: str = typer.Option(..., "--student", help="Student model directory (with its tokenizer) or hub name."),
    data: str | None = typer.Argument(
        None,
        help="Prompts: MiniLLM (instruction/input/output), Dolly or prompt/response rows, as a JSONL, "
        "Parquet or CSV file, a datasets save_to_disk directory or a Hub dataset id (owner/name).",
        show_default=False,
    ),
    data_old: str | None = typer.Option(None, "--data", hidden=True),  # deprecated: DATA, as in annotate
    engine: EngineChoice = ENGINE_OPTION,
    split: str | None = SPLIT_OPTION,
    subset: str | None = SUBSET_OPTION,
    revision: str | None = REVISION_OPTION,
    field: list[str] | None = typer.Option(
        None, "--field", help="Read input column COLUMN as format key KEY (KEY=COLUMN, repeatable)."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Output JSONL: id, prompt, chosen, rejected per row."),
    temperature: float = typer.Option(TEMPERATURE, help="Sampling temperature (0: greedy)."),
    top_p: float = typer.Option(TOP_P, help="Nucleus sampling: smallest set of tokens reaching this mass (1.0: off)."),
    top_k: int = typer.Option(TOP_K, help="Only the k most likely tokens (0: no limit)."),
    max_new_tokens: int = typer.Option(MAX_NEW_TOKENS, help="Most tokens per response, its stop token included."),
    max_prompt_length: int = typer.Option(
        MAX_PROMPT_LENGTH, help="Prompt tokens kept, per model's tokenizer (a longer prompt keeps its first ones)."
    ),
    batch_size: int = typer.Option(BATCH_SIZE, help="Prompts per generation batch."),
    seed: int = typer.Option(SEED, help="Sampling seed; each row's noise is keyed by (seed, side, row id)."),
    limit: int | None = typer.Option(None, help="Only the first N input rows (quick runs)."),
    dtype: str = typer.Option(
        "auto", help="auto (bf16 on a GPU or a CPU with bf16 instructions, else fp32), fp32, bf16 or fp16."
    ),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:1, ..."),
    on_error: OnError = typer.Option(OnError.fail, help="Stop at a bad input row, or skip and count it."),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace an existing output file (and an unfinished journal of other settings): "
        "removes another run's output, unlike --force elsewhere, which recomputes a cache.",
    ),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Sample one response per prompt from the teacher (chosen) and one from the student
    (rejected), the training pairs of DistiLLM-2.

    Writes OUT as JSONL, one row per input row in input order: {"id", "prompt", "chosen",
    "rejected"}. Sampling defaults to DistiLLM-2's (temperature 0.8, top_p 0.95, top_k 0);
    row r's noise is keyed by sampling_seed(seed, "generate/teacher" or "generate/student", 0,
    r), so batching, ranks and resuming do not change a row. Finished responses are journalled
    in OUT.journal/ as they come: a killed run resumes when the same command is run again, and
    a journal of other settings is refused. An existing OUT is kept unless --overwrite. Under
    torchrun the rows are split over the ranks (each holds both models in turn) and rank 0
    writes OUT.

    Example: mta generate prompts.jsonl --teacher T --student S -o pairs.jsonl (the final line
    on stdout, progress on stderr).
    """
    quiet_third_party(verbose)  # our bars only: no weight-loading bar
    data = deprecated_alias(data, data_old, old="--data", new="DATA (the first argument)")
    if data is None:
        raise MtaError("give DATA, the prompts (a JSONL file or a Hub dataset id)")
    from mta.data.sources import input_reference
    from mta.pairs.generate import PairSettings, generate_pairs

    source = input_reference(data, split=split, subset=subset, revision=revision)
    settings = PairSettings(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        max_prompt_length=max_prompt_length,
        batch_size=batch_size,
        seed=seed,
        limit=limit,
        dtype=dtype,
        device=device,
        on_error=on_error.value,
        overwrite=overwrite,
        fields=parse_fields(field) or {},
        engine=engine.value,
    )
    console = stderr_console()
    with make_reporter(console) as reporter:
        outcome = generate_pairs(teacher, student, source, out, settings, reporter)
    if int(os.environ.get("RANK", 0)) != 0:
        return
    for side in ("teacher", "student"):
        if outcome.prompts_truncated.get(side):
            console.print(
                f"[yellow]{outcome.prompts_truncated[side]} prompt(s) exceed {max_prompt_length} {side} tokens "
                f"and keep their first {max_prompt_length}[/]",
                highlight=False,
            )
    skipped = f", {outcome.skipped} bad row(s) skipped" if outcome.skipped else ""
    stdout_console().print(f"wrote {outcome.rows} pairs to {outcome.path}{skipped}", highlight=False)
