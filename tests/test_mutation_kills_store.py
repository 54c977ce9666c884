"""The store's chunked work, part writer, locks and reuse rule, tested on their own with small
Parquet tables (no model, no spaCy): what mutation testing (bench/mutation.py) found reached only
by the slow stage tests, or not at all."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fixtures.store import row_groups
from mta.errors import MtaError
from mta.files import exclusive_lock
from mta.hashing import file_sha256
from mta.store import chunked_work
from mta.store.chunked_work import ChunkedShard, work_directory
from mta.store.layout import META, STAGING
from mta.store.locks import merge_lock, shard_lock
from mta.store.publish import PartWriter

HOLDER = f"pid {os.getpid()} on {socket.gethostname()}"
SCHEMA = pa.schema([("id", pa.int64()), ("text", pa.string())])


def table(first: int, rows: int) -> pa.Table:
    return pa.table({"id": list(range(first, first + rows)), "text": [f"row {i}" for i in range(first, first + rows)]})


class Counting:
    """``table_of`` for chunks given as ``(first id, rows)``, counting its calls."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def __call__(self, chunk: tuple[int, int]) -> pa.Table:
        self.calls.append(chunk)
        return table(*chunk)


CHUNKS = [(0, 3), (3, 2), (5, 4)]


def journal(shard: ChunkedShard) -> list[dict]:
    return [json.loads(line) for line in (shard.work / "journal.jsonl").read_text(encoding="utf-8").splitlines()]


# --- chunked work -----------------------------------------------------------------------------------


def test_the_work_directory_is_named_by_shard_and_set_under_the_meta_directory(tmp_path):
    assert work_directory(tmp_path, 1, 12) == tmp_path / META / "work" / "shard-00001-of-00012"
    shard = ChunkedShard(tmp_path, 1, 12, "plan", SCHEMA)
    assert shard.work == work_directory(tmp_path, 1, 12) and shard.work.is_dir()
    assert shard.done == {} and shard.resumed_rows == 0


def test_each_chunk_is_written_and_journalled_with_its_plan_rows_and_sha256(tmp_path):
    shard = ChunkedShard(tmp_path, 0, 1, "plan-a", SCHEMA)
    table_of = Counting()
    assert shard.compute(CHUNKS, table_of) == 9 and table_of.calls == CHUNKS
    files = [shard.work / f"chunk-{n:05d}.parquet" for n in range(3)]
    assert journal(shard) == [
        {"plan": "plan-a", "chunk": n, "rows": rows, "sha256": file_sha256(files[n])}
        for n, (_, rows) in enumerate(CHUNKS)
    ]
    for path, (first, rows) in zip(files, CHUNKS, strict=True):
        assert pq.read_table(path).equals(table(first, rows))
        assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
    assert sorted(shard.done) == [0, 1, 2]


def test_a_chunks_codec_is_the_one_asked_for(tmp_path):
    shard = ChunkedShard(tmp_path, 0, 1, "plan", SCHEMA)
    shard.compute(CHUNKS[:1], Counting(), compression="snappy")
    assert pq.ParquetFile(shard.work / "chunk-00000.parquet").metadata.row_group(0).column(0).compression == "SNAPPY"


def test_a_rerun_of_the_same_plan_computes_only_the_chunks_not_journalled(tmp_path):
    first = ChunkedShard(tmp_path, 0, 2, "plan", SCHEMA)
    first.compute(CHUNKS[:2], Counting())  # killed after two chunks
    again = ChunkedShard(tmp_path, 0, 2, "plan", SCHEMA)
    assert sorted(again.done) == [0, 1] and again.resumed_rows == 5
    table_of = Counting()
    assert again.compute(CHUNKS, table_of) == 4 and table_of.calls == [CHUNKS[2]]
    assert [entry["chunk"] for entry in journal(again)] == [0, 1, 2]


def test_a_chunk_whose_file_changed_or_went_is_computed_again(tmp_path):
    ChunkedShard(tmp_path, 0, 1, "plan", SCHEMA).compute(CHUNKS, Counting())
    work = work_directory(tmp_path, 0, 1)
    pq.write_table(table(100, 3), work / "chunk-00000.parquet")  # same rows, other content
    (work / "chunk-00002.parquet").unlink()
    again = ChunkedShard(tmp_path, 0, 1, "plan", SCHEMA)
    assert sorted(again.done) == [1] and again.resumed_rows == 2
    table_of = Counting()
    assert again.compute(CHUNKS, table_of) == 7 and table_of.calls == [CHUNKS[0], CHUNKS[2]]


def test_another_plans_work_is_discarded_whole(tmp_path):
    ChunkedShard(tmp_path, 0, 1, "old", SCHEMA).compute(CHUNKS, Counting())
    work = work_directory(tmp_path, 0, 1)
    (work / "stray.txt").write_text("x", encoding="utf-8")
    shard = ChunkedShard(tmp_path, 0, 1, "new", SCHEMA)
    assert shard.done == {} and sorted(p.name for p in work.iterdir()) == []
    table_of = Counting()
    assert shard.compute(CHUNKS, table_of) == 9 and table_of.calls == CHUNKS


def test_journal_entries_without_an_integer_chunk_are_passed_over(tmp_path):
    shard = ChunkedShard(tmp_path, 0, 1, "plan", SCHEMA)
    shard.compute(CHUNKS[:1], Counting())
    entry = journal(shard)[0]
    lines = [{**entry, "chunk": "0"}, {**entry, "chunk": True}, {**entry, "plan": "other"}, entry]
    (shard.work / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines), encoding="utf-8")
    again = ChunkedShard(tmp_path, 0, 1, "plan", SCHEMA)
    assert again.done == {0: entry}


def test_the_part_streams_every_chunk_in_order_into_staging_in_row_groups(tmp_path):
    shard = ChunkedShard(tmp_path, 0, 1, "plan", SCHEMA)
    shard.compute(CHUNKS, Counting())
    entry = shard.part(3, row_group_rows=4)
    staged = tmp_path / META / STAGING / entry["file"]
    assert entry == {"file": staged.name, "rows": 9, "sha256": file_sha256(staged)}
    assert staged.name.startswith("part-00000-of-00001-")
    assert pq.read_table(staged).equals(table(0, 9))
    metadata = pq.ParquetFile(staged).metadata
    assert [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)] == [5, 4]  # 3 + 2, then 4
    assert metadata.row_group(0).column(0).compression == "ZSTD"
    assert pq.read_table(tmp_path / META / STAGING / shard.part(2, compression="none")["file"]).equals(table(0, 5))


def test_removing_the_work_keeps_the_parents_another_shard_still_uses(tmp_path):
    mine, other = ChunkedShard(tmp_path, 0, 2, "plan", SCHEMA), ChunkedShard(tmp_path, 1, 2, "plan", SCHEMA)
    (tmp_path / META / STAGING).mkdir()
    mine.remove()
    assert not mine.work.exists() and other.work.is_dir()
    other.remove()
    assert not (tmp_path / META / "work").exists() and not (tmp_path / META / STAGING).exists()
    assert (tmp_path / META).is_dir()


def test_a_chunk_loop_killed_mid_write_leaves_no_chunk_and_no_entry(tmp_path, monkeypatch):
    shard = ChunkedShard(tmp_path, 0, 1, "plan", SCHEMA)

    def broken(chunk):
        if chunk == CHUNKS[1]:
            raise KeyboardInterrupt
        return table(*chunk)

    with pytest.raises(KeyboardInterrupt):
        shard.compute(CHUNKS, broken)
    assert sorted(p.name for p in shard.work.iterdir()) == ["chunk-00000.parquet", "journal.jsonl"]
    assert [entry["chunk"] for entry in journal(shard)] == [0]
    assert chunked_work.WORK == "work"


# --- the part writer --------------------------------------------------------------------------------


def test_the_part_writer_buffers_into_row_groups_and_counts_rows(tmp_path):
    path = tmp_path / "part.parquet"
    with PartWriter(path, row_group_rows=3, schema=SCHEMA) as writer:
        for first in range(0, 8, 2):
            writer.write(table(first, 2).to_batches()[0])
            assert writer.rows == first + 2
        entry = writer.commit()
    assert entry == {"file": "part.parquet", "rows": 8, "sha256": file_sha256(path)}
    metadata = pq.ParquetFile(path).metadata
    assert [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)] == [4, 4]
    assert pq.read_table(path).equals(table(0, 8))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part.parquet"]


def test_a_part_writer_left_without_commit_leaves_nothing(tmp_path):
    path = tmp_path / "part.parquet"
    with pytest.raises(RuntimeError), PartWriter(path, schema=SCHEMA) as writer:
        writer.write(table(0, 2).to_batches()[0])
        raise RuntimeError
    assert list(tmp_path.iterdir()) == []
    writer = PartWriter(path, schema=SCHEMA)
    writer.abort()
    writer.abort()  # twice: the writer is already closed, nothing is raised
    assert list(tmp_path.iterdir()) == []


# --- locks ------------------------------------------------------------------------------------------


def test_a_held_shard_lock_is_refused_at_once_naming_the_command_the_shard_and_the_holder(tmp_path):
    with shard_lock(tmp_path, 1, 4, command="mta embed") as unsupported:
        assert unsupported is None
        with pytest.raises(MtaError) as refused:
            with shard_lock(tmp_path, 1, 4, command="mta embed"):
                pass
        with shard_lock(tmp_path, 2, 4):  # another shard: side by side
            pass
    message = str(refused.value)
    lock = tmp_path / META / ".lock-shard-00001-of-00004"
    assert message == (
        f"another `mta embed` ({HOLDER}) is writing shard 1/4 of {tmp_path} (it holds {lock}); "
        "wait for it to finish or stop it, then re-run. Other shards (--shard I/N) may run side by "
        "side; the same shard may not"
    )
    with shard_lock(tmp_path, 0, 1), pytest.raises(MtaError) as refused:
        with shard_lock(tmp_path, 0, 1):
            pass
    assert str(refused.value).startswith(f"another `mta annotate` ({HOLDER}) is writing {tmp_path} (it")


def test_a_lock_in_a_missing_or_read_only_directory_names_the_fix(tmp_path, monkeypatch):
    with pytest.raises(MtaError) as refused:
        with shard_lock(tmp_path / "absent", 0, 1):
            pass
    assert str(refused.value) == f"{tmp_path / 'absent'} does not exist; give the -o directory of `mta annotate`"

    def read_only(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)  # as a read-only directory would (tests may run as root)
    with pytest.raises(MtaError) as refused:
        with merge_lock(tmp_path):
            pass
    assert str(refused.value) == (
        f"cannot create {tmp_path / META}: Permission denied; the output must be a directory this user can write"
    )


def test_a_stuck_merge_lock_is_refused_after_the_wait_naming_the_holder(tmp_path, monkeypatch):
    from mta.store import locks

    monkeypatch.setattr(locks, "MERGE_LOCK_WAIT_S", 0.2)
    (tmp_path / META).mkdir()
    path = tmp_path / META / ".lock-merge"
    with exclusive_lock(path, wait_s=0), pytest.raises(MtaError) as refused:
        with merge_lock(tmp_path):
            pass
    assert str(refused.value) == (
        f"{path} has been held by {HOLDER} for over 0 s while it merges shards; if that process "
        "is stuck, stop it and re-run (the lock is released when it exits)"
    )


def test_the_done_chunks_are_the_journals_entries_and_removing_twice_is_harmless(tmp_path):
    shard = ChunkedShard(tmp_path, 0, 1, "plan", SCHEMA)
    shard.compute(CHUNKS, Counting())
    assert shard.done == {entry["chunk"]: entry for entry in journal(shard)}
    shard.remove()
    shard.remove()  # already gone: nothing raised
    assert not shard.work.exists()


def test_the_part_is_named_with_a_fresh_tag_and_batches_of_at_most_a_row_group(tmp_path):
    import re

    shard = ChunkedShard(tmp_path, 0, 1, "plan", SCHEMA)
    shard.compute([(0, 1024), (1024, 1024), (2048, 1), (2049, 3000)], Counting())
    entry = shard.part(3)  # the default row group: 2048 rows
    assert re.fullmatch(r"part-00000-of-00001-[0-9a-f]{8}\.parquet", entry["file"])
    assert row_groups(tmp_path / META / STAGING / entry["file"]) == [2048, 1]
    other = shard.part(4, row_group_rows=1024, compression="none")
    assert other["file"] != entry["file"]
    path = tmp_path / META / STAGING / other["file"]
    assert row_groups(path) == [1024, 1024, 1025, 1024, 952]  # chunk 3 read 1024 rows at a time
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "UNCOMPRESSED"


def test_a_full_disk_while_writing_a_chunk_or_the_part_names_the_file(tmp_path, monkeypatch):
    import errno

    shard = ChunkedShard(tmp_path, 0, 1, "plan", SCHEMA)
    shard.compute(CHUNKS[:1], Counting())

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(chunked_work.pq, "write_table", full)
    with pytest.raises(MtaError, match=rf"^.*{shard.work / 'chunk-00001.parquet'}"):
        shard.compute(CHUNKS, Counting())
    monkeypatch.undo()
    monkeypatch.setattr(PartWriter, "write", full)
    with pytest.raises(MtaError) as refused:
        shard.part(1)
    assert str(tmp_path / META / STAGING / "part-00000-of-00001-") in str(refused.value)
