"""Reading a complete store directory: :func:`read_annotations` (an annotate artefact of any
schema version and layout this mta reads, upgraded to the current schema by
:mod:`mta.data.artefact_schema`), and :func:`read_stage_manifest` + :func:`verified_parts` for the
artefacts other stages write into the same layout (``mta embed``'s, ``mta teacher``'s). Readers
take no lock and write nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mta.data.artefact_schema import (
    LAYOUT_VERSION,
    SCHEMAS,
    conform,
    reannotate_command,
    stored_layout,
    stored_version,
    upgrade_to_current,
)
from mta.errors import MtaError
from mta.hashing import file_sha256
from mta.store.layout import MANIFEST, META, manifest_path, part_path
from mta.store.manifests import (
    checked_manifest,
    incomplete_message,
    read_manifest,
    read_manifest_json,
    shard_files,
    shard_manifests,
    shard_sets,
)

__all__ = ["Annotations", "read_annotations", "read_stage_manifest", "verified_parts"]


@dataclass(frozen=True)
class Annotations:
    """A complete artefact: ``manifest`` (dict) and ``table`` (all parts, rows in input order).

    Both are at the current schema version, upgraded in memory when the directory holds an
    older one; ``stored_version`` is the version on disk, ``layout`` the directory's layout.
    """

    directory: Path
    manifest: dict[str, Any]
    table: pa.Table
    stored_version: int
    layout: int = LAYOUT_VERSION

    def __len__(self) -> int:
        return self.table.num_rows

    def row(self, position: int) -> dict[str, Any]:
        """Row ``position`` (0-based, in artefact order) as plain Python values."""
        if not 0 <= position < len(self):
            raise MtaError(
                f"row {position} is out of range: {self.directory} has {len(self)} rows (0..{len(self) - 1})"
            )
        (row,) = self.table.slice(position, 1).to_pylist()
        return row


def read_annotations(out_dir: str | Path) -> Annotations:
    """Read a complete annotate artefact of any schema version and layout this mta reads,
    upgraded to the current schema (:mod:`mta.data.artefact_schema`); raise ``MtaError`` naming
    the fix when it is not. Nothing in the directory is written.

    Each part is checked against the sha256 and row count ``manifest.json`` records for it
    (hashing costs one extra pass over the part's bytes, usually from the page cache).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise MtaError(
            f"{out_dir} is a file; give the directory `mta annotate -o DIR` wrote (it holds {META}/{MANIFEST})"
        )
    if not out_dir.is_dir():
        raise MtaError(f"{out_dir} does not exist; create it with `mta annotate DATA.jsonl -o {out_dir}`")
    path = manifest_path(out_dir)
    raw = read_manifest_json(path)
    if raw is not None:
        layout = stored_layout(raw, path, out_dir)
    else:  # layout 1: manifest.json beside the parts
        path, layout = out_dir / MANIFEST, 1
        raw = read_manifest_json(path)
    if raw is None:
        shards = shard_manifests(out_dir) + list(shard_files(out_dir, legacy=True).values())
        if shards:
            raise MtaError(incomplete_message(out_dir, shard_sets(shards)))
        raise MtaError(
            f"{out_dir} has no {META}/{MANIFEST}: it is not a finished `mta annotate` output (an "
            f"interrupted run leaves none). Run `mta annotate DATA.jsonl -o {out_dir}`"
        )
    version = stored_version(raw, path, out_dir)
    manifest = checked_manifest(path, raw)
    tables = [_read_part(out_dir, manifest, part, version) for part in manifest["parts"]]
    table = pa.concat_tables(tables) if tables else SCHEMAS[version].empty_table()
    if len(tables) > 1:
        table = table.sort_by("id")
    upgraded, table = upgrade_to_current(manifest, table, out_dir)
    return Annotations(directory=out_dir, manifest=upgraded, table=table, stored_version=version, layout=layout)


def _read_part(out_dir: Path, manifest: dict[str, Any], part: dict[str, Any], version: int) -> pa.Table:
    """One checked part entry's rows, verified against its sha256 and row count."""
    path = part_path(out_dir, part["file"])

    def refused(problem: str) -> MtaError:
        command = reannotate_command(manifest, out_dir, out=Path(f"{out_dir}-rebuilt"))
        return MtaError(
            f"{path} {problem}. Annotate the input again into a new directory (this one stays "
            f"as it is): `{command}`, then use that one"
        )

    if not path.is_file():
        raise refused(f"is listed in {MANIFEST} but missing")
    try:
        digest = file_sha256(path) if part.get("sha256") is not None else None
    except OSError as error:
        raise refused(f"cannot be read ({error.strerror})") from error
    if digest is not None and digest != part["sha256"]:
        raise refused(
            f"does not match {MANIFEST}: its sha256 is {digest}, the manifest records "
            f"{part['sha256']}; the part was changed or replaced after `mta annotate` wrote it, "
            "so its rows cannot be trusted"
        )
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise refused(f"is not a readable Parquet file ({error}): it is corrupt or truncated") from error
    table = conform(table, version, str(path))
    if table.num_rows != part["rows"]:
        raise refused(f"has {table.num_rows} rows, {MANIFEST} says {part['rows']}")
    return table


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
    manifest = read_manifest(directory)
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
