"""Reading a store directory (mta.data.annotations, mta.store.read) built here from small tables of
the annotate schema (no spaCy): rows in id order, each refusal of a missing, changed, unreadable or miscounted part,
incomplete and absent directories, the earlier layout. What mutation testing (bench/mutation.py)
found the annotate tests leave unchecked."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fixtures.store import annotate_rows
from mta.data.annotations import read_annotations
from mta.data.artefact_schema import SCHEMA, SCHEMA_VERSION, reannotate_command
from mta.errors import MtaError
from mta.store.layout import LAYOUT_KEY, META, VERSION_KEY, manifest_path, staged_part
from mta.store.publish import PartWriter, commit_shard
from mta.store.read import read_stage_manifest, verified_parts

INPUT = {"input": {"path": "/data/in.jsonl"}, "teacher": {"name": "t"}, "student": {"name": "s"}}


def publish(out: Path, shards: list[list[int]], *, run: str = "k") -> None:
    """One shard per id list, committed: the directory is complete after the last."""
    for index, ids in enumerate(shards):
        path = staged_part(out, index, len(shards), run)
        path.parent.mkdir(parents=True, exist_ok=True)
        with PartWriter(path, schema=SCHEMA) as writer:
            writer.write(annotate_rows(ids))
            entry = writer.commit()
        shard = {
            "shard": index,
            "num_shards": len(shards),
            "run_key": run,
            VERSION_KEY: SCHEMA_VERSION,
            "counts": {"rows": len(ids)},
            "skipped_examples": [],
            "description": dict(INPUT),
            "part": entry,
        }
        commit_shard(out, shard)


def ids(out: Path) -> list[int]:
    return read_annotations(out).table.column("id").to_pylist()


def refusal(out: Path) -> str:
    with pytest.raises(MtaError) as refused:
        read_annotations(out)
    return str(refused.value)


def manifest(out: Path) -> dict:
    return json.loads(manifest_path(out).read_text(encoding="utf-8"))


def test_the_rows_of_every_part_are_read_in_id_order_and_one_part_as_written(tmp_path):
    publish(tmp_path / "two", [[0, 2, 4], [1, 3]])
    annotations = read_annotations(tmp_path / "two")
    assert annotations.table.column("id").to_pylist() == [0, 1, 2, 3, 4]
    assert (annotations.stored_version, annotations.layout, len(annotations)) == (SCHEMA_VERSION, 2, 5)
    assert annotations.manifest == manifest(tmp_path / "two") and annotations.directory == tmp_path / "two"
    publish(tmp_path / "one", [[3, 1, 2]])
    assert ids(tmp_path / "one") == [3, 1, 2]
    assert read_annotations(str(tmp_path / "one")).table.schema == SCHEMA


def test_a_directory_without_parts_reads_as_no_rows_of_its_schema(tmp_path):
    publish(tmp_path, [[0]])
    written = manifest(tmp_path)
    manifest_path(tmp_path).write_text(json.dumps({**written, "parts": []}), encoding="utf-8")
    annotations = read_annotations(tmp_path)
    assert len(annotations) == 0 and annotations.table.schema == SCHEMA


def test_a_file_a_missing_directory_an_incomplete_one_and_one_without_a_manifest_name_the_fix(tmp_path):
    path = tmp_path / "file"
    path.write_text("x", encoding="utf-8")
    assert (
        refusal(path)
        == f"{path} is a file; give the directory `mta annotate -o DIR` wrote (it holds {META}/manifest.json)"
    )
    absent = tmp_path / "absent"
    assert refusal(absent) == f"{absent} does not exist; create it with `mta annotate DATA.jsonl -o {absent}`"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert refusal(empty) == (
        f"{empty} has no {META}/manifest.json: it is not a finished `mta annotate` output (an interrupted "
        f"run leaves none). Run `mta annotate DATA.jsonl -o {empty}`"
    )
    half = tmp_path / "half"
    publish(half, [[0], [1], [2]])
    manifest_path(half).unlink()
    (half / META / "shard-00001-of-00003.json").unlink()
    assert refusal(half).startswith(f"{half} is incomplete: 2 of 3 shards are written (missing: 1). ")
    legacy = tmp_path / "legacy"  # layout 1: a shard file beside the parts
    legacy.mkdir()
    publish(tmp_path / "source", [[0], [1]])
    shard = json.loads((tmp_path / "source" / META / "shard-00000-of-00002.json").read_text(encoding="utf-8"))
    (legacy / "shard-00000-of-00002.json").write_text(json.dumps(shard), encoding="utf-8")
    assert refusal(legacy).startswith(f"{legacy} is incomplete: 1 of 2 shards are written (missing: 1). ")


def rebuild(out: Path) -> str:
    return reannotate_command(manifest(out), out, out=Path(f"{out}-rebuilt"))


def part_file(out: Path, index: int = 0) -> Path:
    return out / manifest(out)["parts"][index]["file"]


def test_a_missing_changed_unreadable_or_miscounted_part_is_refused_naming_it_and_the_rebuild(tmp_path):
    publish(tmp_path, [[0, 1], [2]])
    part, command = part_file(tmp_path, 1), rebuild(tmp_path)
    tail = f". Annotate the input again into a new directory (this one stays as it is): `{command}`, then use that one"
    original = part.read_bytes()
    part.unlink()
    assert refusal(tmp_path) == f"{part} is listed in manifest.json but missing{tail}"
    pq.write_table(pa.Table.from_batches([annotate_rows([7])]), part)
    digest = manifest(tmp_path)["parts"][1]["sha256"]
    assert refusal(tmp_path).startswith(f"{part} does not match manifest.json: its sha256 is ")
    assert refusal(tmp_path).endswith(
        f", the manifest records {digest}; the part was changed or replaced after `mta annotate` wrote "
        f"it, so its rows cannot be trusted{tail}"
    )
    written = manifest(tmp_path)
    unchecked = {**written, "parts": [{**p, "sha256": None} for p in written["parts"]]}
    manifest_path(tmp_path).write_text(json.dumps(unchecked), encoding="utf-8")  # no sha256 recorded
    part.write_bytes(b"not parquet")
    assert refusal(tmp_path).startswith(f"{part} is not a readable Parquet file (")
    assert refusal(tmp_path).endswith(f"): it is corrupt or truncated{tail}")
    part.write_bytes(original)
    miscounted = {**unchecked, "parts": [unchecked["parts"][0], {**unchecked["parts"][1], "rows": 2}]}
    manifest_path(tmp_path).write_text(json.dumps(miscounted), encoding="utf-8")
    assert refusal(tmp_path) == f"{part} has 1 rows, manifest.json says 2{tail}"
    pq.write_table(pa.table({"id": pa.array([2], pa.int64())}), part)
    assert refusal(tmp_path).startswith(
        f"{part} does not hold the columns of annotate schema version {SCHEMA_VERSION} ("
    )


def test_an_unreadable_part_is_refused_with_the_systems_reason(tmp_path, monkeypatch):
    from mta.data import annotations

    publish(tmp_path, [[0]])
    part = part_file(tmp_path)

    def unreadable(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(annotations, "file_sha256", unreadable)
    assert refusal(tmp_path).startswith(f"{part} cannot be read (Permission denied). Annotate the input again")


def test_a_directory_of_the_earlier_layout_is_read_as_layout_1(tmp_path):
    publish(tmp_path, [[0, 1]])
    written = manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(
        json.dumps({k: v for k, v in written.items() if k != LAYOUT_KEY}), encoding="utf-8"
    )
    manifest_path(tmp_path).unlink()
    annotations = read_annotations(tmp_path)
    assert annotations.layout == 1 and annotations.table.column("id").to_pylist() == [0, 1]


def test_a_manifest_of_a_layout_or_version_this_mta_does_not_read_is_refused(tmp_path):
    publish(tmp_path, [[0]])
    written = manifest(tmp_path)
    manifest_path(tmp_path).write_text(json.dumps({**written, LAYOUT_KEY: 99}), encoding="utf-8")
    assert refusal(tmp_path).startswith(f"{manifest_path(tmp_path)} has {LAYOUT_KEY} 99, which this mta")
    assert f"`{reannotate_command(written, tmp_path)}`" in refusal(tmp_path)
    manifest_path(tmp_path).write_text(json.dumps({**written, VERSION_KEY: 99}), encoding="utf-8")
    assert refusal(tmp_path).startswith(f"{manifest_path(tmp_path)} has {VERSION_KEY} 99, which this mta")
    assert f"`{reannotate_command(written, tmp_path)}`" in refusal(tmp_path)


def test_a_row_is_read_by_position_and_a_position_out_of_range_names_the_range(tmp_path):
    publish(tmp_path, [[0, 2], [1]])
    annotations = read_annotations(tmp_path)
    assert annotations.row(2)["id"] == 2 and annotations.row(0)["id"] == 0
    for position in (-1, 3):
        with pytest.raises(MtaError) as refused:
            annotations.row(position)
        assert str(refused.value) == f"row {position} is out of range: {tmp_path} has 3 rows (0..2)"


STAGE = dict(
    artefact="annotations", version_key="layout_version", version=2, command="mta embed", build="mta embed X -o D"
)


def test_another_stages_manifest_is_checked_for_its_artefact_and_version(tmp_path):
    absent = tmp_path / "absent"
    with pytest.raises(MtaError) as refused:
        read_stage_manifest(absent, **STAGE, what="cache: ")
    assert str(refused.value) == f"cache: {absent} does not exist; build it with `mta embed X -o D`"
    with pytest.raises(MtaError) as refused:
        read_stage_manifest(tmp_path, **STAGE)
    assert str(refused.value) == (
        f"{tmp_path} has no {META}/manifest.json: it is not a finished `mta embed` output (an interrupted "
        "or partly sharded run leaves none); re-run the same `mta embed` command to finish it"
    )
    publish(tmp_path, [[0]])
    written = manifest(tmp_path)
    manifest_path(tmp_path).write_text(json.dumps({**written, "artefact": "annotations"}), encoding="utf-8")
    assert read_stage_manifest(tmp_path, **STAGE)["artefact"] == "annotations"
    with pytest.raises(MtaError) as refused:
        read_stage_manifest(tmp_path, **{**STAGE, "artefact": "embeddings"})
    assert str(refused.value) == (
        f"{manifest_path(tmp_path)} is not a embeddings artefact (artefact: 'annotations'); give the -o "
        "directory of `mta embed`"
    )
    with pytest.raises(MtaError) as refused:
        read_stage_manifest(tmp_path, **{**STAGE, "version": 3})
    assert str(refused.value) == (
        f"{manifest_path(tmp_path)} has layout_version 2; this mta reads version 3: re-run `mta embed` into "
        "a new directory (or with --force)"
    )


def test_another_stages_parts_are_each_present_and_unchanged(tmp_path):
    publish(tmp_path, [[0], [1]])
    written = manifest(tmp_path)
    parts = verified_parts(tmp_path, written, command="mta embed")
    assert parts == [(tmp_path / p["file"], p) for p in written["parts"]]
    first = part_file(tmp_path, 0)
    first.write_bytes(b"changed")
    with pytest.raises(MtaError) as refused:
        verified_parts(tmp_path, written, command="mta embed")
    assert str(refused.value) == (
        f"{first} does not match the manifest's sha256: it was changed after `mta embed` wrote it; re-run "
        "`mta embed ... --force` into this or a new directory"
    )
    unchecked = {**written, "parts": [{**p, "sha256": None} for p in written["parts"]]}
    assert len(verified_parts(tmp_path, unchecked, command="mta embed")) == 2
    first.unlink()
    with pytest.raises(MtaError) as refused:
        verified_parts(tmp_path, unchecked, command="mta embed")
    assert str(refused.value) == f"{first} is listed in the manifest but missing; re-run `mta embed ... --force`"
