"""The recipe's ``data.train`` / ``data.dev`` as annotate artefacts checked against the run.

A JSONL, Parquet or CSV file or a ``datasets`` save_to_disk directory (its columns read through
``data.fields``: :mod:`mta.data.sources`) is annotated on first use (through
``mta.data.annotate.annotate_file``, the code behind ``mta annotate``) into
``OUTPUT_DIR/data/<split>``, reused while its input and settings are unchanged. A directory is
read as it is. Either way the artefact must have been built for the recipe's tokenizers, lengths,
prompt template (``data.template``; an artefact that records none was built with ``alpaca``; for
``chat`` also the student tokenizer's chat template, by its sha256) and span rule
(``data.span_rule``; none recorded: ``paper``), or the run stops and names the command that
rebuilds it.
"""

from __future__ import annotations

from pathlib import Path

from mta.data.annotations import Annotations, read_annotations
from mta.data.prompts import ChatTemplate, recorded_template
from mta.errors import MtaError
from mta.reporting import Reporter
from mta.training.config.schema import Recipe


def load_split(
    recipe: Recipe,
    split: str,
    *,
    teacher_tokenizer: str,
    student_tokenizer: str,
    fingerprints: dict[str, str],
    reporter: Reporter | None = None,
) -> Annotations | None:
    """The checked artefact for ``data.<split>`` (None when the recipe has no such split).
    A Hub dataset id reads ``data.train_split`` / ``data.dev_split``, ``data.subset`` and
    ``data.revision``.

    teacher_tokenizer / student_tokenizer: directories or names the tokenizers load from (for
    SFT both are the student's). fingerprints: ``{"teacher": ..., "student": ...}`` of the
    tokenizers the run loaded.
    """
    written = getattr(recipe.data, split)
    if written is None:
        return None
    key = f"data.{split}"
    from mta.data.sources import HubDataset, is_dataset_directory
    from mta.models.hub import is_dataset_id

    local = recipe.resolve(written, key)
    source: Path | HubDataset = local
    if not local.exists() and is_dataset_id(written):  # a local path of that spelling wins
        hub_split = recipe.data.train_split if split == "train" else recipe.data.dev_split
        source = HubDataset(written, hub_split, recipe.data.subset, recipe.data.revision)
    if isinstance(source, HubDataset) or source.is_file() or is_dataset_directory(source):
        # rows: JSONL, Parquet, CSV, save_to_disk, a Hub dataset
        from mta.data.annotate import AnnotateSettings, annotate_file

        # The tokenizers are the ones the models were loaded with (a `tiny:` model's is built
        # under output_dir), the rest comes from the recipe's data section.
        settings = AnnotateSettings.from_recipe(recipe, teacher=teacher_tokenizer, student=student_tokenizer)
        cache = recipe.resolve(recipe.output_dir, "output_dir") / "data" / split
        # `mta distill` has no --on-error: a bad row is fixed, or skipped by annotating apart.
        skip_hint = (
            f"annotate the rows apart, skipping and counting bad ones: `mta annotate {written} --recipe RECIPE "
            f"--on-error skip -o DIR`, then train on {key}=DIR"
        )
        annotate_file(source, cache, settings, reporter=reporter, skip_hint=skip_hint)
        directory = cache
    elif source.is_dir():
        directory = source
    else:
        raise MtaError(
            f"{key}: {source} does not exist: give an annotate output directory, a JSONL, Parquet "
            "or CSV file, a datasets save_to_disk directory, or a Hugging Face Hub dataset id (owner/name)"
        )
    annotations = read_annotations(directory)
    check_manifest(annotations, recipe, key, teacher_tokenizer, student_tokenizer, fingerprints)
    return annotations


def check_manifest(
    annotations: Annotations,
    recipe: Recipe,
    key: str,
    teacher_tokenizer: str,
    student_tokenizer: str,
    fingerprints: dict[str, str],
) -> None:
    """Refuse an artefact built for other tokenizers, other length limits, another prompt
    template or another span rule (``data.span_rule``), naming a command that builds a fitting
    one into a new directory (the existing one is left as it is)."""
    manifest = annotations.manifest
    problems = []
    for side, tokenizer in (("teacher", teacher_tokenizer), ("student", student_tokenizer)):
        built = manifest.get(side) or {}
        if built.get("fingerprint") != fingerprints[side]:
            problems.append(
                f"its {side} tokenizer is '{built.get('name', '?')}' ({_short(built.get('fingerprint'))}) "
                f"but the recipe's is '{tokenizer}' ({_short(fingerprints[side])})"
            )
    for length in ("max_length", "max_prompt_length"):
        wanted = getattr(recipe.data, length)
        if manifest.get(length) != wanted:
            problems.append(f"its {length} is {manifest.get(length)} but data.{length} is {wanted}")
    problems += _template_problems(manifest, recipe.data.template, student_tokenizer)
    built_rule = manifest.get("span_rule", "paper")  # an artefact that records none: the paper's rule
    if built_rule != recipe.data.span_rule:
        problems.append(f"its span rule is {built_rule} but data.span_rule is {recipe.data.span_rule}")
    if problems:
        raise MtaError(
            f"{key}: the annotations in {annotations.directory} do not fit this recipe: "
            + "; ".join(problems)
            + ". "
            + _rebuild_hint(annotations, recipe, key, teacher_tokenizer, student_tokenizer)
        )


def _template_problems(manifest: dict, wanted: str, student_tokenizer: str) -> list[str]:
    """Whether the artefact's prompts were built as ``data.template`` builds them now."""
    built = recorded_template(manifest)
    if built.get("name") != wanted:
        recorded = "records none, so alpaca" if "template" not in manifest else f"is {built.get('name')}"
        return [f"its prompt template {recorded} but data.template is {wanted}"]
    if wanted != "chat":
        return []
    current = ChatTemplate.load(student_tokenizer)  # refused when it has no chat template
    if built.get("chat_template_sha256") != current.sha256:
        return [
            f"its prompts were rendered with the chat template of '{built.get('tokenizer', '?')}' "
            f"({_short(built.get('chat_template_sha256'))}) but the student tokenizer "
            f"'{student_tokenizer}' has another ({_short(current.sha256)})"
        ]
    return []


def _rebuild_hint(
    annotations: Annotations, recipe: Recipe, key: str, teacher_tokenizer: str, student_tokenizer: str
) -> str:
    """How to get fitting annotations: annotate the recorded input with the recipe's settings
    into a directory that does not exist yet, or let the run annotate the JSONL itself."""
    from mta.data.annotate import AnnotateSettings
    from mta.data.artefact_schema import annotate_command

    recorded = annotations.manifest.get("input")
    source = recorded.get("path") if isinstance(recorded, dict) else None
    hub = recorded if isinstance(recorded, dict) and recorded.get("hub_id") else None
    first_use = (
        f"point {key} at the rows (annotated on first use into "
        f"{recipe.resolve(recipe.output_dir, 'output_dir') / 'data' / key.rpartition('.')[2]})"
    )
    if hub is None and not (isinstance(source, str) and Path(source).exists()):  # a file, a save_to_disk dir
        gone = f" (the input it was built from, {source}, is not there)" if isinstance(source, str) else ""
        return f"Annotate the input again with the recipe's tokenizers{gone}, or {first_use}"
    settings = AnnotateSettings.from_recipe(recipe, teacher=teacher_tokenizer, student=student_tokenizer)
    target = _new_directory(annotations.directory, recipe.name)
    command = annotate_command(
        source,
        target,
        teacher=settings.teacher,
        student=settings.student,
        max_length=settings.max_length,
        max_prompt_length=settings.max_prompt_length,
        spacy_model=settings.spacy_model,
        word_spans=settings.word_spans,
        truncate_prompt=settings.truncate_prompt,
        on_error=annotations.manifest.get("on_error"),
        fields=dict(settings.fields),
        span_rule=settings.span_rule,
        hub=hub,
    )
    if settings.template != "alpaca":  # annotate_command knows no template; alpaca is the default
        command += f" --template {settings.template}"
    return (
        f"Annotate it into a new directory (the existing one stays as it is): `{command}`, then set "
        f"{key}: {target}; or {first_use}"
    )


def _new_directory(directory: Path, recipe_name: str) -> Path:
    """``DIR-<recipe>`` beside ``directory``, numbered when that name is taken."""
    stem = "".join(c if c.isalnum() or c in "._-" else "-" for c in recipe_name) or "recipe"
    candidate = directory.with_name(f"{directory.name}-{stem}")
    number = 2
    while candidate.exists():
        candidate = directory.with_name(f"{directory.name}-{stem}-{number}")
        number += 1
    return candidate


def _short(fingerprint: str | None) -> str:
    return fingerprint[:19] if fingerprint else "no fingerprint"
