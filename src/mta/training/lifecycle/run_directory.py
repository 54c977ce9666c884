"""Whose ``output_dir`` this is: one run per directory, never mixed with another's.

A run's outputs are ``run.json`` (its identity, written when it starts), ``checkpoints/``,
``final/``, ``best/`` and ``metrics.jsonl``. The directory also holds caches that are valid for any run,
``data/`` (annotations made on first use, keyed by their content) and ``models/`` (tiny models
and tokenizers, keyed by their description); they are never removed here.

A run starting in a directory that holds another run's outputs is refused, unless it is told
what to do with them: ``--resume auto`` continues that run (same ``run_id``), ``--overwrite``
removes its outputs before the first step and starts a new one. Without either, nothing on disk
is touched.
"""

from __future__ import annotations

import datetime
import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from mta import distributed
from mta.errors import MtaError
from mta.files import atomic_write_json

RUN_RECORD = "run.json"
# Everything a run writes of its own; a later output of a run belongs here too.
RUN_OUTPUTS = (RUN_RECORD, "checkpoints", "final", "best", "metrics.jsonl", "generated", "tensorboard", "tracking.json")
CACHES = ("data", "models")


@dataclass(frozen=True)
class RunClaim:
    """The run that owns ``output_dir``: ``run_id`` goes into every checkpoint it writes."""

    output_dir: Path
    run_id: str
    continued: bool  # True when an earlier run's outputs are continued (--resume)


def existing_outputs(output_dir: Path) -> list[str]:
    """The run outputs present in ``output_dir`` (an empty ``checkpoints/`` does not count)."""
    present = []
    for name in RUN_OUTPUTS:
        path = output_dir / name
        if path.is_dir() and name == "checkpoints" and not any(path.iterdir()):
            continue
        if path.exists():
            present.append(name + ("/" if path.is_dir() else ""))
    return present


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


def _remove_outputs(output_dir: Path) -> None:
    for name in RUN_OUTPUTS:
        path = output_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


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
            decision = _decide(output_dir, recipe_name, resume=resume, overwrite=overwrite)
        except MtaError as error:
            failure = str(error)
    failure, decision = distributed.broadcast_from_main((failure, decision))
    if failure is not None:
        raise MtaError(failure)
    run_id, continued = decision
    return RunClaim(output_dir, run_id, continued)


def _decide(output_dir: Path, recipe_name: str, *, resume: str | None, overwrite: bool) -> tuple[str, bool]:
    output_dir.mkdir(parents=True, exist_ok=True)
    present = existing_outputs(output_dir)
    if present and resume is not None:
        # A checkpoint written before run ids existed belongs to the run "" (see checkpointing).
        return _read_run_id(output_dir) or "", True
    if present and overwrite:
        _remove_outputs(output_dir)
    elif present:
        raise MtaError(
            f"{output_dir} holds another run's outputs ({', '.join(present)}); continue that run "
            "with --resume auto, or start over with --overwrite (removes "
            f"{', '.join(RUN_OUTPUTS)}; keeps the {' and '.join(CACHES)} caches), or choose another output_dir"
        )
    return _start_run(output_dir, recipe_name), False
