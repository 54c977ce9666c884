"""Publishing shards, merging sets and the reuse rule (mta.store.publish, mta.store.reuse) on a
store of small generic tables: which files exist after each step, and what each refusal says.
What mutation testing (bench/mutation.py) found the annotate tests (spaCy, minutes) leave
unchecked."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fixtures.store import ID_SCHEMA, listing, part, row_groups, shard_file, stage
from mta.errors import MtaError
from mta.store.layout import LAYOUT_KEY, LAYOUT_VERSION, META, STAGING, VERSION_KEY, manifest_path, staged_part
from mta.store.manifests import read_manifest
from mta.store.publish import (
    PartWriter,
    commit_shard,
    finish_publishing,
    merge_shards,
    merged_manifest,
    try_merge,
    writing_shard,
)
from mta.store.reuse import ReusableOutput, reusable_output

# --- commit and merge -------------------------------------------------------------------------------

ANNOTATE = {"kind": "test", "command": "mta test"}  # the kind the shards here name


def test_a_shard_is_held_in_staging_until_its_set_is_complete_then_all_parts_are_published(tmp_path):
    assert commit_shard(tmp_path, stage(tmp_path, 1, 2, "k", [2, 3])) is None
    assert listing(tmp_path) == sorted([f"{META}/{STAGING}/{part(1, 2, 'k')}", shard_file(1, 2)])
    manifest = commit_shard(tmp_path, stage(tmp_path, 0, 2, "k", [0, 1]))
    assert manifest == read_manifest(tmp_path)
    assert listing(tmp_path) == sorted(
        [f"{META}/manifest.json", shard_file(0, 2), shard_file(1, 2), part(0, 2, "k"), part(1, 2, "k")]
    )
    assert pq.read_table(tmp_path / part(1, 2, "k")).column("id").to_pylist() == [2, 3]


def test_the_merged_manifest_sums_counts_keeps_the_shards_order_and_version_and_todays_layout(tmp_path):
    shards = [stage(tmp_path, i, 3, "k", list(range(i + 1))) for i in (2, 0, 1)]
    manifest = merged_manifest(shards)
    assert manifest == {
        VERSION_KEY: 3,
        LAYOUT_KEY: LAYOUT_VERSION,
        "artefact": "test",
        "run_key": "k",
        "rows": 6,
        "skipped": {"empty": 3},
        "skipped_examples": ["shard 0 skipped a row", "shard 1 skipped a row", "shard 2 skipped a row"],
        "num_shards": 3,
        "parts": [shards[1]["part"], shards[2]["part"], shards[0]["part"]],
    }


def test_a_shard_written_again_replaces_its_earlier_part_and_orphans_go(tmp_path):
    commit_shard(tmp_path, stage(tmp_path, 0, 2, "k", [0]))
    orphan = staged_part(tmp_path, 0, 2, "killed")  # a killed writer's part of the same shard
    orphan.write_bytes(b"x")
    other = staged_part(tmp_path, 1, 2, "killed")  # another shard's: not this commit's to delete
    other.write_bytes(b"x")
    commit_shard(tmp_path, stage(tmp_path, 0, 2, "k2", [0, 1]))
    assert listing(tmp_path) == sorted(
        [f"{META}/{STAGING}/{part(0, 2, 'k2')}", f"{META}/{STAGING}/{part(1, 2, 'killed')}", shard_file(0, 2)]
    )


def test_a_shard_written_again_after_its_set_was_published_replaces_the_published_part(tmp_path):
    for shard in (0, 1):
        commit_shard(tmp_path, stage(tmp_path, shard, 2, "k", [shard]))
    manifest = commit_shard(tmp_path, stage(tmp_path, 1, 2, "k", [1, 1], again="b"))  # the same run, again
    files = [p["file"] for p in manifest["parts"]]
    assert files == [part(0, 2, "k"), part(1, 2, "kb")] and manifest["rows"] == 3
    assert [p for p in listing(tmp_path) if p.endswith(".parquet")] == files
    assert pq.read_table(tmp_path / part(1, 2, "kb")).column("id").to_pylist() == [1, 1]


def test_a_new_run_that_completes_its_set_removes_the_previous_artefacts_parts_and_shards(tmp_path):
    for shard in (0, 1):
        commit_shard(tmp_path, stage(tmp_path, shard, 2, "old", [shard]))
    commit_shard(tmp_path, stage(tmp_path, 0, 1, "new", [7]))
    assert listing(tmp_path) == sorted([f"{META}/manifest.json", shard_file(0, 1), part(0, 1, "new")])
    assert read_manifest(tmp_path)["run_key"] == "new"


def test_a_failed_shard_manifest_write_deletes_the_new_part_and_leaves_the_rest(tmp_path, monkeypatch):
    from mta.store import publish

    commit_shard(tmp_path, stage(tmp_path, 0, 2, "k", [0]))
    before = listing(tmp_path)
    shard = stage(tmp_path, 1, 2, "k", [1])

    def full(path, value):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(publish, "atomic_write_json", full)
    with pytest.raises(OSError):
        commit_shard(tmp_path, shard)
    assert listing(tmp_path) == before


def test_try_merge_writes_the_manifest_only_for_a_complete_set_of_that_key_and_size(tmp_path):
    for shard in (0, 1):
        stage(tmp_path, shard, 2, "k", [shard])
    commit_shard(tmp_path, stage(tmp_path, 0, 2, "k", [0]))
    assert try_merge(tmp_path, "k", 2) is None and try_merge(tmp_path, "other", 2) is None
    (tmp_path / shard_file(1, 2)).write_text(json.dumps(stage(tmp_path, 1, 2, "k", [1])), encoding="utf-8")
    assert try_merge(tmp_path, "k", 3) is None
    assert try_merge(tmp_path, "k", 2)["num_shards"] == 2
    assert manifest_path(tmp_path).is_file()


def test_merge_shards_merges_a_complete_set_and_refuses_a_missing_directory_or_no_shards(tmp_path):
    with pytest.raises(MtaError) as refused:
        merge_shards(tmp_path / "absent")
    assert (
        str(refused.value) == f"--merge {tmp_path / 'absent'}: no such directory; give the -o directory of the shards"
    )
    with pytest.raises(MtaError) as refused:
        merge_shards(tmp_path)
    assert str(refused.value) == f"{tmp_path} holds no shard manifests ({META}/shard-*-of-*.json); nothing to merge"
    shards = [stage(tmp_path, shard, 3, "k", [shard]) for shard in range(3)]
    commit_shard(tmp_path, shards[0])
    with pytest.raises(MtaError) as refused:
        merge_shards(str(tmp_path))
    assert str(refused.value).startswith(f"{tmp_path} is incomplete: 1 of 3 shards are written (missing: 1, 2)")
    for shard in shards[1:]:  # written without merging (a shard whose merge was cut short)
        (tmp_path / shard_file(shard["shard"], 3)).write_text(json.dumps(shard), encoding="utf-8")
    manifest = merge_shards(str(tmp_path))
    assert manifest == read_manifest(tmp_path) and manifest["rows"] == 3
    assert [p for p in listing(tmp_path) if p.endswith(".parquet")] == [part(i, 3, "k") for i in range(3)]


# --- finishing an interrupted publish ---------------------------------------------------------------


def test_a_publish_cut_short_is_finished_and_unlisted_parts_go(tmp_path):
    for shard in (0, 1):
        commit_shard(tmp_path, stage(tmp_path, shard, 2, "k", [shard]))
    # Cut short: one listed part back in staging, and a part no manifest lists.
    (tmp_path / part(1, 2, "k")).rename(tmp_path / META / STAGING / part(1, 2, "k"))
    (tmp_path / part(0, 3, "stray")).write_bytes(b"x")
    finish_publishing(tmp_path)
    assert [p for p in listing(tmp_path) if p.endswith(".parquet")] == [part(0, 2, "k"), part(1, 2, "k")]
    settled = listing(tmp_path)
    finish_publishing(tmp_path)  # settled: nothing changes
    assert listing(tmp_path) == settled
    finish_publishing(tmp_path / "absent")


def test_a_part_no_manifest_lists_but_a_shard_names_goes_back_to_staging(tmp_path):
    commit_shard(tmp_path, stage(tmp_path, 0, 2, "k", [0]))
    staged = tmp_path / META / STAGING / part(0, 2, "k")
    staged.rename(tmp_path / part(0, 2, "k"))  # published before its set was complete
    finish_publishing(tmp_path)
    assert staged.is_file() and not (tmp_path / part(0, 2, "k")).exists()


def with_legacy_manifest(out: Path) -> dict:
    """A complete two-shard directory with its manifest also beside the parts, as layout 1 has
    it (no layout key); that manifest."""
    for shard in (0, 1):
        commit_shard(out, stage(out, shard, 2, "k", [shard]))
    legacy = {key: value for key, value in read_manifest(out).items() if key != LAYOUT_KEY}
    (out / "manifest.json").write_text(json.dumps(legacy), encoding="utf-8")
    return legacy


def test_a_layout_1_directory_is_adopted_in_place(tmp_path):
    legacy = with_legacy_manifest(tmp_path)
    for shard in (0, 1):
        (tmp_path / shard_file(shard, 2)).rename(tmp_path / f"shard-{shard:05d}-of-00002.json")
    manifest_path(tmp_path).unlink()
    finish_publishing(tmp_path)
    assert read_manifest(tmp_path) == {**legacy, LAYOUT_KEY: LAYOUT_VERSION}
    assert listing(tmp_path) == sorted(
        [f"{META}/manifest.json", shard_file(0, 2), shard_file(1, 2), part(0, 2, "k"), part(1, 2, "k")]
    )


# --- the writer's context ---------------------------------------------------------------------------


def test_writing_a_shard_makes_the_directory_and_removes_it_again_when_the_first_run_fails(tmp_path):
    out = tmp_path / "out"
    with (
        pytest.raises(RuntimeError),
        writing_shard(out, 0, 1, command="mta embed", kind="teacher-embeddings", warn=print),
    ):
        assert out.is_dir()
        raise RuntimeError
    assert not out.exists()
    out.mkdir()
    with (
        pytest.raises(RuntimeError),
        writing_shard(out, 0, 1, command="mta embed", kind="teacher-embeddings", warn=print),
    ):
        raise RuntimeError
    assert out.is_dir()  # not made by this call: left


def test_a_filesystem_without_locks_is_warned_about_naming_the_command(tmp_path, monkeypatch):
    from contextlib import contextmanager

    from mta.store import locks

    @contextmanager
    def no_locks(path, wait_s, **options):
        yield f"{path}: this filesystem has no locks"

    monkeypatch.setattr(locks, "exclusive_lock", no_locks)
    warnings = []
    with writing_shard(tmp_path, 0, 1, command="mta teacher", kind="teacher-outputs", warn=warnings.append):
        pass
    lock = tmp_path / META / ".lock-shard-00000-of-00001"
    assert warnings == [f"{lock}: this filesystem has no locks: make sure no other `mta teacher` writes this shard"]


# --- reuse ------------------------------------------------------------------------------------------


def test_a_complete_directory_of_the_same_key_is_reused_whole(tmp_path):
    assert reusable_output(tmp_path / "absent", "k", 0, 2, **ANNOTATE) is None
    for shard in (0, 1):
        commit_shard(tmp_path, stage(tmp_path, shard, 2, "k", [shard]))
    assert reusable_output(tmp_path, "k", 1, 2, **ANNOTATE) == ReusableOutput(read_manifest(tmp_path), {})
    assert reusable_output(tmp_path, "other", 1, 2, **ANNOTATE) is None
    assert reusable_output(tmp_path, "k", 0, 2, **ANNOTATE) == ReusableOutput(read_manifest(tmp_path), {})
    (tmp_path / part(1, 2, "k")).write_bytes(b"changed")  # neither the set nor shard 1 is intact now
    assert reusable_output(tmp_path, "k", 1, 2, **ANNOTATE) is None


def read_shard(out: Path, shard: int, num_shards: int) -> dict:
    return json.loads((out / shard_file(shard, num_shards)).read_text(encoding="utf-8"))


def test_this_shards_own_part_of_the_same_key_is_reused_and_merged_when_the_set_is_complete(tmp_path):
    commit_shard(tmp_path, stage(tmp_path, 0, 2, "k", [0]))
    assert reusable_output(tmp_path, "k", 0, 2, **ANNOTATE) == ReusableOutput(None, read_shard(tmp_path, 0, 2))
    assert reusable_output(tmp_path, "k", 1, 2, **ANNOTATE) is None  # shard 1 is not written yet
    assert reusable_output(tmp_path, "other", 0, 2, **ANNOTATE) is None
    one = stage(tmp_path, 1, 2, "k", [1])
    (tmp_path / shard_file(1, 2)).write_text(json.dumps(one), encoding="utf-8")  # a merge cut short
    reused = reusable_output(tmp_path, "k", 1, 2, **ANNOTATE)
    assert reused == ReusableOutput(read_manifest(tmp_path), one) and reused.manifest["num_shards"] == 2
    staged = tmp_path / META / STAGING / part(0, 2, "k2")
    commit_shard(tmp_path, stage(tmp_path, 0, 2, "k2", [0]))
    staged.write_bytes(b"changed")
    assert reusable_output(tmp_path, "k2", 0, 2, **ANNOTATE) is None  # its part no longer matches its sha256


# --- row groups, syncing and the settled fast path --------------------------------------------------


def test_a_row_group_closes_at_exactly_its_size_and_the_default_size_is_2048(tmp_path):
    with PartWriter(tmp_path / "three.parquet", row_group_rows=3, schema=ID_SCHEMA) as writer:
        for first in (0, 3):
            writer.write(pa.record_batch([pa.array(range(first, first + 3), pa.int64())], schema=ID_SCHEMA))
        writer.commit()
    assert row_groups(tmp_path / "three.parquet") == [3, 3]
    with PartWriter(tmp_path / "default.parquet", schema=ID_SCHEMA) as writer:
        for rows in (1024, 1024, 1):
            writer.write(pa.record_batch([pa.array(range(rows), pa.int64())], schema=ID_SCHEMA))
        writer.commit()
    assert row_groups(tmp_path / "default.parquet") == [2048, 1]


def test_finishing_a_publish_syncs_the_directories_it_changed_and_a_settled_one_is_only_read(tmp_path, monkeypatch):
    from mta.store import publish

    for shard in (0, 1):
        commit_shard(tmp_path, stage(tmp_path, shard, 2, "k", [shard]))
    synced = []
    monkeypatch.setattr(publish, "fsync_directory", synced.append)

    def no_lock(out_dir):
        raise AssertionError("a settled directory is only read")

    monkeypatch.setattr(publish, "merge_lock", no_lock)
    finish_publishing(tmp_path)  # settled: no lock, nothing synced
    assert synced == []
    monkeypatch.undo()
    monkeypatch.setattr(publish, "fsync_directory", synced.append)
    (tmp_path / part(1, 2, "k")).rename(tmp_path / META / STAGING / part(1, 2, "k"))
    finish_publishing(tmp_path)
    assert synced == [tmp_path, tmp_path / META / STAGING]


def test_a_published_part_is_never_replaced_by_a_staged_copy_of_the_same_name(tmp_path):
    for shard in (0, 1):
        commit_shard(tmp_path, stage(tmp_path, shard, 2, "k", [shard]))
    published = (tmp_path / part(0, 2, "k")).read_bytes()
    (tmp_path / META / STAGING / part(0, 2, "k")).write_bytes(b"a leftover copy")
    (tmp_path / part(1, 2, "k")).rename(tmp_path / META / STAGING / part(1, 2, "k"))  # something to finish
    finish_publishing(tmp_path)
    assert (tmp_path / part(0, 2, "k")).read_bytes() == published


def test_a_layout_1_manifest_without_shard_files_and_shard_files_alone_are_adopted(tmp_path):
    legacy = with_legacy_manifest(tmp_path)
    manifest_path(tmp_path).unlink()
    finish_publishing(tmp_path)
    assert read_manifest(tmp_path) == {**legacy, LAYOUT_KEY: LAYOUT_VERSION}
    assert not (tmp_path / "manifest.json").exists()
    (tmp_path / shard_file(1, 2)).rename(tmp_path / "shard-00001-of-00002.json")  # a legacy shard file alone
    finish_publishing(tmp_path)
    assert (tmp_path / shard_file(1, 2)).is_file() and not (tmp_path / "shard-00001-of-00002.json").exists()
