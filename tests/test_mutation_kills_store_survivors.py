"""What the store's tests left to mutation testing (bench/mutation.py) after the first kill tests
(tests/test_mutation_kills_store*.py): the directories a publish syncs, when a directory counts as
settled, which parts a shard's commit and a set's merge may delete (a published artefact stays
whole until a new set replaces it; the previous manifest's parts go wherever a cut-short publish
left them), the error a failed commit reports, the command a held shard names, the directory an
impossible upgrade names, chunked work that meets an undeletable leftover or chunks in another
column order, and the shard set an incomplete directory is described by. Every expectation is
the documented rule (the modules' docstrings, :mod:`mta.store`) on a hand-built directory."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fixtures.store import annotate_rows, listing, part, shard_file, stage
from mta.data import artefact_schema
from mta.data.annotations import read_annotations
from mta.data.artefact_schema import SCHEMA_V2, SCHEMA_VERSION, NotDerivable
from mta.errors import MtaError
from mta.store import publish
from mta.store.chunked_work import ChunkedShard
from mta.store.layout import META, STAGING, VERSION_KEY, staged_part
from mta.store.locks import shard_lock
from mta.store.manifests import incomplete_message, read_manifest
from mta.store.publish import PartWriter, commit_shard, finish_publishing, try_merge, writing_shard

STAGED = f"{META}/{STAGING}"


def published(out: Path, run: str = "k") -> list[str]:
    """A complete two-shard set of ``run`` committed into ``out``; its parts' names."""
    for shard in (0, 1):
        commit_shard(out, stage(out, shard, 2, run, [shard]))
    return [part(0, 2, run), part(1, 2, run)]


def parts_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.parquet")) if directory.is_dir() else []


# --- syncing and the settled fast path --------------------------------------------------------------


def test_merging_a_set_that_is_already_in_place_again_moves_nothing_and_syncs_nothing(tmp_path, monkeypatch):
    published(tmp_path)
    before = listing(tmp_path)
    synced: list[Path] = []
    monkeypatch.setattr(publish, "fsync_directory", synced.append)
    assert try_merge(tmp_path, "k", 2) == read_manifest(tmp_path)
    assert listing(tmp_path) == before and synced == []


def test_deleting_a_part_no_manifest_lists_is_synced_in_the_directory(tmp_path, monkeypatch):
    parts = published(tmp_path)
    (tmp_path / part(0, 3, "stray")).write_bytes(b"x")  # no manifest, no shard names it
    synced: list[Path] = []
    monkeypatch.setattr(publish, "fsync_directory", synced.append)
    finish_publishing(tmp_path)
    assert parts_in(tmp_path) == parts
    assert tmp_path in synced  # the deletion is made durable


def test_a_published_part_with_a_leftover_staged_copy_counts_as_settled_and_is_only_read(tmp_path, monkeypatch):
    parts = published(tmp_path)
    (tmp_path / STAGED / parts[0]).write_bytes(b"a leftover copy")  # nothing left to publish

    def no_lock(out_dir):
        raise AssertionError("a settled directory is only read")

    monkeypatch.setattr(publish, "merge_lock", no_lock)
    finish_publishing(tmp_path)
    assert parts_in(tmp_path) == parts and parts_in(tmp_path / STAGED) == [parts[0]]


# --- what a shard's commit deletes ------------------------------------------------------------------


def test_a_new_runs_first_shard_leaves_the_published_artefact_whole_until_its_set_is_complete(tmp_path):
    parts = published(tmp_path, "old")
    manifest = read_manifest(tmp_path)
    assert commit_shard(tmp_path, stage(tmp_path, 0, 2, "new", [7])) is None
    assert read_manifest(tmp_path) == manifest
    assert listing(tmp_path) == sorted(
        [f"{META}/manifest.json", shard_file(0, 2), shard_file(1, 2), *parts, f"{STAGED}/{part(0, 2, 'new')}"]
    )
    assert pq.read_table(tmp_path / parts[0]).column("id").to_pylist() == [0]


def test_a_shards_earlier_part_found_published_but_listed_by_no_manifest_goes_when_it_is_written_again(tmp_path):
    commit_shard(tmp_path, stage(tmp_path, 0, 2, "k", [0]))
    (tmp_path / STAGED / part(0, 2, "k")).rename(tmp_path / part(0, 2, "k"))  # published before its set was
    assert commit_shard(tmp_path, stage(tmp_path, 0, 2, "k", [0, 0], again="b")) is None
    assert listing(tmp_path) == sorted([f"{STAGED}/{part(0, 2, 'kb')}", shard_file(0, 2)])


def test_a_failed_shard_manifest_write_reports_that_failure_even_when_its_part_is_already_gone(tmp_path, monkeypatch):
    shard = stage(tmp_path, 0, 1, "k", [0])
    (tmp_path / STAGED / shard["part"]["file"]).unlink()

    def full(path, value):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(publish, "atomic_write_json", full)
    with pytest.raises(OSError) as failed:
        commit_shard(tmp_path, shard)
    assert failed.value.errno == 28  # the clean-up does not hide it


def test_the_replaced_part_a_cut_short_publish_left_staged_goes_with_the_new_manifest(tmp_path):
    published(tmp_path)
    # Cut short: the manifest lists shard 1's part, which was not yet moved out of staging.
    (tmp_path / part(1, 2, "k")).rename(tmp_path / STAGED / part(1, 2, "k"))
    manifest = commit_shard(tmp_path, stage(tmp_path, 1, 2, "k", [1, 1], again="b"))  # shard 1 again
    assert [p["file"] for p in manifest["parts"]] == [part(0, 2, "k"), part(1, 2, "kb")]
    assert listing(tmp_path) == sorted(
        [f"{META}/manifest.json", shard_file(0, 2), shard_file(1, 2), part(0, 2, "k"), part(1, 2, "kb")]
    )


def test_a_shard_another_writer_holds_is_refused_naming_this_writers_command(tmp_path):
    with shard_lock(tmp_path, 0, 1, command="mta embed"), pytest.raises(MtaError) as refused:
        with writing_shard(tmp_path, 0, 1, command="mta embed", kind="teacher-embeddings", warn=print):
            pass
    assert str(refused.value).startswith(f"another `mta embed` (pid {os.getpid()} ")


# --- reading ----------------------------------------------------------------------------------------


def test_an_upgrade_that_cannot_derive_a_column_names_this_directory_and_a_new_one_beside_it(tmp_path, monkeypatch):
    out = tmp_path / "annotations"
    path = staged_part(out, 0, 1, "v2")
    path.parent.mkdir(parents=True)
    with PartWriter(path, schema=SCHEMA_V2) as writer:
        writer.write(annotate_rows([0, 1], SCHEMA_V2))
        entry = writer.commit()
    description = {"input": {"path": "/data/in.jsonl"}, "teacher": {"name": "t"}, "student": {"name": "s"}}
    shard = {"shard": 0, "num_shards": 1, "run_key": "v2", VERSION_KEY: 2, "counts": {"rows": 2}}
    commit_shard(out, {**shard, "skipped_examples": [], "description": description, "part": entry})

    def step(manifest, table):
        raise NotDerivable("boundary_spans", "version 2 kept no character offsets")

    monkeypatch.setitem(artefact_schema.UPGRADES, 2, step)
    with pytest.raises(MtaError) as refused:
        read_annotations(out)
    message = str(refused.value)
    assert message.startswith(f"{out} holds annotate schema version 2, which lacks `boundary_spans`")
    assert "mta annotate /data/in.jsonl --teacher t --student s" in message
    assert f"-o {out}-v{SCHEMA_VERSION}`" in message


# --- chunked work -----------------------------------------------------------------------------------

CHUNK_SCHEMA = pa.schema([("id", pa.int64()), ("text", pa.string())])


def test_another_plans_work_that_cannot_be_wholly_deleted_does_not_stop_the_shard(tmp_path, monkeypatch):
    ChunkedShard(tmp_path, 0, 1, "old", CHUNK_SCHEMA).compute([[5]], lambda ids: pa.table({"id": ids, "text": ["x"]}))
    unlink = os.unlink

    def undeletable_chunk(path, *args, **kwargs):
        if str(path).endswith("chunk-00000.parquet"):
            raise PermissionError(13, "Permission denied", str(path))  # as a read-only file would (tests run as root)
        return unlink(path, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(os, "unlink", undeletable_chunk)
        work = ChunkedShard(tmp_path, 0, 1, "new", CHUNK_SCHEMA)
    assert work.done == {}
    assert work.compute([[0, 1]], lambda ids: pa.table({"id": ids, "text": ["a", "b"]})) == 2
    staged = tmp_path / STAGED / work.part(1)["file"]
    assert pq.read_table(staged).to_pydict() == {"id": [0, 1], "text": ["a", "b"]}


def test_chunks_in_another_column_order_or_a_narrower_type_are_read_back_in_the_shards_schema(tmp_path):
    def table_of(ids):  # the columns in the other order, the ids as int32
        return pa.table({"text": [f"row {i}" for i in ids], "id": pa.array(ids, pa.int32())})

    work = ChunkedShard(tmp_path, 0, 1, "plan", CHUNK_SCHEMA)
    work.compute([[0, 1], [2]], table_of)
    written = pq.read_table(tmp_path / STAGED / work.part(2)["file"])
    assert written.schema == CHUNK_SCHEMA
    assert written.to_pydict() == {"id": [0, 1, 2], "text": ["row 0", "row 1", "row 2"]}


# --- an incomplete directory ------------------------------------------------------------------------


def test_an_incomplete_directory_is_described_by_its_fullest_set_not_its_greatest_run_key(tmp_path):
    message = incomplete_message(tmp_path, {("a", 3): {0, 1}, ("b", 3): {2}})
    assert message.startswith(f"{tmp_path} is incomplete: 2 of 3 shards are written (missing: 2). ")
