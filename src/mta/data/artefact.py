"""The annotate artefact: Parquet parts, shard manifests and ``manifest.json``.

Layout of an output directory::

    manifest.json                               written last: the directory is complete
    shard-00000-of-00002.json                   one per shard: its counts and its part
    part-00000-of-00002-<run>.parquet           the rows of shard 0 (ids 0, 2, 4, ...)
    part-00001-of-00002-<run>.parquet

Every file is written atomically (``mta.files``: a hidden temporary name in the same directory,
fsync, rename), so a crash never leaves a half-written file under a real name. ``manifest.json`` lists the parts
it describes by name; a re-run writes parts under a new ``<run>`` name and deletes the old ones
only after the new manifest is in place, so until then the previous artefact stays whole.
``manifest.json`` appears only when every shard of a set (same run key, same shard count) has
written its shard manifest; readers refuse a directory without it. A killed process may leave a
hidden ``.*.tmp`` file behind: nothing reads it (Parquet readers skip dot files), and it is not
removed automatically because a concurrent shard could be writing it.

The columns, the schema version and the reading of older versions live in
:mod:`mta.data.artefact_schema`; this module writes the current version and lays out the files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mta.data.artefact_schema import (
    SCHEMA,
    SCHEMAS,
    SPAN,
    VERSION_KEY,
    conform,
    stored_version,
    upgrade_to_current,
)
from mta.errors import MtaError
from mta.files import atomic_write_json, publish, temporary_beside
from mta.hashing import file_sha256

__all__ = [
    "MANIFEST", "Annotations", "PartWriter", "commit_shard", "merge_shards",
    "part_name", "read_annotations", "read_manifest", "read_shard_manifest", "try_merge",
]

MANIFEST = "manifest.json"
MAX_SKIPPED_EXAMPLES = 20  # skipped-row messages kept in the manifest, so users can find them

_SHARD_FILE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.json$")


def shard_manifest_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}.json"


def part_name(shard: int, num_shards: int, run: str) -> str:
    return f"part-{shard:05d}-of-{num_shards:05d}-{run}.parquet"


class PartWriter:
    """Stream record batches into one Parquet part, renamed into place by :meth:`commit`.

    Batches are buffered into row groups of about ``row_group_rows`` rows. If the writer is
    closed without ``commit`` (an exception, Ctrl-C), the temporary file is deleted.
    """

    def __init__(self, path: Path, row_group_rows: int = 2048):
        self.path = path
        self.rows = 0
        self._row_group_rows = row_group_rows
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._temporary = temporary_beside(path)
        self._writer = pq.ParquetWriter(self._temporary, SCHEMA, compression="zstd")

    def write(self, batch: pa.RecordBatch) -> None:
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        self.rows += batch.num_rows
        if self._pending_rows >= self._row_group_rows:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._writer.write_table(pa.Table.from_batches(self._pending, schema=SCHEMA))
            self._pending, self._pending_rows = [], 0

    def commit(self) -> dict[str, Any]:
        """Close and rename into place; return the part's entry for the manifest."""
        self._flush()
        self._writer.close()
        digest = file_sha256(self._temporary)
        publish(self._temporary, self.path)
        return {"file": self.path.name, "rows": self.rows, "sha256": digest}

    def abort(self) -> None:
        """Drop the temporary file; nothing appears under the part's real name."""
        self._writer.close()
        self._temporary.unlink(missing_ok=True)

    def __enter__(self) -> "PartWriter":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is not None:
            self.abort()


# --------------------------------------------------------------------------- shards and merge


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise MtaError(f"{path} is corrupt ({error}); delete it and re-run `mta annotate`") from error


def read_manifest(out_dir: str | Path) -> dict[str, Any] | None:
    """The directory's ``manifest.json``, or None when the artefact is not complete."""
    return _read_json(Path(out_dir) / MANIFEST)


def read_shard_manifest(out_dir: str | Path, shard: int, num_shards: int) -> dict[str, Any] | None:
    return _read_json(Path(out_dir) / shard_manifest_name(shard, num_shards))


def _shard_manifests(out_dir: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(out_dir.glob("shard-*-of-*.json")):
        if _SHARD_FILE.match(path.name):
            manifest = _read_json(path)
            if manifest is not None:
                found.append(manifest)
    return found


def _sum_counts(total: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """Add nested integer counts key by key."""
    result = dict(total)
    for key, value in more.items():
        result[key] = _sum_counts(result.get(key, {}), value) if isinstance(value, dict) else (
            result.get(key, 0) + value
        )
    return result


def merged_manifest(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """``manifest.json`` of a complete shard set: the shared description plus summed counts.

    The schema version is the shards' own: shards written by an older mta merge into an
    artefact of that version (which reading then upgrades), never one labelled as today's.
    """
    shards = sorted(shards, key=lambda shard: shard["shard"])
    counts: dict[str, Any] = {}
    for shard in shards:
        counts = _sum_counts(counts, shard["counts"])
    skipped_examples = [message for shard in shards for message in shard["skipped_examples"]]
    return {
        VERSION_KEY: shards[0].get(VERSION_KEY),
        **shards[0]["description"],
        "run_key": shards[0]["run_key"],
        **counts,
        "skipped_examples": skipped_examples[:MAX_SKIPPED_EXAMPLES],
        "num_shards": len(shards),
        "parts": [shard["part"] for shard in shards],
    }


def commit_shard(out_dir: Path, shard_manifest: dict[str, Any]) -> dict[str, Any] | None:
    """Publish one shard; write ``manifest.json`` when this completes its set.

    Returns the merged manifest when it was written, else None (other shards still missing).
    """
    path = out_dir / shard_manifest_name(shard_manifest["shard"], shard_manifest["num_shards"])
    previous = _read_json(path)
    atomic_write_json(path, shard_manifest)
    published = read_manifest(out_dir)
    if previous is not None and previous["part"]["file"] != shard_manifest["part"]["file"]:
        # The replaced part can go at once unless the current manifest.json still lists it.
        listed = {part["file"] for part in (published or {}).get("parts", [])}
        if previous["part"]["file"] not in listed:
            (out_dir / previous["part"]["file"]).unlink(missing_ok=True)
    return try_merge(out_dir, shard_manifest["run_key"], shard_manifest["num_shards"])


def _complete_set(out_dir: Path, run_key: str, num_shards: int) -> list[dict[str, Any]] | None:
    shards = {
        shard["shard"]: shard
        for shard in _shard_manifests(out_dir)
        if shard["run_key"] == run_key and shard["num_shards"] == num_shards
        and (out_dir / shard["part"]["file"]).exists()
    }
    return [shards[i] for i in range(num_shards)] if len(shards) == num_shards else None


def try_merge(out_dir: Path, run_key: str, num_shards: int) -> dict[str, Any] | None:
    """Write ``manifest.json`` if all ``num_shards`` shards of run ``run_key`` are present."""
    shards = _complete_set(out_dir, run_key, num_shards)
    if shards is None:
        return None
    manifest = merged_manifest(shards)
    previous = read_manifest(out_dir)
    atomic_write_json(out_dir / MANIFEST, manifest)
    _remove_superseded(out_dir, manifest, previous)
    return manifest


def _remove_superseded(out_dir: Path, manifest: dict[str, Any], previous: dict[str, Any] | None) -> None:
    """Delete the previous artefact's parts and the shard manifests of other runs."""
    current = {part["file"] for part in manifest["parts"]}
    stale = {part["file"] for part in (previous or {}).get("parts", [])} - current
    for path in out_dir.glob("shard-*-of-*.json"):
        shard = _read_json(path)
        if shard is not None and shard.get("run_key") != manifest["run_key"]:
            stale.add(shard["part"]["file"])
            path.unlink(missing_ok=True)
    for name in stale - current:
        (out_dir / name).unlink(missing_ok=True)


def merge_shards(out_dir: str | Path) -> dict[str, Any]:
    """Write ``manifest.json`` from a complete set of shard manifests (``mta annotate --merge``)."""
    out_dir = Path(out_dir)
    shards = _shard_manifests(out_dir)
    if not shards:
        raise MtaError(f"{out_dir} holds no shard manifests (shard-*-of-*.json); nothing to merge")
    by_set: dict[tuple[str, int], set[int]] = {}
    for shard in shards:
        by_set.setdefault((shard["run_key"], shard["num_shards"]), set()).add(shard["shard"])
    for (run_key, num_shards), present in by_set.items():
        manifest = try_merge(out_dir, run_key, num_shards)
        if manifest is not None:
            return manifest
    raise MtaError(_incomplete_message(out_dir, by_set))


def _incomplete_message(out_dir: Path, by_set: dict[tuple[str, int], set[int]]) -> str:
    (run_key, num_shards), present = max(by_set.items(), key=lambda item: len(item[1]))
    missing = sorted(set(range(num_shards)) - present)
    shown = ", ".join(str(i) for i in missing[:10]) + (" ..." if len(missing) > 10 else "")
    return (
        f"{out_dir} is incomplete: {len(present)} of {num_shards} shards are written "
        f"(missing: {shown}). Run the missing shards with `mta annotate ... --shard I/{num_shards}`; "
        "the last one writes manifest.json (or run `mta annotate --merge` afterwards)"
    )


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Annotations:
    """A complete artefact: ``manifest`` (dict) and ``table`` (all parts, rows in input order).

    Both are at the current schema version, upgraded in memory when the directory holds an
    older one; ``stored_version`` is the version on disk.
    """

    directory: Path
    manifest: dict[str, Any]
    table: pa.Table
    stored_version: int

    def __len__(self) -> int:
        return self.table.num_rows

    def row(self, position: int) -> dict[str, Any]:
        """Row ``position`` (0-based, in artefact order) as plain Python values."""
        if not 0 <= position < len(self):
            raise MtaError(f"row {position} is out of range: {self.directory} has {len(self)} rows (0..{len(self) - 1})")
        return self.table.slice(position, 1).to_pylist()[0]


def read_annotations(out_dir: str | Path) -> Annotations:
    """Read a complete annotate artefact of any version this mta reads, upgraded to the current
    one (:mod:`mta.data.artefact_schema`); raise ``MtaError`` naming the fix when it is not."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise MtaError(f"{out_dir} does not exist; create it with `mta annotate DATA.jsonl -o {out_dir}`")
    manifest = read_manifest(out_dir)
    if manifest is None:
        shards = _shard_manifests(out_dir)
        if shards:
            by_set: dict[tuple[str, int], set[int]] = {}
            for shard in shards:
                by_set.setdefault((shard["run_key"], shard["num_shards"]), set()).add(shard["shard"])
            raise MtaError(_incomplete_message(out_dir, by_set))
        raise MtaError(
            f"{out_dir} has no {MANIFEST}: it is not a finished `mta annotate` output (an "
            f"interrupted run leaves none). Run `mta annotate DATA.jsonl -o {out_dir}`"
        )
    version = stored_version(manifest, out_dir / MANIFEST)
    tables = []
    for part in manifest["parts"]:
        path = out_dir / part["file"]
        if not path.exists():
            raise MtaError(
                f"{path} is listed in {MANIFEST} but missing; re-run `mta annotate ... --force`"
            )
        table = conform(pq.read_table(path), version, str(path))
        if table.num_rows != part["rows"]:
            raise MtaError(
                f"{path} has {table.num_rows} rows, {MANIFEST} says {part['rows']}; the directory "
                "was changed by hand: re-run `mta annotate ... --force`"
            )
        tables.append(table)
    table = pa.concat_tables(tables) if tables else SCHEMAS[version].empty_table()
    if len(tables) > 1:
        table = table.sort_by("id")
    upgraded, table = upgrade_to_current(manifest, table, out_dir)
    return Annotations(directory=out_dir, manifest=upgraded, table=table, stored_version=version)
