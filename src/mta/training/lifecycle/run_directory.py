"""Whose ``output_dir`` this is: one run per directory, never mixed with another's. A run's
outputs (``run.json``, ``checkpoints/``, ``final/``, ``best/``, ``metrics.jsonl``) are refused to
another run unless ``--resume`` continues it or ``--overwrite`` removes them; the caches
(``data/``, ``models/``) stay. Global rank 0 holds ``RUN_LOCK`` from the claim until ``release``.
The rules: ARCHITECTURE.md, "2. distill".
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mta import distributed
from mta.errors import MtaError
from mta.files import (
    LockHeld,
    atomic_write_json,
    exclusive_lock,
    make_output_directory,
    read_jsonl_lenient,
    removal_problems,
    remove_path,
)
from mta.training.lifecycle.checkpointing import checkpoints_dir, complete_checkpoints

log = logging.getLogger(__name__)

RUN_RECORD = "run.json"
RUN_LOCK = ".run.lock"  # held by rank 0 while a run owns the directory (flock; gone after)
METRICS = "metrics.jsonl"
# Everything a run writes of its own; a later output of a run belongs here too.
RUN_OUTPUTS = (RUN_RECORD, "checkpoints", "final", "best", METRICS, "generated", "tensorboard", "tracking.json")
# What a run writes before its first step ends (metrics.jsonl: the step-0 dev baseline only).
START_OUTPUTS = (RUN_RECORD, METRICS, "tensorboard", "tracking.json")
CACHES = ("data", "models")
RECORD_LABELS = {"run_id": "run", "recipe": "recipe", "started": "started"}  # run.json, as messages name it

# The locks this process holds, by directory (rank 0 only; False: the file system has none, so
# nothing is held), and the directories whose file system was already reported as lacking locks.
_HELD: dict[Path, tuple[ExitStack, bool]] = {}
_WARNED: set[Path] = set()


@dataclass(frozen=True)
class RunClaim:
    """The run that owns ``output_dir``: ``run_id`` goes into every checkpoint it writes."""

    output_dir: Path
    run_id: str
    continued: bool  # True when an earlier run's outputs are continued (--resume)


def _present(output_dir: Path) -> list[str]:
    """The names in ``RUN_OUTPUTS`` present in ``output_dir``, links (even dangling ones)
    included; an empty ``checkpoints/`` does not count."""
    present = []
    for name in RUN_OUTPUTS:
        path = output_dir / name
        if name == "checkpoints" and path.is_dir() and not any(path.iterdir()):
            continue
        if os.path.lexists(path):
            present.append(name)
    return present


def _shown(output_dir: Path, name: str) -> str:
    path = output_dir / name
    if path.is_symlink():
        return f"{name} (a link to {path.readlink()})"
    return name + ("/" if path.is_dir() else "")


def existing_outputs(output_dir: Path) -> list[str]:
    """The run outputs present in ``output_dir`` (an empty ``checkpoints/`` does not count), as a
    message names them: ``final/``, ``metrics.jsonl``, ``best (a link to /x)``."""
    return [_shown(output_dir, name) for name in _present(output_dir)]


def _run_record(output_dir: Path) -> dict[str, Any] | None:
    """``run.json`` as written, or None when it is absent or unreadable (messages only)."""
    try:
        record = json.loads((output_dir / RUN_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _failed_start(output_dir: Path, present: list[str]) -> bool:
    """Whether ``present`` is only what a run leaves when it fails before its first step ends:
    ``run.json`` and at most ``START_OUTPUTS``, with no train record (nor a later step) in
    ``metrics.jsonl``."""
    if RUN_RECORD not in present or not set(present) <= set(START_OUTPUTS):
        return False
    if any((output_dir / name).is_symlink() for name in present):
        return False  # a link is someone's arrangement, not a run's leftover
    records = read_jsonl_lenient(output_dir / METRICS)
    return all(record.get("split") != "train" and record.get("step") == 0 for record in records)


def _checkpoint_note(output_dir: Path) -> str:
    """What a resume of the run in ``output_dir`` would continue from, for a refusal."""
    found = complete_checkpoints(output_dir)
    if found:
        step, path = found[-1]
        return f"its last complete checkpoint is {path} (step {step})"
    return (
        f"it has no complete checkpoint under {checkpoints_dir(output_dir)}, "
        "so --resume auto would start it again at step 0"
    )


def _read_run_id(output_dir: Path) -> str | None:
    path = output_dir / RUN_RECORD
    try:
        return str(json.loads(path.read_text(encoding="utf-8"))["run_id"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as error:
        raise MtaError(
            f"{path} is corrupt ({error}); if this directory is yours, start over with --overwrite"
        ) from error


def _remove_outputs(output_dir: Path, present: list[str]) -> None:
    """Remove the outputs ``present`` names, once each of them is known to be removable (else
    MtaError, nothing removed): links as links, ``run.json`` last (until it goes, the directory
    still says which run owns it)."""
    problems = [problem for name in present for problem in removal_problems(output_dir / name)]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise MtaError(
            f"cannot remove the outputs of the run in {output_dir}: {shown}. Nothing was removed; "
            "make them removable, or choose another output_dir"
        )
    for name in sorted(present, key=lambda name: name == RUN_RECORD):
        path = output_dir / name
        if path.is_symlink():
            log.warning("removed the link %s; %s, what it points to, is kept", path, path.readlink())
        remove_path(path)


def _start_run(output_dir: Path, recipe_name: str) -> str:
    run_id = uuid.uuid4().hex
    atomic_write_json(
        output_dir / RUN_RECORD,
        {
            "run_id": run_id,
            "recipe": recipe_name,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
    )
    return run_id


def claim(output_dir: Path, recipe_name: str, *, resume: str | None, overwrite: bool) -> RunClaim:
    """Decide (on rank 0) and agree (on every rank) which run owns ``output_dir``.

    resume: ``--resume`` (None, ``"auto"`` or a checkpoint path); overwrite: ``--overwrite``.
    Raises ``MtaError`` naming the directory and both ways on when it holds another run's
    outputs and neither was given.
    """
    if resume is not None and overwrite:
        raise MtaError("--resume continues a run and --overwrite removes it: give one of them")
    failure, decision = None, None
    if distributed.is_main():
        try:
            make_output_directory(output_dir, "output_dir")
            locked = _lock(output_dir)
            decision = _decide(output_dir, recipe_name, resume=resume, overwrite=overwrite, locked=locked)
        except MtaError as error:
            release(output_dir)
            failure = str(error)
    failure, decision = distributed.broadcast_from_main((failure, decision))
    if failure is not None:
        raise MtaError(failure)
    run_id, continued = decision
    return RunClaim(output_dir, run_id, continued)


def _decide(
    output_dir: Path, recipe_name: str, *, resume: str | None, overwrite: bool, locked: bool
) -> tuple[str, bool]:
    """``(run_id, continued)``; ``locked``: this process holds the lock, so a run that left only
    its start cannot still be loading its models (without a lock such a directory is refused)."""
    present = _present(output_dir)
    if present and resume is not None:
        # A checkpoint written before run ids existed belongs to the run "" (see checkpointing).
        return _read_run_id(output_dir) or "", True
    if present and overwrite:
        _remove_outputs(output_dir, present)
    elif present and locked and _failed_start(output_dir, present):
        record = _run_record(output_dir) or {}
        log.warning(
            "%s holds only the start of run %s (recipe %s, started %s), which ended before its first "
            "step (no checkpoint, no train metrics): this run takes the directory over and removes %s",
            output_dir,
            *(record.get(key, "?") for key in RECORD_LABELS),
            ", ".join(existing_outputs(output_dir)),
        )
        _remove_outputs(output_dir, present)
    elif present:
        found = _run_record(output_dir) or {}
        known = [f"{label} {found[key]}" for key, label in RECORD_LABELS.items() if key in found]
        owner = f" ({', '.join(known)})" if known else ""
        raise MtaError(
            f"{output_dir} holds another run's outputs ({', '.join(existing_outputs(output_dir))})"
            f"{owner}; {_checkpoint_note(output_dir)}. Continue that run "
            "with --resume auto, or start over with --overwrite (removes "
            f"{', '.join(RUN_OUTPUTS)}; keeps the {' and '.join(CACHES)} caches), or choose another output_dir"
        )
    return _start_run(output_dir, recipe_name), False


def lock(output_dir: Path) -> None:
    """Take ``output_dir``'s run lock now, on rank 0, before the slow part of a start (the
    training stack's imports, the models): a second run into the directory is refused in
    seconds. ``claim`` keeps the lock (one per process), ``release`` frees it."""
    make_output_directory(output_dir, "output_dir")
    _lock(output_dir)


def _lock(output_dir: Path) -> bool:
    """Take ``output_dir``'s run lock for this process (kept until ``release``; taken once per
    process), or refuse: ``MtaError`` naming the holder. Whether a lock is held: without
    ``flock`` there, False and a warning (once)."""
    key = output_dir.resolve()
    if key in _HELD:
        return _HELD[key][1]
    path = output_dir / RUN_LOCK
    stack = ExitStack()
    try:
        unsupported = stack.enter_context(exclusive_lock(path, wait_s=0))
    except LockHeld as held:
        raise MtaError(
            f"another `{held.command or 'mta distill'}` ({held.holder}) is training into {output_dir} "
            f"(it holds {path}): "
            "two runs in one directory would write the same checkpoints and metrics.jsonl. Wait for "
            "it to end or stop it (a job submitted twice: cancel one), or give this run another output_dir"
        ) from None
    _HELD[key] = (stack, unsupported is None)
    if unsupported is not None and key not in _WARNED:
        _WARNED.add(key)
        log.warning(
            "%s: nothing keeps a second `mta distill` (a job submitted twice) out of %s, and a run that "
            "failed before its first step is not taken over (--resume auto continues it); make sure one "
            "runs at a time",
            unsupported,
            output_dir,
        )
    return unsupported is None


def release(output_dir: Path) -> None:
    """Give up ``output_dir``'s run lock if this process holds it (a no-op otherwise; every rank
    may call it): the run that claimed the directory has ended."""
    held = _HELD.pop(output_dir.resolve(), None)
    if held is not None:
        held[0].close()
