"""sha256 of files and of JSON-able values: what artefacts record to name their inputs."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mta.errors import MtaError

BLOCK = 1 << 20


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks (flat memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def arrays_sha256(arrays: Iterable[Any]) -> str:
    """The hex sha256 of numpy arrays' bytes in order, each preceded by its length (so two
    splits of the same bytes differ)."""
    digest = hashlib.sha256()
    for array in arrays:
        data = array.tobytes()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def json_sha256(payload: Any) -> str:
    """The hex sha256 of ``payload`` as canonical JSON (sorted keys, ASCII escapes)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


def records_sha256(records: Iterable[Any]) -> str:
    """The hex sha256 of JSON-able records in order, each as canonical JSON preceded by its
    length (an in-memory table's content: the same rows in the same order give the same hash)."""
    digest = hashlib.sha256()
    for record in records:
        data = json.dumps(record, sort_keys=True, default=str).encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


# --------------------------------------------------------------------------- checksum lists

CHECKSUMS = "checksums.sha256"  # `sha256sum -c checksums.sha256` verifies a directory by hand


def directory_checksums(directory: str | Path) -> dict[str, str]:
    """``{relative posix path: hex sha256}`` of every file under ``directory`` (sorted), the
    checksum list itself and hidden temporary files left out."""
    directory = Path(directory)
    return {
        path.relative_to(directory).as_posix(): file_sha256(path)
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != CHECKSUMS and not path.name.startswith(".")
    }


def checksum_text(checksums: dict[str, str]) -> str:
    """The list in ``sha256sum`` format: ``<hex>  <path>`` per line."""
    return "".join(f"{digest}  {name}\n" for name, digest in checksums.items())


def read_checksums(directory: str | Path) -> dict[str, str] | None:
    """The recorded list of ``directory`` (None when it has none). A line that is not
    ``<64 hex>  <relative path inside the directory>`` makes the whole list invalid."""
    directory = Path(directory)
    path = directory / CHECKSUMS
    if not path.is_file():
        return None
    checksums = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        digest, sep, name = line.partition("  ")
        inside = (directory / name).resolve().is_relative_to(directory.resolve())
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest) or not name or not inside:
            raise MtaError(f"{path}:{number}: not a '<sha256>  <file in this directory>' line; the list is corrupt")
        checksums[name] = digest
    return checksums


def checksum_differences(directory: str | Path, recorded: dict[str, str]) -> list[str]:
    """How ``directory`` differs from its ``recorded`` list, one phrase per file: listed files
    missing or changed, and files the list does not name."""
    current = directory_checksums(directory)
    changes = [f"{name} (missing)" for name in recorded if name not in current]
    changes += [
        f"{name} (changed: sha256 differs)"
        for name, digest in recorded.items()
        if name in current and current[name] != digest
    ]
    changes += [f"{name} (not in {CHECKSUMS})" for name in current if name not in recorded]
    return changes
