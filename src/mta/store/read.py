"""Reading a complete store directory: :func:`read_stage_manifest` + :func:`verified_parts`, for
the artefacts stages write into the store's layout (``mta embed``'s, ``mta teacher``'s; annotate's
own reader, which upgrades old schema versions, is :func:`mta.data.annotations.read_annotations`).
Readers take no lock and write nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mta.errors import MtaError
from mta.hashing import file_sha256
from mta.store.layout import META, manifest_path, part_path
from mta.store.manifests import read_manifest

__all__ = ["read_stage_manifest", "verified_parts"]


def read_stage_manifest(
    directory: Path,
    *,
    artefact: str,
    version_key: str,
    version: int | tuple[int, ...],
    command: str,
    build: str,
    what: str = "",
) -> dict[str, Any]:
    """The manifest of a finished ``command`` output (``artefact``, ``version_key`` = ``version``
    or one of ``version``'s),
    or ``MtaError`` naming the fix: no directory (``build``: the command line that makes it), no
    manifest (an interrupted or partly sharded run), another artefact, another version.
    ``what``: a prefix naming where the directory was given (``"teacher_cache.dir: "``)."""
    if not directory.is_dir():
        raise MtaError(f"{what}{directory} does not exist; build it with `{build}`")
    manifest = read_manifest(directory, f"rebuild it: `{build} --force`")
    if manifest is None:
        raise MtaError(
            f"{what}{directory} has no {META}/manifest.json: it is not a finished `{command}` output (an "
            f"interrupted or partly sharded run leaves none); re-run the same `{command}` command to finish it"
        )
    if manifest.get("artefact") != artefact:
        raise MtaError(
            f"{what}{manifest_path(directory)} is not a {artefact} artefact (artefact: "
            f"{manifest.get('artefact')!r}); give the -o directory of `{command}`"
        )
    readable = version if isinstance(version, tuple) else (version,)
    if manifest.get(version_key) not in readable:
        raise MtaError(
            f"{what}{manifest_path(directory)} has {version_key} {manifest.get(version_key)!r}; this mta reads "
            f"version {' or '.join(map(str, readable))}: re-run `{command}` into a new directory (or with --force)"
        )
    return manifest


def verified_parts(directory: Path, manifest: dict[str, Any], *, command: str) -> list[tuple[Path, dict[str, Any]]]:
    """``(path, manifest entry)`` of every part the manifest lists, each present and matching its
    sha256; ``MtaError`` naming the part and ``command ... --force`` otherwise."""
    parts = []
    for part in manifest["parts"]:
        path = part_path(directory, part["file"])
        if not path.is_file():
            raise MtaError(f"{path} is listed in the manifest but missing; re-run `{command} ... --force`")
        if part.get("sha256") is not None and file_sha256(path) != part["sha256"]:
            raise MtaError(
                f"{path} does not match the manifest's sha256: it was changed after `{command}` wrote it; "
                f"re-run `{command} ... --force` into this or a new directory"
            )
        parts.append((path, part))
    return parts
