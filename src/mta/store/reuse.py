"""Reuse or resume: whether an output directory already holds what a writer would compute.

The one rule ``mta annotate`` (:mod:`mta.data.annotate`) and ``mta embed``
(:mod:`mta.embedding.embed`) follow before they compute, and again once they hold
their shard's lock (another writer may have finished it meanwhile): a complete directory of the
same run key whose parts are intact is reused as it is; else this shard's own part, written by
an earlier run of the same key, is reused and the set merged when it is now complete; else
nothing is reused and the writer computes. A directory whose manifests are not this package's
is refused (``MtaError``) before anything is computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mta.store.kinds import require_kind
from mta.store.manifests import part_is_intact, read_manifest, read_shard_manifest
from mta.store.publish import finish_publishing, try_merge

__all__ = ["ReusableOutput", "reusable_output"]


@dataclass(frozen=True)
class ReusableOutput:
    """What an earlier run of the same run key left, returned instead of computing again.

    manifest: the directory's ``manifest.json``, or None while other shards of the set are
    missing; shard_manifest: this shard's manifest when only the shard was found, ``{}`` when
    the whole directory was.
    """

    manifest: dict[str, Any] | None
    shard_manifest: dict[str, Any] = field(default_factory=dict)


def reusable_output(
    out_dir: Path, run_key: str, shard: int, num_shards: int, *, kind: str, command: str
) -> ReusableOutput | None:
    """The output of an earlier run with ``run_key`` whose parts are intact (sha256), if any:
    the complete directory, else shard ``shard`` of ``num_shards`` (merged into the set's
    ``manifest.json`` when the set is complete). Every manifest is checked first, a layout 1
    directory adopted and a publish cut short finished (:func:`finish_publishing`). A directory
    of another artefact kind than ``kind`` is refused first (:func:`mta.store.kinds.require_kind`)."""
    if not out_dir.is_dir():
        return None
    require_kind(out_dir, kind, command=command)
    finish_publishing(out_dir)
    manifest = read_manifest(out_dir)
    if (
        manifest is not None
        and manifest.get("run_key") == run_key
        and all(part_is_intact(out_dir, part) for part in manifest["parts"])
    ):
        return ReusableOutput(manifest)
    shard_manifest = read_shard_manifest(out_dir, shard, num_shards)
    if (
        shard_manifest is not None
        and shard_manifest.get("run_key") == run_key
        and part_is_intact(out_dir, shard_manifest["part"])
    ):
        return ReusableOutput(try_merge(out_dir, run_key, num_shards), shard_manifest)
    return None
