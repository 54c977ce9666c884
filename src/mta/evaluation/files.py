"""Writing outputs so a crash never leaves a half-written artefact.

Finished files are written to a temporary name in the same directory and renamed over the
target (``os.replace`` is atomic on one filesystem). Work in progress goes to an append-only
journal: one JSON line per finished row, flushed as it is written; a crash can only truncate
the last line, which reading skips.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterable


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, payload) -> None:
    atomic_write_text(path, json.dumps(payload, indent=2, ensure_ascii=False) + "\n")


def atomic_write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl_lenient(path: str | Path) -> list[dict]:
    """Every parseable object line of ``path``; an absent file and broken lines read as nothing."""
    rows = []
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict):
                    rows.append(row)
    except FileNotFoundError:
        pass
    return rows


class Journal:
    """Append-only JSONL, one line per finished unit of work, flushed at once."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "a", encoding="utf-8")
        # A crash may have left a partial last line: start ours on a fresh one.
        if self._handle.tell() > 0:
            with open(self.path, "rb") as check:
                check.seek(-1, os.SEEK_END)
                if check.read(1) != b"\n":
                    self._handle.write("\n")

    def append(self, rows: Iterable[dict]) -> None:
        self._handle.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
