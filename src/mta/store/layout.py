"""Names and paths of a store directory: parts, shard manifests, ``.mta/`` and its staging
directory, the lock files (the layout is described in :mod:`mta.store`)."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = [
    "LAYOUTS",
    "LAYOUT_KEY",
    "LAYOUT_VERSION",
    "MANIFEST",
    "MERGE_LOCK",
    "META",
    "STAGING",
    "VERSION_KEY",
    "holds_artefact",
    "is_part_name",
    "is_shard_manifest_name",
    "manifest_path",
    "meta_directory",
    "part_name",
    "part_path",
    "remove_if_empty",
    "shard_lock_name",
    "shard_manifest_name",
    "staged_part",
    "staging_directory",
]

MANIFEST = "manifest.json"
VERSION_KEY = "schema_version"  # a manifest's key for its rows' schema version (shard manifests carry it too)
LAYOUT_KEY = "layout_version"  # the manifest key of the file layout (absent: layout 1)
# How the files of a store directory sit in it, versioned apart from the rows' schema (a layout
# change moves files and leaves the rows as they are). Bumping it: describe it here, set
# LAYOUT_VERSION, keep reading the older layouts (mta.data.annotations; tests/test_data_sources.py
# reads each) and describe it in the changelog. An mta meeting a newer layout refuses it.
LAYOUTS: dict[int, str] = {
    1: "manifest.json, shard-*.json, lock files and parts side by side in the directory",
    2: "only the published parts in the directory; manifest.json, shard manifests, staged parts and locks under .mta/",
}
LAYOUT_VERSION = 2
META = ".mta"  # manifests, staged parts and locks: hidden from every Parquet reader
STAGING = "staging"
MERGE_LOCK = ".lock-merge"

_SHARD_FILE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.json$")
_PART_FILE = re.compile(r"^part-\d{5}-of-\d{5}-[0-9A-Za-z_-]{1,64}\.parquet$")


def shard_manifest_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}.json"


def part_name(shard: int, num_shards: int, run: str) -> str:
    return f"part-{shard:05d}-of-{num_shards:05d}-{run}.parquet"


def shard_lock_name(shard: int, num_shards: int) -> str:
    return f".lock-shard-{shard:05d}-of-{num_shards:05d}"


def is_part_name(name: str) -> bool:
    """Whether ``name`` is a plain part name, ``part-IIIII-of-NNNNN-<run>.parquet``."""
    return _PART_FILE.match(name) is not None


def is_shard_manifest_name(name: str) -> bool:
    """Whether ``name`` is a shard manifest's name, ``shard-IIIII-of-NNNNN.json``."""
    return _SHARD_FILE.match(name) is not None


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


def part_path(out_dir: Path, name: str) -> Path:
    """Where a checked part name's file is: published in the directory, or still staged (a
    publish cut short); the published path when it is in neither."""
    published = out_dir / name
    if not published.is_file():
        staged = staging_directory(out_dir) / name
        if staged.is_file():
            return staged
    return published


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
