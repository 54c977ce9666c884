"""Paths as the benchmark JSONs record them: never a machine's absolute path."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def portable(path: str | Path) -> str:
    """``path`` relative to the repository (``../shared/...`` for the shared data), or its name."""
    resolved = Path(path).resolve()
    try:
        return os.path.relpath(resolved, REPO) if resolved.is_relative_to(REPO.parent) else resolved.name
    except ValueError:
        return resolved.name
