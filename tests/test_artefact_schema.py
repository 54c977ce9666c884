"""The annotate artefact's versions: the writer stamps the current one, older ones upgrade on
read through the registered steps, the committed v1 artefact keeps reading, unknown ones are
refused with the fix."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import EXAMPLES
from mta.data import artefact_schema
from mta.data.annotate import AnnotateSettings, run_annotate
from mta.data.annotations import read_annotations
from mta.data.artefact_schema import (
    SPAN_V1,
    NotDerivable,
    readable_versions,
    reannotate_command,
    upgrade_step,
)
from mta.errors import MtaError
from mta.hashing import file_sha256
from mta.store.publish import merge_shards

COMMITTED_V1 = Path(__file__).parent / "data" / "annotate-v1"
# Today's version, and a simulated next one: today's plus one span column.
TODAY = artefact_schema.SCHEMA_VERSION
NEXT = TODAY + 1
SCHEMA_NEXT = artefact_schema.SCHEMA.append(pa.field("sentence_spans", pa.list_(SPAN_V1)))


def add_empty_sentence_spans(manifest, table):
    """The simulated today -> next step: every row gets an empty ``sentence_spans``."""
    empty = pa.array([[]] * table.num_rows, pa.list_(SPAN_V1))
    return manifest, table.append_column("sentence_spans", empty)


@pytest.fixture
def next_version(monkeypatch):
    """Make this mta one whose current version is NEXT (no step from today's registered yet;
    the released steps stay)."""
    monkeypatch.setattr(artefact_schema, "SCHEMA_VERSION", NEXT)
    monkeypatch.setitem(artefact_schema.SCHEMAS, NEXT, SCHEMA_NEXT)
    monkeypatch.setattr(artefact_schema, "UPGRADES", dict(artefact_schema.UPGRADES))


@pytest.fixture(scope="module")
def settings(two_tokenizer_settings) -> AnnotateSettings:
    return two_tokenizer_settings


@pytest.fixture(scope="module")
def small_input(tmp_path_factory) -> Path:
    lines = EXAMPLES.read_text(encoding="utf-8").splitlines()[:6]
    path = tmp_path_factory.mktemp("input") / "small.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def written_today(tmp_path_factory, small_input, settings) -> Path:
    """An artefact written by today's code (tests copy it before changing anything)."""
    out = tmp_path_factory.mktemp("today") / "annotations"
    run_annotate(small_input, out, settings)
    return out


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        path.relative_to(directory).as_posix(): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def with_manifest(source: Path, destination: Path, **changes) -> Path:
    """A copy of ``source`` whose manifest has ``changes`` (a value of ``...`` deletes the key)."""
    shutil.copytree(source, destination)
    manifest = json.loads((destination / "manifest.json").read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is ...:
            del manifest[key]
        else:
            manifest[key] = value
    (destination / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return destination


# --------------------------------------------------------------------------- writing


def test_the_writer_writes_the_current_version(written_today):
    on_disk = json.loads((written_today / ".mta" / "manifest.json").read_text(encoding="utf-8"))
    shard = json.loads((written_today / ".mta" / "shard-00000-of-00001.json").read_text(encoding="utf-8"))
    assert on_disk["schema_version"] == shard["schema_version"] == artefact_schema.SCHEMA_VERSION
    (part,) = written_today.glob("part-*.parquet")
    assert pq.read_schema(part).equals(artefact_schema.SCHEMAS[artefact_schema.SCHEMA_VERSION])

    annotations = read_annotations(written_today)  # the current version reads with no step
    assert annotations.stored_version == artefact_schema.SCHEMA_VERSION
    assert annotations.manifest == on_disk


def test_the_exported_column_names_are_the_schemas():
    schema, span = artefact_schema.SCHEMA, artefact_schema.SPAN
    assert artefact_schema.COLUMNS == tuple(schema.names)
    named = [
        artefact_schema.ID,
        artefact_schema.TEXT,
        artefact_schema.PROMPT_CHARS,
        *artefact_schema.INPUT_IDS.values(),
        *artefact_schema.PROMPT_LEN.values(),
        *artefact_schema.SPAN_COLUMNS.values(),
        artefact_schema.PAIR_ID,
        artefact_schema.ROLE,
        artefact_schema.BOUNDARY_SPANS,
    ]
    assert sorted(named) == sorted(schema.names)
    for column in artefact_schema.SPAN_COLUMNS.values():
        assert schema.field(column).type == pa.list_(span)
    span_fields = [
        *artefact_schema.SPAN_CHARS,
        artefact_schema.SPAN_LABEL,
        *(name for side in artefact_schema.SIDES for name in artefact_schema.SPAN_TOKENS[side]),
    ]
    assert sorted(span_fields) == sorted(field.name for field in span)
    boundary = artefact_schema.BOUNDARY_SPAN  # a span without a label
    assert schema.field(artefact_schema.BOUNDARY_SPANS).type == pa.list_(boundary)
    assert sorted(set(span_fields) - {artefact_schema.SPAN_LABEL}) == sorted(f.name for f in boundary)


# --------------------------------------------------------------------------- upgrading


def test_a_directory_written_today_reads_after_a_version_bump(written_today, next_version):
    before = snapshot(written_today)
    today = pq.read_table(next(written_today.glob("part-*.parquet")))
    seen = []

    @upgrade_step(TODAY)
    def step(manifest, table):
        seen.append((manifest["schema_version"], table.schema))
        return add_empty_sentence_spans(manifest, table)

    assert readable_versions() == list(range(1, NEXT + 1))
    annotations = read_annotations(written_today)
    assert seen == [(TODAY, artefact_schema.SCHEMAS[TODAY])]  # the step got today's manifest and table
    assert annotations.stored_version == TODAY and annotations.manifest["schema_version"] == NEXT
    assert annotations.table.schema.equals(SCHEMA_NEXT)
    assert annotations.table.column("sentence_spans").to_pylist() == [[]] * len(annotations)
    assert annotations.table.drop_columns(["sentence_spans"]).equals(today)
    assert snapshot(written_today) == before  # upgraded in memory; the files are untouched


def test_shards_written_before_a_bump_merge_as_their_own_version(tmp_path, small_input, settings, next_version):
    out = tmp_path / "sharded"
    for index in range(2):
        # Written with today's code: run_annotate stamps the version it was imported with.
        run_annotate(small_input, out, settings, shard=index, num_shards=2)
    (out / ".mta" / "manifest.json").unlink()
    upgrade_step(TODAY)(add_empty_sentence_spans)

    assert merge_shards(out)["schema_version"] == TODAY  # not labelled as the next version
    annotations = read_annotations(out)
    assert annotations.stored_version == TODAY and annotations.table.schema.equals(SCHEMA_NEXT)


def test_a_column_that_cannot_be_derived_names_the_command_into_a_new_directory(
    written_today, small_input, settings, next_version
):
    @upgrade_step(TODAY)
    def step(manifest, table):
        raise NotDerivable("sentence_spans", "sentence boundaries need a parse version 1 did not keep")

    with pytest.raises(MtaError) as error:
        read_annotations(written_today)
    message = str(error.value)
    assert f"schema version {TODAY}, which lacks `sentence_spans`" in message
    assert f"mta annotate {small_input} --teacher {settings.teacher} --student {settings.student}" in message
    assert f"-o {written_today}-v{NEXT}`" in message  # a new directory ...
    assert "--force" not in message  # ... never an overwrite of the existing one


def test_a_bump_without_a_step_refuses_the_older_version(written_today, next_version):
    assert readable_versions() == [NEXT]
    with pytest.raises(
        MtaError,
        match=rf"schema_version {TODAY}, .* it reads schema version\(s\) {NEXT}\. "
        r"Annotate the input again into a new directory",
    ):
        read_annotations(written_today)


def test_the_suggested_command_rebuilds_the_artefact_into_a_new_directory(written_today, tmp_path):
    from mta_cli.main import app

    old = shutil.copytree(written_today, tmp_path / "old")
    manifest = read_annotations(old).manifest
    command = shlex.split(reannotate_command(manifest, old))
    assert command[:2] == ["mta", "annotate"] and command[-2:] == ["-o", f"{old}-v{TODAY}"]
    result = CliRunner().invoke(app, command[1:] + ["--workers", "1"])
    assert result.exit_code == 0, result.output
    rebuilt = read_annotations(tmp_path / f"old-v{TODAY}")
    assert rebuilt.table.equals(read_annotations(old).table)
    assert rebuilt.manifest["run_key"] == manifest["run_key"]  # the very same settings


# --------------------------------------------------------------------------- the committed v1 artefact


def test_the_committed_v1_artefact_reads_with_todays_code():
    """Every future version bump must keep this passing: it is a real directory from mta 0.1.0."""
    annotations = read_annotations(COMMITTED_V1)
    assert annotations.stored_version == 1
    assert annotations.manifest["schema_version"] == artefact_schema.SCHEMA_VERSION
    assert annotations.table.schema.equals(artefact_schema.SCHEMA)
    part = annotations.manifest["parts"][0]
    assert file_sha256(COMMITTED_V1 / part["file"]) == part["sha256"]  # nobody edited it

    assert len(annotations) == 5 == annotations.manifest["rows"]["written"]
    assert annotations.table.column("id").to_pylist() == [0, 1, 3, 4, 6]  # two rows skipped
    by_id = {row["id"]: row for row in annotations.table.to_pylist()}
    plain = by_id[6]  # a prompt/response row: the text is prompt + response
    assert plain["text"] == "Q: what is two plus two?\nA: Two plus two is four."
    assert plain["prompt_chars"] == len("Q: what is two plus two?\nA: ")
    what = plain["phrase_spans"][1]
    assert (what["char_start"], what["char_end"], what["label"]) == (3, 7, "NP")
    assert plain["text"][what["char_start"] : what["char_end"]] == "what"
    # Character ranges count code points, not bytes: the emoji after 👋🏽 is one character.
    party = by_id[4]["phrase_spans"][-1]
    assert (party["char_start"], party["char_end"]) == (185, 186)
    assert by_id[4]["text"][185:186] == "🎉"
    for row in by_id.values():
        for span in row["phrase_spans"] + row["word_spans"]:
            assert 0 <= span["char_start"] < span["char_end"] <= len(row["text"])
            assert 0 <= span["teacher_start"] < span["teacher_end"] <= len(row["teacher_input_ids"])
            assert 0 <= span["student_start"] < span["student_end"] <= len(row["student_input_ids"])


# --------------------------------------------------------------------------- refusing


@pytest.mark.parametrize(
    "found,newer",
    [(NEXT, True), (99, True), (0, False), ("1", False), (True, False), (1.5, False), (None, False)],
    ids=["next", "far-future", "zero", "string", "bool", "float", "null"],
)
def test_an_unknown_version_is_refused_with_the_fix(tmp_path, found, newer):
    old = with_manifest(COMMITTED_V1, tmp_path / "old", schema_version=found)
    with pytest.raises(MtaError) as error:
        read_annotations(old)
    message = str(error.value)
    assert f"{old / 'manifest.json'} has schema_version {found!r}, which this mta" in message
    assert f"it reads schema version(s) {', '.join(map(str, range(1, TODAY + 1)))}." in message
    assert ("upgrade mta" in message) == newer
    assert "into a new directory: `mta annotate /tmp/annotate-v1-fixture/rows.jsonl" in message
    assert f"-o {old}-v{TODAY}`" in message and "--force" not in message


def test_a_manifest_without_a_schema_version_is_refused(tmp_path):
    old = with_manifest(COMMITTED_V1, tmp_path / "old", schema_version=...)
    with pytest.raises(
        MtaError,
        match=r"manifest.json has no schema_version: it was not written by "
        r"`mta annotate` or was edited by hand\. This mta reads schema "
        r"version\(s\) 1, 2, 3; annotate the input again into a new directory",
    ):
        read_annotations(old)
