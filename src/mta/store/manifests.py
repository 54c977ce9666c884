"""A store directory's manifests, read and checked: ``manifest.json``, the shard manifests and
the part entries they hold (the trust rules are in :mod:`mta.store`, "Trust"). Nothing here
writes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mta.errors import MtaError
from mta.files import read_artefact_json
from mta.hashing import file_sha256
from mta.store.layout import (
    MANIFEST,
    META,
    is_part_name,
    is_shard_manifest_name,
    manifest_path,
    meta_directory,
    part_path,
    shard_manifest_name,
    staging_directory,
)

__all__ = [
    "MAX_SKIPPED_EXAMPLES",
    "REBUILD",
    "check_directory",
    "checked_manifest",
    "incomplete_message",
    "part_is_intact",
    "read_legacy_manifest",
    "read_manifest",
    "read_manifest_json",
    "read_shard_manifest",
    "shard_files",
    "shard_manifests",
    "shard_sets",
]

MAX_SKIPPED_EXAMPLES = 20  # skipped-row messages kept in the manifest, so users can find them

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


REBUILD = "delete it and re-run `mta annotate`"  # an annotate artefact's; other stages name their own


def read_manifest_json(path: Path, rebuild: str = REBUILD) -> Any | None:
    """The JSON of a manifest or shard file, unchecked; None when there is no such file. A file
    that is not JSON is one line naming it and ``rebuild`` (:func:`mta.files.read_artefact_json`)."""
    return read_artefact_json(path, rebuild, kind=object)


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
        isinstance(name, str)
        and is_part_name(name)
        and _inside(directory, name)
        and _inside(staging_directory(directory), name)
    ):
        raise _refused(
            path,
            f"{where}.file",
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


def checked_manifest(path: Path, manifest: Any) -> dict[str, Any]:
    """``manifest.json`` (read from ``path``) whose ``parts`` are all checked: each a plain
    part name inside the directory, with a row count and a hex sha256; else ``MtaError``."""
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
    for key, kind in (
        ("shard", int),
        ("num_shards", int),
        ("run_key", str),
        ("counts", dict),
        ("skipped_examples", list),
        ("description", dict),
    ):
        if type(shard.get(key)) is not kind:
            raise _refused(path, key, f"is {shard.get(key)!r}, not a {kind.__name__}")
    if path.name != shard_manifest_name(shard["shard"], shard["num_shards"]):
        raise _refused(path, "shard/num_shards", f"are {shard['shard']}/{shard['num_shards']}, not the file's name")
    _checked_part(path, "part", shard.get("part"))
    return shard


def read_manifest(out_dir: str | Path, rebuild: str = REBUILD) -> dict[str, Any] | None:
    """The directory's ``.mta/manifest.json`` (parts checked), or None when it is not complete
    (or is a layout 1 directory a writer has not adopted yet); ``rebuild``: what a corrupt one's
    message says to do."""
    path = manifest_path(out_dir)
    manifest = read_manifest_json(path, rebuild)
    return None if manifest is None else checked_manifest(path, manifest)


def read_legacy_manifest(out_dir: str | Path) -> dict[str, Any] | None:
    """A layout 1 directory's ``manifest.json`` beside the parts (parts checked), or None."""
    path = Path(out_dir) / MANIFEST
    manifest = read_manifest_json(path)
    return None if manifest is None else checked_manifest(path, manifest)


def read_shard_manifest(out_dir: str | Path, shard: int, num_shards: int) -> dict[str, Any] | None:
    path = meta_directory(Path(out_dir)) / shard_manifest_name(shard, num_shards)
    manifest = read_manifest_json(path)
    return None if manifest is None else _checked_shard(path, manifest)


def shard_files(out_dir: Path, *, legacy: bool = False) -> dict[Path, dict[str, Any]]:
    """Every shard manifest in ``.mta/`` (``legacy``: beside the parts, layout 1), checked; one
    bad file refuses them all."""
    found = {}
    where = Path(out_dir) if legacy else meta_directory(out_dir)
    for path in sorted(where.glob("shard-*-of-*.json")):
        if is_shard_manifest_name(path.name):
            manifest = read_manifest_json(path)
            if manifest is not None:
                found[path] = _checked_shard(path, manifest)
    return found


def shard_manifests(out_dir: Path) -> list[dict[str, Any]]:
    return list(shard_files(out_dir).values())


def check_directory(out_dir: Path) -> None:
    """Refuse ``out_dir`` before a writer computes anything if a manifest or shard file in it
    (of either layout) is not one this package wrote (a part entry naming a path outside the
    directory, say)."""
    read_manifest(out_dir)
    shard_files(out_dir)
    read_legacy_manifest(out_dir)
    shard_files(out_dir, legacy=True)


def part_is_intact(out_dir: Path, entry: dict[str, Any]) -> bool:
    """Whether a checked part entry's file exists with the recorded sha256 (when recorded)."""
    path = part_path(out_dir, entry["file"])
    if not path.is_file():
        return False
    try:
        return entry.get("sha256") is None or file_sha256(path) == entry["sha256"]
    except OSError:
        return False


def shard_sets(shards: list[dict[str, Any]]) -> dict[tuple[str, int], set[int]]:
    """The shard indices present of each set, by ``(run_key, num_shards)``."""
    by_set: dict[tuple[str, int], set[int]] = {}
    for shard in shards:
        by_set.setdefault((shard["run_key"], shard["num_shards"]), set()).add(shard["shard"])
    return by_set


def incomplete_message(out_dir: Path, by_set: dict[tuple[str, int], set[int]]) -> str:
    """Why ``out_dir`` has no manifest yet: the fullest of its shard sets (:func:`shard_sets`)
    and the shards it misses, with the commands that finish it."""
    (run_key, num_shards), present = max(by_set.items(), key=lambda item: len(item[1]))
    missing = sorted(set(range(num_shards)) - present)
    shown = ", ".join(str(i) for i in missing[:10]) + (" ..." if len(missing) > 10 else "")
    return (
        f"{out_dir} is incomplete: {len(present)} of {num_shards} shards are written "
        f"(missing: {shown}). Run the missing shards with `mta annotate ... --shard I/{num_shards}`; "
        "the last one writes manifest.json (or run `mta annotate --merge` afterwards)"
    )
