"""The annotate artefact's schema, versioned in one place: the columns, the version, old versions.

``SCHEMA_VERSION`` / ``SCHEMA`` are what ``mta annotate`` writes, the column-name constants what
readers index with; ``SCHEMAS[n]`` is version n's frozen schema, ``UPGRADES[n]`` turns version n
into n + 1 in memory (files are never rewritten). The versions, and how to add one:
ARCHITECTURE.md, "1. annotate".
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from mta.errors import MtaError
from mta.store.layout import LAYOUT_KEY, LAYOUT_VERSION, LAYOUTS, VERSION_KEY
from mta.versions import MTA_VERSION

# --------------------------------------------------------------------------- column names
# The current version's names, for readers (mta.training.batching, mta show). Each one is
# checked against SCHEMA by the tests, so they cannot drift from the schema.

ID = "id"
TEXT = "text"
PROMPT_CHARS = "prompt_chars"
SIDES = ("teacher", "student")
INPUT_IDS = {"teacher": "teacher_input_ids", "student": "student_input_ids"}
PROMPT_LEN = {"teacher": "teacher_prompt_len", "student": "student_prompt_len"}
SPAN_COLUMNS = {"phrase": "phrase_spans", "word": "word_spans"}  # granularity -> column
SPAN_CHARS = ("char_start", "char_end")  # half-open range into ``text``
SPAN_LABEL = "label"
SPAN_TOKENS = {  # half-open range into each side's ids
    "teacher": ("teacher_start", "teacher_end"),
    "student": ("student_start", "student_end"),
}
BOUNDARY_SPANS = "boundary_spans"  # SRA's spans: list<BOUNDARY_SPAN>; null: not computed (v1, v2)
PAIR_ID = "pair_id"  # the input row both halves of a pair come from (null: not a pair)
ROLE = "role"  # "chosen" (the teacher's response) or "rejected" (the student's); null: not a pair
ROLES = ("chosen", "rejected")

# --------------------------------------------------------------------------- versions
# Released schemas are written out literally, never built from the names above: renaming a
# column in a later version must not change what version 1 was.

SPAN_V1 = pa.struct(
    [
        ("char_start", pa.int32()),
        ("char_end", pa.int32()),
        ("label", pa.string()),
        ("teacher_start", pa.int32()),
        ("teacher_end", pa.int32()),
        ("student_start", pa.int32()),
        ("student_end", pa.int32()),
    ]
)
SCHEMA_V1 = pa.schema(
    [
        ("id", pa.int64()),
        ("text", pa.string()),
        ("prompt_chars", pa.int32()),
        ("teacher_input_ids", pa.list_(pa.int32())),
        ("student_input_ids", pa.list_(pa.int32())),
        ("teacher_prompt_len", pa.int32()),
        ("student_prompt_len", pa.int32()),
        ("phrase_spans", pa.list_(SPAN_V1)),
        ("word_spans", pa.list_(SPAN_V1)),
    ]
)

# Version 2: version 1 + the pair columns of DistiLLM-2's rows (prompt, chosen, rejected), null
# on a row that is not half of a pair.
SCHEMA_V2 = pa.schema(
    [
        ("id", pa.int64()),
        ("text", pa.string()),
        ("prompt_chars", pa.int32()),
        ("teacher_input_ids", pa.list_(pa.int32())),
        ("student_input_ids", pa.list_(pa.int32())),
        ("teacher_prompt_len", pa.int32()),
        ("student_prompt_len", pa.int32()),
        ("phrase_spans", pa.list_(SPAN_V1)),
        ("word_spans", pa.list_(SPAN_V1)),
        ("pair_id", pa.int64()),
        ("role", pa.string()),
    ]
)

# Version 3: version 2 + the spans both tokenisations agree on (SRA), over the whole text; a
# span of characters and of each side's tokens, without a label.
BOUNDARY_SPAN_V3 = pa.struct(
    [
        ("char_start", pa.int32()),
        ("char_end", pa.int32()),
        ("teacher_start", pa.int32()),
        ("teacher_end", pa.int32()),
        ("student_start", pa.int32()),
        ("student_end", pa.int32()),
    ]
)
SCHEMA_V3 = pa.schema(
    [
        ("id", pa.int64()),
        ("text", pa.string()),
        ("prompt_chars", pa.int32()),
        ("teacher_input_ids", pa.list_(pa.int32())),
        ("student_input_ids", pa.list_(pa.int32())),
        ("teacher_prompt_len", pa.int32()),
        ("student_prompt_len", pa.int32()),
        ("phrase_spans", pa.list_(SPAN_V1)),
        ("word_spans", pa.list_(SPAN_V1)),
        ("pair_id", pa.int64()),
        ("role", pa.string()),
        ("boundary_spans", pa.list_(BOUNDARY_SPAN_V3)),
    ]
)

SCHEMAS: dict[int, pa.Schema] = {1: SCHEMA_V1, 2: SCHEMA_V2, 3: SCHEMA_V3}
SCHEMA_VERSION = 3
SCHEMA = SCHEMA_V3
SPAN = SPAN_V1
BOUNDARY_SPAN = BOUNDARY_SPAN_V3
COLUMNS = tuple(SCHEMA.names)

# --------------------------------------------------------------------------- upgrade steps

Manifest = dict[str, Any]
Upgrade = Callable[[Manifest, pa.Table], tuple[Manifest, pa.Table]]
UPGRADES: dict[int, Upgrade] = {}  # version n -> the step that returns version n + 1


class NotDerivable(Exception):
    """Raised by an upgrade step: ``column`` of the newer version cannot be computed from the
    older version's data (``reason`` says why); the reader turns it into an ``MtaError``."""

    def __init__(self, column: str, reason: str):
        super().__init__(f"{column}: {reason}")
        self.column = column
        self.reason = reason


def upgrade_step(from_version: int) -> Callable[[Upgrade], Upgrade]:
    """Register the decorated function as the step from ``from_version`` to ``from_version + 1``.

    The step gets a shallow copy of the manifest and the whole table (rows in input order) and
    returns the new ones; it need not set ``schema_version`` (the reader does).
    """

    def register(step: Upgrade) -> Upgrade:
        if from_version in UPGRADES:
            raise ValueError(f"an upgrade step from version {from_version} is already registered")
        UPGRADES[from_version] = step
        return step

    return register


def readable_versions() -> list[int]:
    """The versions this mta reads: the current one and each older one with a complete chain of
    steps up to it, oldest first."""
    versions = [SCHEMA_VERSION]
    while versions[0] - 1 in UPGRADES and versions[0] - 1 in SCHEMAS:
        versions.insert(0, versions[0] - 1)
    return versions


@upgrade_step(1)
def _pairs_are_absent(manifest: Manifest, table: pa.Table) -> tuple[Manifest, pa.Table]:
    """Version 1 had no pair rows: ``pair_id`` and ``role`` are null on every row."""
    table = table.append_column(pa.field("pair_id", pa.int64()), pa.nulls(table.num_rows, pa.int64()))
    table = table.append_column(pa.field("role", pa.string()), pa.nulls(table.num_rows, pa.string()))
    return manifest, table


@upgrade_step(2)
def _boundary_spans_not_computed(manifest: Manifest, table: pa.Table) -> tuple[Manifest, pa.Table]:
    """Version 2 did not keep what ``boundary_spans`` needs (the tokens' character offsets):
    the column is null on every row, "not computed". Every other column reads as before; a
    reader of the spans refuses the null, naming :func:`reannotate_command` (not
    ``NotDerivable``, which would refuse the whole artefact for a column most losses never read)."""
    kind = pa.list_(BOUNDARY_SPAN_V3)
    table = table.append_column(pa.field("boundary_spans", kind), pa.nulls(table.num_rows, kind))
    return manifest, table


# --------------------------------------------------------------------------- reading


def stored_layout(manifest: Any, manifest_path: Path, directory: Path) -> int:
    """The layout version a ``.mta/manifest.json`` records if this mta reads it; else
    ``MtaError`` naming the fix. (A ``manifest.json`` beside the parts is layout 1, keyless.)"""
    found = manifest.get(LAYOUT_KEY) if isinstance(manifest, dict) else None
    if type(found) is int and 2 <= found <= LAYOUT_VERSION:
        return found
    newer = type(found) is int and found > LAYOUT_VERSION
    raise MtaError(
        f"{manifest_path} has {LAYOUT_KEY} {found!r}, which this mta ({MTA_VERSION}) cannot "
        f"read: it reads layout version(s) {_listed(sorted(LAYOUTS))}. "
        + (
            "It was written by a newer mta: upgrade mta, or annotate the input again with this one into a new directory"
            if newer
            else "Annotate the input again into a new directory"
        )
        + f": `{reannotate_command(manifest, directory)}`"
    )


def stored_version(manifest: Any, manifest_path: Path, directory: Path | None = None) -> int:
    """The manifest's schema version if this mta reads it; else ``MtaError`` naming the fix.
    ``directory``: the artefact's (default: the manifest's own directory)."""
    directory = manifest_path.parent if directory is None else directory
    if not isinstance(manifest, dict) or VERSION_KEY not in manifest:
        raise MtaError(
            f"{manifest_path} has no {VERSION_KEY}: it was not written by `mta annotate` or was "
            f"edited by hand. This mta reads schema version(s) {_listed(readable_versions())}; "
            f"annotate the input again into a new directory: `{reannotate_command(manifest, directory)}`"
        )
    found = manifest[VERSION_KEY]
    # bool is an int in Python: ``true`` must not pass for version 1.
    if type(found) is int and found in readable_versions():
        return found
    newer = type(found) is int and found > SCHEMA_VERSION
    fix = (
        "It was written by a newer mta: upgrade mta, or annotate the input again with this one into a new directory"
        if newer
        else "Annotate the input again into a new directory"
    )
    raise MtaError(
        f"{manifest_path} has {VERSION_KEY} {found!r}, which this mta ({MTA_VERSION}) cannot "
        f"read: it reads schema version(s) {_listed(readable_versions())}. {fix}: "
        f"`{reannotate_command(manifest, directory)}`"
    )


def conform(table: pa.Table, version: int, source: str) -> pa.Table:
    """``table`` with exactly version ``version``'s columns, in order; ``MtaError`` if it lacks
    one or holds one of another type (``source`` names the file in the message)."""
    expected = SCHEMAS[version]
    if table.schema.equals(expected):
        return table
    try:
        return table.select(expected.names).cast(expected)
    except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as error:
        raise MtaError(
            f"{source} does not hold the columns of annotate schema version {version} ({error}); "
            f"the directory was changed by hand or by another program. Annotate the input again "
            f"into a new directory"
        ) from error


def upgrade_to_current(manifest: Manifest, table: pa.Table, directory: Path) -> tuple[Manifest, pa.Table]:
    """Bring a readable version's ``(manifest, table)`` to ``SCHEMA_VERSION``, in memory.

    ``manifest`` has passed :func:`stored_version`; ``table`` holds its version's columns.
    Applies ``UPGRADES[n]`` for n from the stored version up; the current version passes through
    untouched. A step's ``NotDerivable`` becomes an ``MtaError`` naming the command that builds
    the artefact at the current version into a new directory.
    """
    original = manifest
    for version in range(manifest[VERSION_KEY], SCHEMA_VERSION):
        try:
            manifest, table = UPGRADES[version](dict(manifest), table)
        except NotDerivable as missing:
            raise MtaError(
                f"{directory} holds annotate schema version {version}, which lacks "
                f"`{missing.column}` ({missing.reason}); this mta needs schema version "
                f"{SCHEMA_VERSION}. Annotate the input again into a new directory (the existing "
                f"one stays as it is): `{reannotate_command(original, directory)}`, then read "
                "that one instead"
            ) from missing
        manifest = {**manifest, VERSION_KEY: version + 1}
        table = conform(table, version + 1, f"the upgrade of {directory} to version {version + 1}")
    return manifest, table


def reannotate_command(manifest: Any, directory: Path, *, out: Path | None = None) -> str:
    """The ``mta annotate`` command that rebuilds ``directory``'s artefact at the current version
    into a new directory beside it (``out``, by default ``DIR-vN``), with the settings its
    manifest records.

    Settings the manifest lacks (or a manifest that is not one) are left at placeholders or at
    ``mta annotate``'s defaults.
    """
    manifest = manifest if isinstance(manifest, dict) else {}

    def recorded(*keys: str) -> Any:
        value: Any = manifest
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    return annotate_command(
        recorded("input", "path") or "DATA.jsonl",
        out if out is not None else Path(f"{directory}-v{SCHEMA_VERSION}"),
        teacher=recorded("teacher", "name") or "TEACHER",
        student=recorded("student", "name") or "STUDENT",
        max_length=recorded("max_length"),
        max_prompt_length=recorded("max_prompt_length"),
        spacy_model=recorded("spacy", "model"),
        word_spans=recorded("word_spans"),
        span_rule=recorded("span_rule"),
        truncate_prompt=recorded("truncate_prompt") is True,
        on_error=recorded("on_error"),
        fields=recorded("input", "fields"),
    )


def annotate_command(
    input_path: Any,
    out: Any,
    *,
    teacher: Any,
    student: Any,
    max_length: Any = None,
    max_prompt_length: Any = None,
    spacy_model: Any = None,
    word_spans: Any = None,
    truncate_prompt: bool = False,
    on_error: Any = None,
    fields: Any = None,
    span_rule: Any = None,
    hub: Any = None,
) -> str:
    """The shell-quoted ``mta annotate`` command line for these settings (None: the default).
    ``fields``: ``{format key: input column}``, one ``--field KEY=COLUMN`` each. ``hub``: a
    manifest's record of a Hub dataset input (``split``, ``subset``, ``revision``: the commit)."""
    command = ["mta", "annotate", str(input_path), "--teacher", str(teacher), "--student", str(student)]
    if isinstance(hub, dict):
        for option in ("split", "subset", "revision"):
            if hub.get(option):
                command += [f"--{option}", str(hub[option])]
    if isinstance(fields, dict):
        for key, column in sorted(fields.items()):
            command += ["--field", f"{key}={column}"]
    for option, value in (
        ("--max-length", max_length),
        ("--max-prompt-length", max_prompt_length),
        ("--spacy-model", spacy_model),
        ("--word-spans", word_spans),
        ("--span-rule", None if span_rule == "paper" else span_rule),
    ):
        if value is not None:
            command += [option, str(value)]
    if truncate_prompt:
        command.append("--truncate-prompt")
    if on_error == "skip":
        command += ["--on-error", "skip"]
    command += ["-o", str(out)]
    return shlex.join(command)


def _listed(versions: list[int]) -> str:
    return ", ".join(str(version) for version in versions)
