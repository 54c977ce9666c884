"""Where converted models live, and how a model directory is written without ever half-existing."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mta.errors import MtaError

CACHE_ENV = "MTA_CACHE_DIR"
# Written last into a converted directory: its presence means the conversion finished.
SOURCE_RECORD = "mta_source.json"


def model_cache_dir() -> Path:
    """``$MTA_CACHE_DIR``, else ``~/.cache/mta/models``: outside any run directory, so deleting
    a run never forces a reconversion."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "mta" / "models"


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty staging directory beside ``final``; on success it becomes ``final``.

    The staging directory sits in the same parent, so the last step is a rename on one
    filesystem. On any error it is deleted and ``final`` keeps whatever it held before. An
    existing ``final`` is replaced: it is renamed aside first and removed only after the new
    directory is in place.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    staging.chmod(0o755)  # mkdtemp's 0o700 would hide a shared cache from other users
    try:
        yield staging
        if final.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
            os.replace(final, retired / final.name)
            os.replace(staging, final)
            shutil.rmtree(retired)
        else:
            os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


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
    (directory / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
