"""A store directory's writer locks: one per shard, one for merging (``fcntl.flock`` through
:func:`mta.files.exclusive_lock`; the rules are in :mod:`mta.store`, "Locks")."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mta.errors import MtaError
from mta.files import LockHeld, exclusive_lock
from mta.store.layout import MERGE_LOCK, meta_directory, shard_lock_name

__all__ = ["MERGE_LOCK_WAIT_S", "merge_lock", "shard_lock"]

MERGE_LOCK_WAIT_S = 120.0  # a merge takes milliseconds; a holder this slow is stuck


def _lock_file(out_dir: Path, name: str) -> Path:
    meta = meta_directory(out_dir)
    try:
        meta.mkdir(exist_ok=True)
    except FileNotFoundError:
        raise MtaError(f"{out_dir} does not exist; give the -o directory of `mta annotate`") from None
    except PermissionError as error:
        raise MtaError(
            f"cannot create {meta}: {error.strerror}; the output must be a directory this user can write"
        ) from error
    return meta / name


@contextmanager
def shard_lock(out_dir: Path, shard: int, num_shards: int, *, command: str = "mta annotate") -> Iterator[str | None]:
    """Hold shard ``shard`` of ``num_shards`` of ``out_dir`` for writing, or refuse at once
    (``MtaError`` naming the holder's pid and the mta command it runs, or ``command``, the stage
    that writes the layout, when it did not say).
    Yields None, or a warning when the filesystem has no locks (the run goes on unprotected)."""
    path = _lock_file(out_dir, shard_lock_name(shard, num_shards))
    try:
        with exclusive_lock(path, wait_s=0, inside=out_dir) as unsupported:
            yield unsupported
    except LockHeld as held:
        which = f"shard {shard}/{num_shards} of " if num_shards > 1 else ""
        raise MtaError(
            f"another `{held.command or command}` ({held.holder}) is writing {which}{out_dir} (it holds {path}); "
            "wait for it to finish or stop it, then re-run. Other shards (--shard I/N) may run "
            "side by side; the same shard may not"
        ) from None


@contextmanager
def merge_lock(out_dir: Path) -> Iterator[None]:
    """Hold ``out_dir``'s merge lock: publishing shards, ``manifest.json``, moves and deletions."""
    path = _lock_file(out_dir, MERGE_LOCK)
    try:
        with exclusive_lock(path, wait_s=MERGE_LOCK_WAIT_S, inside=out_dir):
            yield
    except LockHeld as held:
        raise MtaError(
            f"{path} has been held by {held.holder} for over {MERGE_LOCK_WAIT_S:.0f} s while it "
            "merges shards; if that process is stuck, stop it and re-run (the lock is released "
            "when it exits)"
        ) from None
