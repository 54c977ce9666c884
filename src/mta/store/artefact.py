"""The annotate artefact: Parquet parts, shard manifests and ``manifest.json``.

Layout of an output directory (layout version 2, :mod:`mta.data.artefact_schema`)::

    part-00000-of-00002-<run>.parquet           the rows of shard 0 (ids 0, 2, 4, ...)
    part-00001-of-00002-<run>.parquet           ... exactly the parts manifest.json lists
    .mta/manifest.json                          written last: the directory is complete
    .mta/shard-00000-of-00002.json              one per shard: its counts and its part
    .mta/staging/part-00000-of-00002-<run>.parquet   a shard's part until its set is complete
    .mta/.lock-shard-00000-of-00002, .mta/.lock-merge   only while a writer runs (see "Locks")

The directory itself holds nothing but the published parts, so ``pandas.read_parquet(DIR)``,
``pyarrow.dataset.dataset(DIR)``, DuckDB's ``'DIR/*.parquet'`` and
``datasets.load_dataset("parquet", data_dir=DIR)`` read exactly the artefact's rows: all of them
skip ``.mta/`` (a name starting with a dot). A part is written into ``.mta/staging/`` and stays
there until every shard of its set is written; the merge that writes ``manifest.json`` then
deletes the parts it supersedes from the directory and renames the new ones into it. So a
shard set still being written, a superseded run's shards and the part of a run killed before its
shard manifest (an orphan) all stay in ``.mta/``, out of every reader's sight; the next writer of
that shard deletes the orphan. For the few milliseconds of a publish, a reader that takes no lock
can see the old parts, none, or some of the new ones, never old and new together;
:func:`read_annotations` reads a part from ``.mta/staging/`` when its publish was cut short, and
the next writer finishes that publish.

Directories of layout 1 (mta 0.1: ``manifest.json``, ``shard-*.json`` and the parts side by side)
still read. A writer adopts such a directory first (its manifest and shard manifests move into
``.mta/``, the parts of unfinished shard sets into staging), so a matching artefact is reused
and a new one replaces it as usual.

Every file is written atomically (``mta.files``: a hidden temporary name in the same directory,
fsync, rename), so a crash never leaves a half-written file under a real name. ``manifest.json``
lists the parts it describes by name, rows and sha256; a re-run writes parts under a new
``<run>`` name and deletes the old ones only after the new manifest is in place, so until then the
previous artefact stays whole. ``manifest.json`` appears only when every shard of a set (same run
key, same shard count) has written its shard manifest; readers refuse a directory without it. A
killed process may leave a hidden ``.*.tmp`` file behind in ``.mta/``: nothing reads it, and it is
not removed automatically because a concurrent shard could be writing it.

Trust: a manifest or shard file is data, not instructions. Every part it names must be a plain
part name (``part-IIIII-of-NNNNN-<run>.parquet``) resolving inside the directory (and inside
``.mta/staging/``), or the directory is refused before anything is read or deleted; a part whose
bytes do not match the recorded sha256 and row count, or that Parquet cannot read, is refused
naming the part.

Locks: a writer holds ``.mta/.lock-shard-IIIII-of-NNNNN`` (``fcntl.flock``, its pid and host
written in it) while it computes and publishes its shard, so a second writer of the same shard is
refused naming the holder; shards of one set still run side by side. Publishing a shard manifest,
writing ``manifest.json``, moving parts and deleting superseded ones happen under
``.mta/.lock-merge``, so two shards that finish together never race. The kernel drops a lock when
its holder dies (even by SIGKILL), so a stale lock file never blocks anyone; a lock file is
deleted by its holder on release. Readers take no lock.

The columns, the schema and layout versions and the reading of older schema versions live in
:mod:`mta.data.artefact_schema`; this module writes the current version and lays out the files.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from mta.data.artefact_schema import (
    LAYOUT_KEY,
    LAYOUT_VERSION,
    SCHEMA,
    SCHEMAS,
    VERSION_KEY,
    conform,
    reannotate_command,
    stored_layout,
    stored_version,
    upgrade_to_current,
)
from mta.errors import MtaError
from mta.files import LockHeld, atomic_write_json, exclusive_lock, fsync_directory, publish, temporary_beside
from mta.hashing import file_sha256

__all__ = [
    "MANIFEST", "MERGE_LOCK", "META", "Annotations", "PartWriter", "check_directory", "commit_shard",
    "finish_publishing", "holds_artefact", "manifest_path", "merge_lock", "merge_shards", "part_name",
    "read_annotations", "read_manifest", "read_shard_manifest", "remove_if_empty", "shard_lock",
    "shard_lock_name", "staged_part", "staging_directory", "try_merge",
]

MANIFEST = "manifest.json"
META = ".mta"  # manifests, staged parts and locks: hidden from every Parquet reader
STAGING = "staging"
MAX_SKIPPED_EXAMPLES = 20  # skipped-row messages kept in the manifest, so users can find them
MERGE_LOCK = ".lock-merge"
MERGE_LOCK_WAIT_S = 120.0  # a merge takes milliseconds; a holder this slow is stuck

_SHARD_FILE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.json$")
_PART_FILE = re.compile(r"^part-\d{5}-of-\d{5}-[0-9A-Za-z_-]{1,64}\.parquet$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def shard_manifest_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}.json"


def part_name(shard: int, num_shards: int, run: str) -> str:
    return f"part-{shard:05d}-of-{num_shards:05d}-{run}.parquet"


def shard_lock_name(shard: int, num_shards: int) -> str:
    return f".lock-shard-{shard:05d}-of-{num_shards:05d}"


def meta_directory(out_dir: Path) -> Path:
    return Path(out_dir) / META


def manifest_path(out_dir: str | Path) -> Path:
    """Where the directory's ``manifest.json`` is (layout 2): ``DIR/.mta/manifest.json``."""
    return Path(out_dir) / META / MANIFEST


def staging_directory(out_dir: str | Path) -> Path:
    return Path(out_dir) / META / STAGING


def staged_part(out_dir: str | Path, shard: int, num_shards: int, run: str) -> Path:
    """Where a writer puts the part of shard ``shard``/``num_shards`` until its set is complete."""
    return staging_directory(out_dir) / part_name(shard, num_shards, run)


def holds_artefact(directory: str | Path) -> bool:
    """Whether ``directory`` holds a finished ``mta annotate`` output, of any layout."""
    directory = Path(directory)
    return manifest_path(directory).is_file() or (directory / MANIFEST).is_file()


def remove_if_empty(out_dir: Path) -> None:
    """Remove ``out_dir`` if nothing but an empty ``.mta/`` (left by a failed first run) is in it."""
    for directory in (staging_directory(out_dir), meta_directory(out_dir), out_dir):
        try:
            directory.rmdir()
        except OSError:
            pass


class PartWriter:
    """Stream record batches into one Parquet part, renamed into place by :meth:`commit`.

    Batches are buffered into row groups of about ``row_group_rows`` rows. If the writer is
    closed without ``commit`` (an exception, Ctrl-C, a full disk), the temporary file is deleted.
    ``schema``: the annotate schema by default; ``mta embed`` writes its own
    (:mod:`mta.embedding.teacher_embeddings`) into the same layout.
    """

    def __init__(self, path: Path, row_group_rows: int = 2048, schema: pa.Schema = SCHEMA):
        self.path = path
        self.rows = 0
        self._schema = schema
        self._row_group_rows = row_group_rows
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._temporary = temporary_beside(path)
        try:
            self._writer = pq.ParquetWriter(self._temporary, schema, compression="zstd")
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

    def __enter__(self) -> "PartWriter":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is not None:
            self.abort()


# --------------------------------------------------------------------------- locks


def _lock_file(out_dir: Path, name: str) -> Path:
    meta = meta_directory(out_dir)
    try:
        meta.mkdir(exist_ok=True)
    except FileNotFoundError:
        raise MtaError(f"{out_dir} does not exist; give the -o directory of `mta annotate`") from None
    except PermissionError as error:
        raise MtaError(
            f"cannot create {meta}: {error.strerror}; the output must be a directory this user can write"
        ) from error
    return meta / name


@contextmanager
def shard_lock(out_dir: Path, shard: int, num_shards: int, *, command: str = "mta annotate") -> Iterator[str | None]:
    """Hold shard ``shard`` of ``num_shards`` of ``out_dir`` for writing, or refuse at once
    (``MtaError`` naming the holder's pid and ``command``, the stage that writes the layout).
    Yields None, or a warning when the filesystem has no locks (the run goes on unprotected)."""
    path = _lock_file(out_dir, shard_lock_name(shard, num_shards))
    try:
        with exclusive_lock(path, wait_s=0) as unsupported:
            yield unsupported
    except LockHeld as held:
        which = f"shard {shard}/{num_shards} of " if num_shards > 1 else ""
        raise MtaError(
            f"another `{command}` ({held.holder}) is writing {which}{out_dir} (it holds {path}); "
            "wait for it to finish or stop it, then re-run. Other shards (--shard I/N) may run "
            "side by side; the same shard may not"
        ) from None


@contextmanager
def merge_lock(out_dir: Path) -> Iterator[None]:
    """Hold ``out_dir``'s merge lock: publishing shards, ``manifest.json``, moves and deletions."""
    path = _lock_file(out_dir, MERGE_LOCK)
    try:
        with exclusive_lock(path, wait_s=MERGE_LOCK_WAIT_S):
            yield
    except LockHeld as held:
        raise MtaError(
            f"{path} has been held by {held.holder} for over {MERGE_LOCK_WAIT_S:.0f} s while it "
            "merges shards; if that process is stuck, stop it and re-run (the lock is released "
            "when it exits)"
        ) from None


# --------------------------------------------------------------------------- manifests, checked


def _read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise MtaError(f"{path} is corrupt ({error}); delete it and re-run `mta annotate`") from error
    except OSError as error:
        raise MtaError(f"cannot read {path}: {error.strerror}") from error


def _artefact_directory(path: Path) -> Path:
    """The artefact directory a manifest or shard file belongs to (either layout)."""
    return path.parent.parent if path.parent.name == META else path.parent


def _refused(path: Path, entry: str, problem: str) -> MtaError:
    return MtaError(
        f"{path}: {entry} {problem}. The file was changed by hand or by another program, so "
        f"{_artefact_directory(path)} is refused (nothing in it was read or deleted); annotate the "
        "input again into a new directory (`mta annotate DATA.jsonl ... -o NEW_DIR`)"
    )


def _inside(directory: Path, name: str) -> bool:
    return (directory / name).resolve().parent == directory.resolve()


def _checked_part(path: Path, where: str, entry: Any) -> dict[str, Any]:
    """A part entry ``{file, rows, sha256}`` of the manifest ``path``, whose file is a plain part
    name inside the artefact directory (and its staging directory); else ``MtaError`` naming
    the entry."""
    if not isinstance(entry, dict):
        raise _refused(path, where, f"is {entry!r}, not a part entry {{file, rows, sha256}}")
    name = entry.get("file")
    directory = _artefact_directory(path)
    if not (
        isinstance(name, str) and _PART_FILE.match(name)
        and _inside(directory, name) and _inside(staging_directory(directory), name)
    ):
        raise _refused(
            path, f"{where}.file",
            f"is {name!r}, which is not a part of this directory (a plain file name "
            "part-IIIII-of-NNNNN-<run>.parquet inside it)",
        )
    rows = entry.get("rows")
    if type(rows) is not int or rows < 0:
        raise _refused(path, f"{where}.rows", f"is {rows!r}, not a row count")
    digest = entry.get("sha256")
    if digest is not None and not (isinstance(digest, str) and _SHA256.match(digest)):
        raise _refused(path, f"{where}.sha256", f"is {digest!r}, not a hex sha256")
    return entry


def _checked_manifest(path: Path, manifest: Any) -> dict[str, Any]:
    """``manifest.json`` whose ``parts`` are all checked (:func:`_checked_part`)."""
    if not isinstance(manifest, dict):
        raise _refused(path, "the content", f"is a JSON {type(manifest).__name__}, not an object")
    parts = manifest.get("parts")
    if not isinstance(parts, list):
        raise _refused(path, "parts", f"is {parts!r}, not a list of part entries")
    for index, part in enumerate(parts):
        _checked_part(path, f"parts[{index}]", part)
    return manifest


def _checked_shard(path: Path, shard: Any) -> dict[str, Any]:
    """A shard manifest with the fields merging uses, named like its content, part checked."""
    if not isinstance(shard, dict):
        raise _refused(path, "the content", f"is a JSON {type(shard).__name__}, not an object")
    for key, kind in (("shard", int), ("num_shards", int), ("run_key", str), ("counts", dict),
                      ("skipped_examples", list), ("description", dict)):
        if type(shard.get(key)) is not kind:
            raise _refused(path, key, f"is {shard.get(key)!r}, not a {kind.__name__}")
    if path.name != shard_manifest_name(shard["shard"], shard["num_shards"]):
        raise _refused(path, "shard/num_shards", f"are {shard['shard']}/{shard['num_shards']}, not the file's name")
    _checked_part(path, "part", shard.get("part"))
    return shard


def read_manifest(out_dir: str | Path) -> dict[str, Any] | None:
    """The directory's ``.mta/manifest.json`` (parts checked), or None when it is not complete
    (or is a layout 1 directory a writer has not adopted yet)."""
    path = manifest_path(out_dir)
    manifest = _read_json(path)
    return None if manifest is None else _checked_manifest(path, manifest)


def read_shard_manifest(out_dir: str | Path, shard: int, num_shards: int) -> dict[str, Any] | None:
    path = meta_directory(Path(out_dir)) / shard_manifest_name(shard, num_shards)
    manifest = _read_json(path)
    return None if manifest is None else _checked_shard(path, manifest)


def _shard_files(out_dir: Path, *, legacy: bool = False) -> dict[Path, dict[str, Any]]:
    """Every shard manifest in ``.mta/`` (``legacy``: beside the parts, layout 1), checked; one
    bad file refuses them all."""
    found = {}
    where = Path(out_dir) if legacy else meta_directory(out_dir)
    for path in sorted(where.glob("shard-*-of-*.json")):
        if _SHARD_FILE.match(path.name):
            manifest = _read_json(path)
            if manifest is not None:
                found[path] = _checked_shard(path, manifest)
    return found


def _shard_manifests(out_dir: Path) -> list[dict[str, Any]]:
    return list(_shard_files(out_dir).values())


def check_directory(out_dir: Path) -> None:
    """Refuse ``out_dir`` before a writer computes anything if a manifest or shard file in it
    (of either layout) is not one this module wrote (a part entry naming a path outside the
    directory, say)."""
    read_manifest(out_dir)
    _shard_files(out_dir)
    legacy = _read_json(Path(out_dir) / MANIFEST)
    if legacy is not None:
        _checked_manifest(Path(out_dir) / MANIFEST, legacy)
    _shard_files(out_dir, legacy=True)


def _part_path(out_dir: Path, name: str) -> Path:
    """Where a checked part name's file is: published in the directory, or still staged (a
    publish cut short); the published path when it is in neither."""
    published = out_dir / name
    if not published.is_file():
        staged = staging_directory(out_dir) / name
        if staged.is_file():
            return staged
    return published


def part_is_intact(out_dir: Path, entry: dict[str, Any]) -> bool:
    """Whether a checked part entry's file exists with the recorded sha256 (when recorded)."""
    path = _part_path(out_dir, entry["file"])
    if not path.is_file():
        return False
    try:
        return entry.get("sha256") is None or file_sha256(path) == entry["sha256"]
    except OSError:
        return False


# --------------------------------------------------------------------------- publishing


def _settle(out_dir: Path, listed: set[str]) -> None:
    """Make the directory's parts exactly ``listed`` (the manifest's; none without one): every
    other part in it goes first (into staging when a shard manifest still names it, else
    deleted), then the listed parts still staged are renamed into it. Runs under the merge
    lock; every name moved is a checked part name, every name deleted matches the part pattern.
    """
    staging = staging_directory(out_dir)
    referenced = {shard["part"]["file"] for shard in _shard_files(out_dir).values()}
    changed = False
    for path in sorted(out_dir.iterdir()):
        if _PART_FILE.match(path.name) and path.name not in listed:
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
        _SHARD_FILE.match(path.name) for path in out_dir.glob("shard-*-of-*.json")
    ):
        return False
    manifest = read_manifest(out_dir)
    listed = {part["file"] for part in manifest["parts"]} if manifest is not None else set()
    present = {path.name for path in out_dir.iterdir() if _PART_FILE.match(path.name)}
    return present == {name for name in listed if (out_dir / name).is_file()} and all(
        (out_dir / name).is_file() or not (staging_directory(out_dir) / name).is_file() for name in listed
    )


def _adopt_legacy_locked(out_dir: Path) -> None:
    """Turn a layout 1 directory (``manifest.json`` and shard manifests beside the parts) into
    layout 2, in place; the rows, the schema version and the run keys stay as they were.

    Crash-safe: files in ``.mta/`` win over those beside the parts, so adopting again after an
    interruption finishes the job; :func:`_settle` then hides the parts of unfinished sets.
    """
    legacy_path = out_dir / MANIFEST
    raw = _read_json(legacy_path)
    legacy = None if raw is None else _checked_manifest(legacy_path, raw)
    legacy_shards = _shard_files(out_dir, legacy=True)
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
        legacy_path.unlink(missing_ok=True)
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
        result[key] = _sum_counts(result.get(key, {}), value) if isinstance(value, dict) else (
            result.get(key, 0) + value
        )
    return result


def merged_manifest(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """``manifest.json`` of a complete shard set: the shared description plus summed counts.

    The schema version is the shards' own: shards written by an older mta merge into an
    artefact of that version (which reading then upgrades), never one labelled as today's.
    The layout is today's: this module writes the files.
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
            if _PART_FILE.match(staged.name) and staged.name not in listed | {new_part}:
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
        if shard["run_key"] == run_key and shard["num_shards"] == num_shards
        and _part_path(out_dir, shard["part"]["file"]).exists()
    }
    return [found[i] for i in range(num_shards)] if len(found) == num_shards else None


def try_merge(out_dir: Path, run_key: str, num_shards: int) -> dict[str, Any] | None:
    """Write ``manifest.json`` if all ``num_shards`` shards of run ``run_key`` are present."""
    with merge_lock(out_dir):
        return _merge_locked(out_dir, run_key, num_shards)


def _merge_locked(out_dir: Path, run_key: str, num_shards: int) -> dict[str, Any] | None:
    # Every file is read and checked before anything is written or deleted.
    shard_files = _shard_files(out_dir)
    previous = read_manifest(out_dir)
    shards = _complete_set(out_dir, list(shard_files.values()), run_key, num_shards)
    if shards is None:
        return None
    manifest = merged_manifest(shards)
    atomic_write_json(manifest_path(out_dir), manifest)
    _remove_superseded(out_dir, manifest, previous, shard_files)
    _settle(out_dir, {part["file"] for part in manifest["parts"]})
    return manifest


def _remove_superseded(
    out_dir: Path,
    manifest: dict[str, Any],
    previous: dict[str, Any] | None,
    shard_files: dict[Path, dict[str, Any]],
) -> None:
    """Delete the previous artefact's parts and the shard manifests (and parts) of other runs.

    Every name here passed :func:`_checked_part`: a plain part name inside ``out_dir``.
    """
    current = {part["file"] for part in manifest["parts"]}
    stale = {part["file"] for part in (previous or {}).get("parts", [])} - current
    for path, shard in shard_files.items():
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
        shards = _shard_manifests(out_dir)
        if not shards:
            raise MtaError(
                f"{out_dir} holds no shard manifests ({META}/shard-*-of-*.json); nothing to merge"
            )
        by_set: dict[tuple[str, int], set[int]] = {}
        for shard in shards:
            by_set.setdefault((shard["run_key"], shard["num_shards"]), set()).add(shard["shard"])
        for run_key, num_shards in by_set:
            manifest = _merge_locked(out_dir, run_key, num_shards)
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
    older one; ``stored_version`` is the version on disk, ``layout`` the directory's layout.
    """

    directory: Path
    manifest: dict[str, Any]
    table: pa.Table
    stored_version: int
    layout: int = LAYOUT_VERSION

    def __len__(self) -> int:
        return self.table.num_rows

    def row(self, position: int) -> dict[str, Any]:
        """Row ``position`` (0-based, in artefact order) as plain Python values."""
        if not 0 <= position < len(self):
            raise MtaError(f"row {position} is out of range: {self.directory} has {len(self)} rows (0..{len(self) - 1})")
        return self.table.slice(position, 1).to_pylist()[0]


def read_annotations(out_dir: str | Path) -> Annotations:
    """Read a complete annotate artefact of any schema version and layout this mta reads,
    upgraded to the current schema (:mod:`mta.data.artefact_schema`); raise ``MtaError`` naming
    the fix when it is not. Nothing in the directory is written.

    Each part is checked against the sha256 and row count ``manifest.json`` records for it
    (hashing costs one extra pass over the part's bytes, usually from the page cache).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise MtaError(
            f"{out_dir} is a file; give the directory `mta annotate -o DIR` wrote (it holds {META}/{MANIFEST})"
        )
    if not out_dir.is_dir():
        raise MtaError(f"{out_dir} does not exist; create it with `mta annotate DATA.jsonl -o {out_dir}`")
    path = manifest_path(out_dir)
    raw = _read_json(path)
    layout = None if raw is None else stored_layout(raw, path, out_dir)
    if raw is None:  # layout 1: manifest.json beside the parts
        path, layout = out_dir / MANIFEST, 1
        raw = _read_json(path)
    if raw is None:
        shards = _shard_manifests(out_dir) + list(_shard_files(out_dir, legacy=True).values())
        if shards:
            by_set: dict[tuple[str, int], set[int]] = {}
            for shard in shards:
                by_set.setdefault((shard["run_key"], shard["num_shards"]), set()).add(shard["shard"])
            raise MtaError(_incomplete_message(out_dir, by_set))
        raise MtaError(
            f"{out_dir} has no {META}/{MANIFEST}: it is not a finished `mta annotate` output (an "
            f"interrupted run leaves none). Run `mta annotate DATA.jsonl -o {out_dir}`"
        )
    version = stored_version(raw, path, out_dir)
    manifest = _checked_manifest(path, raw)
    tables = [_read_part(out_dir, manifest, part, version) for part in manifest["parts"]]
    table = pa.concat_tables(tables) if tables else SCHEMAS[version].empty_table()
    if len(tables) > 1:
        table = table.sort_by("id")
    upgraded, table = upgrade_to_current(manifest, table, out_dir)
    return Annotations(directory=out_dir, manifest=upgraded, table=table, stored_version=version, layout=layout)


def _read_part(out_dir: Path, manifest: dict[str, Any], part: dict[str, Any], version: int) -> pa.Table:
    """One checked part entry's rows, verified against its sha256 and row count."""
    path = _part_path(out_dir, part["file"])

    def refused(problem: str) -> MtaError:
        command = reannotate_command(manifest, out_dir, out=Path(f"{out_dir}-rebuilt"))
        return MtaError(
            f"{path} {problem}. Annotate the input again into a new directory (this one stays "
            f"as it is): `{command}`, then use that one"
        )

    if not path.is_file():
        raise refused(f"is listed in {MANIFEST} but missing")
    try:
        digest = file_sha256(path) if part.get("sha256") is not None else None
    except OSError as error:
        raise refused(f"cannot be read ({error.strerror})") from error
    if digest is not None and digest != part["sha256"]:
        raise refused(
            f"does not match {MANIFEST}: its sha256 is {digest}, the manifest records "
            f"{part['sha256']}; the part was changed or replaced after `mta annotate` wrote it, "
            "so its rows cannot be trusted"
        )
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise refused(f"is not a readable Parquet file ({error}): it is corrupt or truncated") from error
    table = conform(table, version, str(path))
    if table.num_rows != part["rows"]:
        raise refused(f"has {table.num_rows} rows, {MANIFEST} says {part['rows']}")
    return table
