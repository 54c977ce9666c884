"""Where converted models live, and the record that marks a finished conversion."""

from __future__ import annotations

import os
from pathlib import Path

from mta.errors import MtaError
from mta.files import atomic_write_json

CACHE_ENV = "MTA_CACHE_DIR"
# Written last into a converted directory: its presence means the conversion finished.
SOURCE_RECORD = "mta_source.json"


def model_cache_dir() -> Path:
    """``$MTA_CACHE_DIR``, else ``~/.cache/mta/models``: outside any run directory, so deleting
    a run never forces a reconversion."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "mta" / "models"


def already_built(directory: Path, *, force: bool, what: str) -> bool:
    """True when ``directory`` holds a finished build of ``what`` to reuse.

    False when it is absent, or present and ``force`` asks to replace it. A directory without
    the record is someone else's (or a foreign) directory: refused rather than overwritten.
    """
    if force or not directory.exists():
        return False
    if (directory / SOURCE_RECORD).is_file():
        return True
    raise MtaError(
        f"{directory} exists but holds no finished {what} ({SOURCE_RECORD} is missing); "
        "choose another -o or pass --force to replace it"
    )


def write_source_record(directory: Path, record: dict) -> None:
    """Write ``mta_source.json`` (where the files came from) into ``directory``."""
    atomic_write_json(directory / SOURCE_RECORD, record)
