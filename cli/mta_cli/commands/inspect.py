"""`mta inspect`: which student layer follows which teacher layer, on held-out rows."""

from __future__ import annotations

from pathlib import Path

import typer

from mta.errors import MtaError
from mta_cli.consoles import stderr_console, stdout_console
from mta_cli.quiet import VERBOSE_HELP, quiet_third_party
from mta_cli.reporting import make_reporter
from mta_cli.results import comparison_table


def parse_layers(text: str) -> list[tuple[int, int, str]]:
    """``"6:24:word,9:36:phrase"`` -> ``[(6, 24, "word"), (9, 36, "phrase")]``."""
    pairs = []
    for item in (part.strip() for part in text.split(",")):
        fields = item.split(":")
        if len(fields) != 3 or fields[2] not in ("word", "phrase"):
            raise MtaError(f"--layers: '{item}' is not STUDENT:TEACHER:word|phrase (e.g. 6:24:word,9:36:phrase)")
        try:
            pairs.append((int(fields[0]), int(fields[1]), fields[2]))
        except ValueError as error:
            raise MtaError(f"--layers: '{item}': the layers must be integers (e.g. 6:24:word)") from error
    return pairs


def inspect(
    models: list[str] = typer.Argument(
        ...,
        help="TEACHER STUDENT [STUDENT ...]: model directories (a run's final/, best/, a checkpoint) or hub "
        "names; with --teacher-cache only the students.",
    ),
    data: Path = typer.Option(..., "--data", help="Annotated held-out rows (`mta annotate` output)."),
    out: Path = typer.Option(
        Path("runs/inspect"), "--out", "-o", help="Output directory: results.json, results.md, cka-*.png."
    ),
    rows: int = typer.Option(200, "--rows", help="The first N rows of --data (half fit the linear map, half measure)."),
    layers: str | None = typer.Option(
        None, "--layers", help="The layer map, STUDENT:TEACHER:word|phrase,... [default: the recipe's]."
    ),
    recipe: str | None = typer.Option(
        None,
        "--recipe",
        help="Take the layer map from this recipe [default: the first student's recipe.yaml, else auto].",
    ),
    teacher_cache: Path | None = typer.Option(
        None,
        "--teacher-cache",
        help="An `mta teacher` split directory (DIR/dev) built from --data: the teacher's layers from it, "
        "without loading the teacher (only the layers it holds).",
    ),
    estimator: str = typer.Option(
        "debiased", "--estimator", help="CKA drawn and used for the suggestion: debiased or biased."
    ),
    tokens_per_row: int = typer.Option(
        64, "--tokens-per-row", help="Most token positions of a row in token-level CKA."
    ),
    include_special: bool = typer.Option(
        False,
        "--include-special",
        help="Keep each row's first position (the attention sink) and special tokens (BOS, EOS, chat markers) "
        "in CKA and the linear fit.",
    ),
    allow_training_rows: bool = typer.Option(
        False, "--allow-training-rows", help="Measure even when --data is a student's training set."
    ),
    names: str | None = typer.Option(None, "--names", help="Comma-separated labels, one per student."),
    batch_size: int = typer.Option(8, "--batch-size", help="Rows per forward pass."),
    dtype: str = typer.Option("fp32", help="fp32, bf16, fp16 or auto."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:1, ..."),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """See the trajectories: which student layer resembles which teacher layer, at each granularity,
    and whether the layer map the recipe uses sits where the similarity is.

    For each student, on the first --rows rows of held-out annotations (rows a student's
    recipe.yaml names as data.train are refused): linear CKA between every student layer and every
    teacher layer (0 = embeddings) on token states (one tokenizer; else boundary spans) and on word
    and phrase spans pooled as MTA pools them, leaving out special tokens and each row's first
    position (the attention sink, an outlier hundreds of times the others' norm), float64 sums
    streamed over the rows, debiased estimator by default; at each aligned pair the agreement of the span
    cosine structure DSA matches and HRA's term after the best linear map fitted on half the rows
    and measured on the other half; and the monotone teacher layers of highest total span CKA,
    as recipe YAML beside the recipe's map.

    Writes OUT/results.md, OUT/cka-GRANULARITY.png (students side by side on one colour scale,
    the difference to the first student, the recipe's map ○ and the suggested one ×) and
    OUT/results.json last (every matrix, the rows, the models' fingerprints, mta's version).

    Example (the demo's teacher and two of its students, on its dev rows): mta inspect
    ~/.cache/mta/models/SmolLM2-135M-Instruct runs/demo/runs/kd/final runs/demo/runs/mta/final
    --data runs/demo/annotations/dev --rows 200 -o runs/inspect

    The table goes to stdout; progress (rows/s, ETA) and the log to stderr.
    """
    quiet_third_party(verbose)
    from mta.inspection.inspect import InspectSettings, inspect_models
    from mta.inspection.layer_map import layer_map_yaml
    from mta.inspection.report import aligned_rows, write_inspection

    if teacher_cache is not None:
        teacher, students = None, models
    elif len(models) < 2:
        raise MtaError("give the teacher and at least one student (or --teacher-cache and the students)")
    else:
        teacher, students = models[0], models[1:]
    settings = InspectSettings(
        rows=rows,
        batch_size=batch_size,
        layers=parse_layers(layers) if layers else None,
        recipe=recipe,
        estimator=estimator,
        tokens_per_row=tokens_per_row,
        include_special=include_special,
        allow_training_rows=allow_training_rows,
        teacher_cache=str(teacher_cache) if teacher_cache is not None else None,
        device=device,
        dtype=dtype,
        names=[n.strip() for n in names.split(",")] if names else None,
    )
    console = stderr_console()
    with make_reporter(console) as reporter:
        results = inspect_models(teacher, students, data, settings, reporter=reporter)
    written = write_inspection(results, out)
    stdout = stdout_console()
    stdout.print(comparison_table("mta inspect: the aligned layer pairs", *aligned_rows(results)))
    for student in results["students"]:
        layer_map = student["layer_map"]
        stdout.print(f"[bold]{student['label']}[/]: the recipe's map", highlight=False)
        stdout.print(layer_map_yaml(layer_map["recipe"], layer_map["recipe_cka"]), markup=False, highlight=False)
        stdout.print(f"[bold]{student['label']}[/]: suggested (monotone, highest total span CKA)", highlight=False)
        stdout.print(layer_map_yaml(layer_map["suggested"], layer_map["suggested_cka"]), markup=False, highlight=False)
    console.print(f"wrote {', '.join(str(path) for path in written.values())}", highlight=False)
