"""sha256 of files and of JSON-able values: what artefacts record to name their inputs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

BLOCK = 1 << 20


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks (flat memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def json_sha256(payload: Any) -> str:
    """The hex sha256 of ``payload`` as canonical JSON (sorted keys, ASCII escapes)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()
