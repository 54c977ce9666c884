"""Which kind of artefact a store directory holds, and the one rule every writer follows: a
stage writes, replaces or removes only a directory of its own kind (``--force`` included).

Every stage writing the store's layout names its kind: ``annotations`` (``mta annotate``, whose
manifests carry no ``artefact`` key), ``teacher-embeddings`` (``mta embed``), ``teacher-outputs``
(``mta teacher``). :func:`require_kind` runs before a writer reuses, finishes or writes anything in
a directory (:func:`mta.store.reuse.reusable_output`, :func:`mta.store.publish.writing_shard`):
a directory whose manifest or shard manifests name another kind is refused in one line naming
the file, the kind it holds and a new directory to use; nothing in it is touched.

A ``manifest.json`` that is not valid JSON cannot say its kind: its shard manifests then speak
for it. The stage's own ``--force`` deletes such a manifest when they name the stage's kind (the
merge writes a new one); without ``--force``, or when they do not, the corrupt file is one line
naming it and the command that rebuilds it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mta.errors import MtaError
from mta.store.layout import MANIFEST, is_shard_manifest_name, manifest_path, meta_directory

__all__ = ["ANNOTATIONS", "artefact_kind", "require_kind"]

ANNOTATIONS = "annotations"  # mta annotate's manifests carry no ``artefact`` key


def artefact_kind(manifest: Any) -> str | None:
    """The kind a manifest (or a shard manifest's ``description``) names; None for what is not
    a JSON object."""
    if not isinstance(manifest, dict):
        return None
    kind = manifest.get("artefact")
    return kind if isinstance(kind, str) else ANNOTATIONS


def _json(path: Path) -> tuple[Any, bool]:
    """``(content, corrupt)``: None and False when there is no such file."""
    try:
        return json.loads(path.read_text(encoding="utf-8")), False
    except FileNotFoundError:
        return None, False
    except (ValueError, UnicodeDecodeError, OSError):
        return None, True


def _shard_kinds(out_dir: Path) -> dict[Path, str | None]:
    kinds = {}
    for where in (meta_directory(out_dir), out_dir):
        if where.is_dir():
            for path in sorted(where.glob("shard-*-of-*.json")):
                if is_shard_manifest_name(path.name):
                    content, _ = _json(path)
                    kinds[path] = artefact_kind(content.get("description") if isinstance(content, dict) else None)
    return kinds


def require_kind(out_dir: str | Path, kind: str, *, command: str, force: bool = False) -> None:
    """Refuse ``out_dir`` unless it is empty, absent or a directory of ``kind`` (module docstring).
    ``command``: the stage's command line, named in the refusal; ``force``: its ``--force``,
    which may delete a corrupt manifest of its own kind."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return
    shards = _shard_kinds(out_dir)
    for path in (manifest_path(out_dir), out_dir / MANIFEST):
        content, corrupt = _json(path)
        found = artefact_kind(content)
        if found is not None and found != kind:
            raise _other_kind(out_dir, path, found, kind, command)
        if corrupt:
            own = bool(shards) and set(shards.values()) == {kind}
            if own and force:
                path.unlink()
                continue
            fix = f"rebuild it with `{command} --force`" if own else "delete it, or write to a new directory"
            raise MtaError(f"{path} is corrupt (not a JSON manifest); {fix}")
    for path, found in shards.items():
        if found is not None and found != kind:
            raise _other_kind(out_dir, path, found, kind, command)


def _other_kind(out_dir: Path, path: Path, found: str, kind: str, command: str) -> MtaError:
    return MtaError(
        f"{out_dir} holds another stage's output ({found}, says {path}), and `{command}` writes {kind}: "
        "it never replaces "
        "or removes another stage's output (--force included); nothing in it was touched. Give a new "
        "directory"
    )
