"""Writing a store directory: a part (:class:`PartWriter`), a shard (:func:`commit_shard`), the
merge of a complete shard set into ``manifest.json`` (:func:`try_merge`, :func:`merge_shards`),
and finishing what an interrupted writer left (:func:`finish_publishing`). The steps and their
order are described in :mod:`mta.store`; everything that publishes, moves or deletes runs under
the merge lock."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mta.errors import MtaError
from mta.files import (
    atomic_write_json,
    disk_full_is_reported,
    fsync_directory,
    make_output_directory,
    publish,
    temporary_beside,
)
from mta.hashing import file_sha256
from mta.store.kinds import require_kind
from mta.store.layout import (
    LAYOUT_KEY,
    LAYOUT_VERSION,
    MANIFEST,
    META,
    VERSION_KEY,
    is_part_name,
    is_shard_manifest_name,
    manifest_path,
    meta_directory,
    part_name,
    part_path,
    remove_if_empty,
    shard_manifest_name,
    staging_directory,
)
from mta.store.locks import merge_lock, shard_lock
from mta.store.manifests import (
    MAX_SKIPPED_EXAMPLES,
    check_directory,
    incomplete_message,
    read_legacy_manifest,
    read_manifest,
    read_shard_manifest,
    shard_files,
    shard_manifests,
    shard_sets,
)

__all__ = [
    "PartWriter",
    "commit_shard",
    "finish_publishing",
    "merge_shards",
    "merged_manifest",
    "try_merge",
    "writing_shard",
]


class PartWriter:
    """Stream record batches into one Parquet part, renamed into place by :meth:`commit`.

    Batches are buffered into row groups of about ``row_group_rows`` rows. If the writer is
    closed without ``commit`` (an exception, Ctrl-C, a full disk), the temporary file is deleted.
    ``schema``: the rows' Arrow schema (annotate's, :data:`mta.data.artefact_schema.SCHEMA`;
    ``mta embed``'s and ``mta teacher``'s, :mod:`mta.embedding.embed`,
    :mod:`mta.training.teacher_cache`), all in the same layout. ``compression``: Parquet's codec
    (``"none"`` for values that do not compress).
    """

    def __init__(self, path: Path, row_group_rows: int = 2048, *, schema: pa.Schema, compression: str = "zstd"):
        self.path = path
        self.rows = 0
        self._schema = schema
        self._row_group_rows = row_group_rows
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._temporary = temporary_beside(path)
        try:
            self._writer = pq.ParquetWriter(self._temporary, schema, compression=compression)
        except BaseException:
            self._temporary.unlink(missing_ok=True)
            raise

    def write(self, batch: pa.RecordBatch) -> None:
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        self.rows += batch.num_rows
        if self._pending_rows >= self._row_group_rows:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._writer.write_table(pa.Table.from_batches(self._pending, schema=self._schema))
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
        try:
            self._writer.close()  # may fail again for the reason we abort (a full disk)
        except Exception:
            pass
        finally:
            self._temporary.unlink(missing_ok=True)

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if kind is not None:
            self.abort()


# --------------------------------------------------------------------------- settling


def _settle(out_dir: Path, listed: set[str]) -> None:
    """Make the directory's parts exactly ``listed`` (the manifest's; none without one): every
    other part in it goes first (into staging when a shard manifest still names it, else
    deleted), then the listed parts still staged are renamed into it. Runs under the merge
    lock; every name moved is a checked part name, every name deleted matches the part pattern.
    """
    staging = staging_directory(out_dir)
    referenced = {shard["part"]["file"] for shard in shard_files(out_dir).values()}
    changed = False
    for path in sorted(out_dir.iterdir()):
        if is_part_name(path.name) and path.name not in listed:
            if path.name in referenced and path.is_file() and not path.is_symlink():
                staging.mkdir(parents=True, exist_ok=True)
                os.replace(path, staging / path.name)
            else:
                path.unlink(missing_ok=True)
            changed = True
    for name in sorted(listed):
        if not (out_dir / name).is_file() and (staging / name).is_file():
            os.replace(staging / name, out_dir / name)
            changed = True
    if changed:
        fsync_directory(out_dir)
        fsync_directory(staging)


def _is_settled(out_dir: Path) -> bool:
    """Whether nothing is left to publish or adopt (read without the lock)."""
    if (out_dir / MANIFEST).exists() or any(
        is_shard_manifest_name(path.name) for path in out_dir.glob("shard-*-of-*.json")
    ):
        return False
    manifest = read_manifest(out_dir)
    listed = {part["file"] for part in manifest["parts"]} if manifest is not None else set()
    present = {path.name for path in out_dir.iterdir() if is_part_name(path.name)}
    return present == {name for name in listed if (out_dir / name).is_file()} and all(
        (out_dir / name).is_file() or not (staging_directory(out_dir) / name).is_file() for name in listed
    )


def _adopt_legacy_locked(out_dir: Path) -> None:
    """Turn a layout 1 directory (``manifest.json`` and shard manifests beside the parts) into
    layout 2, in place; the rows, the schema version and the run keys stay as they were.

    Crash-safe: files in ``.mta/`` win over those beside the parts, so adopting again after an
    interruption finishes the job; :func:`_settle` then hides the parts of unfinished sets.
    """
    legacy = read_legacy_manifest(out_dir)
    legacy_shards = shard_files(out_dir, legacy=True)
    if legacy is None and not legacy_shards:
        return
    meta_directory(out_dir).mkdir(exist_ok=True)
    for path, shard in legacy_shards.items():
        target = meta_directory(out_dir) / path.name
        if not target.exists():
            atomic_write_json(target, shard)
        path.unlink(missing_ok=True)
    if legacy is not None:
        if not manifest_path(out_dir).exists():
            atomic_write_json(manifest_path(out_dir), {**legacy, LAYOUT_KEY: LAYOUT_VERSION})
        (out_dir / MANIFEST).unlink(missing_ok=True)
    fsync_directory(out_dir)


def _finish_locked(out_dir: Path) -> dict[str, Any] | None:
    """Adopt a layout 1 directory, then make its parts exactly the manifest's (a publish cut
    short is finished, a part no manifest lists is deleted). Returns the manifest, if any."""
    _adopt_legacy_locked(out_dir)
    manifest = read_manifest(out_dir)
    _settle(out_dir, {part["file"] for part in manifest["parts"]} if manifest is not None else set())
    return manifest


def finish_publishing(out_dir: str | Path) -> None:
    """For a writer about to use ``out_dir``: check every manifest in it, then (under the merge
    lock, and only when there is something to do) adopt a layout 1 directory and finish a
    publish that was cut short. A settled directory is only read."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return
    check_directory(out_dir)
    if _is_settled(out_dir):
        return
    with merge_lock(out_dir):
        _finish_locked(out_dir)


# --------------------------------------------------------------------------- shards and merge


def _sum_counts(total: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """Add nested integer counts key by key."""
    result = dict(total)
    for key, value in more.items():
        result[key] = (
            _sum_counts(result.get(key, {}), value) if isinstance(value, dict) else (result.get(key, 0) + value)
        )
    return result


def merged_manifest(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """``manifest.json`` of a complete shard set: the shared description plus summed counts.

    The schema version is the shards' own: shards written by an older mta merge into an
    artefact of that version (which reading then upgrades), never one labelled as today's.
    The layout is today's: this package writes the files.
    """
    shards = sorted(shards, key=lambda shard: shard["shard"])
    counts: dict[str, Any] = {}
    for shard in shards:
        counts = _sum_counts(counts, shard["counts"])
    skipped_examples = [message for shard in shards for message in shard["skipped_examples"]]
    return {
        VERSION_KEY: shards[0].get(VERSION_KEY),
        LAYOUT_KEY: LAYOUT_VERSION,
        **shards[0]["description"],
        "run_key": shards[0]["run_key"],
        **counts,
        "skipped_examples": skipped_examples[:MAX_SKIPPED_EXAMPLES],
        "num_shards": len(shards),
        "parts": [shard["part"] for shard in shards],
    }


def commit_shard(out_dir: Path, shard_manifest: dict[str, Any]) -> dict[str, Any] | None:
    """Publish one shard (its part is already staged); write ``manifest.json`` and publish the
    set's parts when this completes its set. Runs under the merge lock; the caller holds the
    shard's lock, so any other staged part of this shard is an orphan of a killed run and goes.

    Returns the merged manifest when it was written, else None (other shards still missing).
    If the shard manifest cannot be written (a full disk), the new part is deleted again: no
    file refers to it, and the previous state of the directory stands.
    """
    shard, num_shards = shard_manifest["shard"], shard_manifest["num_shards"]
    path = meta_directory(out_dir) / shard_manifest_name(shard, num_shards)
    new_part = shard_manifest["part"]["file"]
    with merge_lock(out_dir):
        previous = read_shard_manifest(out_dir, shard, num_shards)
        published = read_manifest(out_dir)
        try:
            atomic_write_json(path, shard_manifest)
        except BaseException:
            (staging_directory(out_dir) / new_part).unlink(missing_ok=True)
            raise
        listed = {part["file"] for part in (published or {}).get("parts", [])}
        prefix = part_name(shard, num_shards, "")[: -len(".parquet")]
        for staged in staging_directory(out_dir).glob(f"{prefix}*.parquet"):
            if is_part_name(staged.name) and staged.name not in listed | {new_part}:
                staged.unlink(missing_ok=True)  # the replaced part, or an orphan
        if previous is not None and previous["part"]["file"] not in (listed | {new_part}):
            (out_dir / previous["part"]["file"]).unlink(missing_ok=True)
        return _merge_locked(out_dir, shard_manifest["run_key"], num_shards)


def _complete_set(
    out_dir: Path, shards: list[dict[str, Any]], run_key: str, num_shards: int
) -> list[dict[str, Any]] | None:
    found = {
        shard["shard"]: shard
        for shard in shards
        if shard["run_key"] == run_key
        and shard["num_shards"] == num_shards
        and part_path(out_dir, shard["part"]["file"]).exists()
    }
    return [found[i] for i in range(num_shards)] if len(found) == num_shards else None


def try_merge(out_dir: Path, run_key: str, num_shards: int) -> dict[str, Any] | None:
    """Write ``manifest.json`` if all ``num_shards`` shards of run ``run_key`` are present."""
    with merge_lock(out_dir):
        return _merge_locked(out_dir, run_key, num_shards)


def _merge_locked(out_dir: Path, run_key: str, num_shards: int) -> dict[str, Any] | None:
    # Every file is read and checked before anything is written or deleted.
    found = shard_files(out_dir)
    previous = read_manifest(out_dir)
    shards = _complete_set(out_dir, list(found.values()), run_key, num_shards)
    if shards is None:
        return None
    manifest = merged_manifest(shards)
    atomic_write_json(manifest_path(out_dir), manifest)
    _remove_superseded(out_dir, manifest, previous, found)
    _settle(out_dir, {part["file"] for part in manifest["parts"]})
    return manifest


def _remove_superseded(
    out_dir: Path,
    manifest: dict[str, Any],
    previous: dict[str, Any] | None,
    found: dict[Path, dict[str, Any]],
) -> None:
    """Delete the previous artefact's parts and the shard manifests (and parts) of other runs.

    Every name here passed the manifests' checks (:mod:`mta.store.manifests`): a plain part
    name inside ``out_dir``.
    """
    current = {part["file"] for part in manifest["parts"]}
    stale = {part["file"] for part in (previous or {}).get("parts", [])} - current
    for path, shard in found.items():
        if shard["run_key"] != manifest["run_key"]:
            stale.add(shard["part"]["file"])
            path.unlink(missing_ok=True)
    for name in stale - current:
        (out_dir / name).unlink(missing_ok=True)
        (staging_directory(out_dir) / name).unlink(missing_ok=True)


def merge_shards(out_dir: str | Path) -> dict[str, Any]:
    """Write ``manifest.json`` from a complete set of shard manifests (``mta annotate --merge``)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise MtaError(f"--merge {out_dir}: no such directory; give the -o directory of the shards")
    check_directory(out_dir)
    with merge_lock(out_dir):
        _finish_locked(out_dir)
        shards = shard_manifests(out_dir)
        if not shards:
            raise MtaError(f"{out_dir} holds no shard manifests ({META}/shard-*-of-*.json); nothing to merge")
        by_set = shard_sets(shards)
        for run_key, num_shards in by_set:
            manifest = _merge_locked(out_dir, run_key, num_shards)
            if manifest is not None:
                return manifest
    raise MtaError(incomplete_message(out_dir, by_set))


@contextmanager
def writing_shard(
    out_dir: Path,
    shard: int,
    num_shards: int,
    *,
    command: str,
    kind: str,
    warn: Callable[[str], None],
    force: bool = False,
) -> Iterator[None]:
    """Around a stage's work on shard ``shard``/``num_shards`` of ``out_dir`` (``mta annotate``,
    ``mta embed``, ``mta teacher``): the directory made (probed before any work, and removed again
    when this call made it and a failure leaves it empty), a full disk reported as one line, the
    shard's lock held (``command`` names the stage in a refusal; ``warn`` gets the warning of a
    filesystem without locks), and a publish an earlier writer left half done finished (a planted
    manifest is refused there, before any work). A directory of another artefact kind than
    ``kind`` is refused before anything (:func:`mta.store.kinds.require_kind`; ``force``: the
    stage's ``--force``)."""
    require_kind(out_dir, kind, command=command, force=force)
    created = not out_dir.exists()
    make_output_directory(out_dir)
    try:
        with disk_full_is_reported(out_dir), shard_lock(out_dir, shard, num_shards, command=command) as unsupported:
            if unsupported:
                warn(f"{unsupported}: make sure no other `{command}` writes this shard")
            finish_publishing(out_dir)
            yield
    except BaseException:
        if created:
            remove_if_empty(out_dir)
        raise
