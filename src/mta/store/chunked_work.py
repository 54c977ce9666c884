"""A shard computed chunk by chunk, so a killed writer redoes at most one chunk.

``mta embed`` and ``mta teacher`` run a model over a shard's rows: hours on a large set. Each
finished chunk is a Parquet file in ``.mta/work/shard-IIIII-of-NNNNN/``, written atomically and
then journalled (``journal.jsonl``: plan key, chunk, rows, sha256). A re-run of the same plan
skips the journalled chunks whose files still match; a plan made with other settings (another
key) is discarded whole. When every chunk is there they are streamed into the shard's one part
(:class:`mta.store.publish.PartWriter`, in staging), which the writer commits as annotate commits
a shard; then the work directory is removed.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from mta.files import Journal, atomic_path, disk_full_is_reported, read_jsonl_lenient
from mta.hashing import file_sha256
from mta.store.layout import META, staged_part, staging_directory
from mta.store.publish import PartWriter

__all__ = ["WORK", "ChunkedShard", "work_directory"]

WORK = "work"
T = TypeVar("T")


def work_directory(out_dir: Path, shard: int, num_shards: int) -> Path:
    return out_dir / META / WORK / f"shard-{shard:05d}-of-{num_shards:05d}"


def _chunk_name(chunk: int) -> str:
    return f"chunk-{chunk:05d}.parquet"


class ChunkedShard:
    """Shard ``shard``/``num_shards`` of ``out_dir`` under plan ``plan_key`` (a hash of whatever
    decides the chunks' content and order), its chunks in ``schema``."""

    def __init__(self, out_dir: Path, shard: int, num_shards: int, plan_key: str, schema: pa.Schema):
        self.out_dir, self.shard, self.num_shards = out_dir, shard, num_shards
        self.plan_key, self.schema = plan_key, schema
        self.work = work_directory(out_dir, shard, num_shards)
        self.done = self._finished() if self.work.is_dir() else {}
        if not self.done and self.work.exists():
            shutil.rmtree(self.work, ignore_errors=True)  # another plan's chunks: nothing to keep
        self.work.mkdir(parents=True, exist_ok=True)

    @property
    def resumed_rows(self) -> int:
        """Rows an earlier, killed run of this plan finished."""
        return sum(entry["rows"] for entry in self.done.values())

    def _finished(self) -> dict[int, dict[str, Any]]:
        done = {}
        for entry in read_jsonl_lenient(self.work / "journal.jsonl"):
            if entry.get("plan") != self.plan_key or type(entry.get("chunk")) is not int:
                continue
            path = self.work / _chunk_name(entry["chunk"])
            if path.is_file() and file_sha256(path) == entry.get("sha256"):
                done[entry["chunk"]] = entry
        return done

    def compute(self, chunks: Sequence[T], table_of: Callable[[T], pa.Table], *, compression: str = "zstd") -> int:
        """``table_of`` each chunk that is not done yet, in order; each table is written and
        journalled before the next starts. Returns the rows computed by this call."""
        computed = 0
        with Journal(self.work / "journal.jsonl", inside=self.out_dir) as journal:
            for number, chunk in enumerate(chunks):
                if number in self.done:
                    continue
                table = table_of(chunk)
                path = self.work / _chunk_name(number)
                with disk_full_is_reported(path), atomic_path(path) as temporary:
                    pq.write_table(table, temporary, compression=compression)
                entry = {"plan": self.plan_key, "chunk": number, "rows": table.num_rows, "sha256": file_sha256(path)}
                journal.append([entry])
                self.done[number] = entry
                computed += table.num_rows
        return computed

    def part(self, chunks: int, *, row_group_rows: int = 2048, compression: str = "zstd") -> dict[str, Any]:
        """Stream chunks ``0 .. chunks − 1`` into the shard's part, in staging; its manifest entry."""
        part = staged_part(self.out_dir, self.shard, self.num_shards, secrets.token_hex(4))
        with (
            disk_full_is_reported(part),
            PartWriter(part, row_group_rows=row_group_rows, schema=self.schema, compression=compression) as writer,
        ):
            for number in range(chunks):
                for batch in pq.read_table(self.work / _chunk_name(number), schema=self.schema).to_batches(
                    max_chunksize=row_group_rows
                ):
                    writer.write(batch)
            return writer.commit()

    def remove(self) -> None:
        """The work directory, after the shard is committed (and its parents when empty)."""
        shutil.rmtree(self.work, ignore_errors=True)
        for empty in (self.work.parent, staging_directory(self.out_dir)):
            try:
                empty.rmdir()  # only when no other shard's work is in it
            except OSError:
                pass
