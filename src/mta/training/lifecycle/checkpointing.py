"""Checkpoints a person can use without mta, and a run can resume from exactly: the layout of
``checkpoints/step-N/``, ``final/`` and ``best/``, what a resume verifies and what pruning removes
are in ARCHITECTURE.md, "2. distill". Each checkpoint is built in ``step-N.partial`` and renamed
when complete (a failed save removes the partial directory); ``--resume auto`` takes the newest
of ``complete_checkpoints``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from mta import distributed
from mta.errors import MtaError
from mta.files import atomic_write_json, atomic_write_text, publish_directory, remove_path, write_failure
from mta.hashing import CHECKSUMS, checksum_differences, checksum_text, directory_checksums, read_checksums
from mta.training import lora
from mta.training.config.loading import recipe_to_yaml
from mta.training.config.schema import Recipe
from mta.training.lifecycle import safe_loading
from mta.training.lifecycle.model_card import write_model_card
from mta.versions import package_versions

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"
DEEPSPEED_DIR = "deepspeed"
DEEPSPEED_TAG = "state"
BEST_DIR = "best"  # the student selected by train.select_by (mta.training.lifecycle.selection)
SELECTION_FILE = "selection.json"


@dataclass
class TrainerState:
    """What the loop needs beyond DeepSpeed's state to continue exactly where it stopped.

    step: optimizer steps completed; the batches to come follow from it (see
    ``mta.training.batching``). rng: the ``torch`` CPU generator state of each rank (dropout).
    run_id: the run that wrote the checkpoint (``mta.training.lifecycle.run_directory``); ``""`` in
    checkpoints of older mta.
    """

    step: int
    total_steps: int
    rng: list[list[int]] = field(default_factory=list)
    run_id: str = ""


def checkpoints_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def _published(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-N`` under ``root`` with its state file, oldest first."""
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = STEP_DIR.match(child.name)
            if match and (child / STATE_FILE).exists():
                found.append((int(match.group(1)), child))
    return sorted(found)


def complete_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete (published) checkpoint, oldest first.

    Complete means written to the end and renamed into place; whether its bytes are still the
    ones written is checked when it is resumed (``verify_checkpoint``), not here.
    """
    return _published(checkpoints_dir(output_dir))


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = complete_checkpoints(output_dir)
    return found[-1][1] if found else None


def resolve_resume(resume: str | None, output_dir: Path) -> Path | None:
    """``--resume``: None (start fresh), ``"auto"`` (newest complete checkpoint, if any) or a path.

    ``load_checkpoint`` then verifies it: a damaged newest checkpoint is refused with the
    previous one offered, never skipped silently.
    """
    if resume is None:
        return None
    if resume == "auto":
        return latest_checkpoint(output_dir)
    path = Path(resume)
    if not (path / STATE_FILE).exists():
        raise MtaError(
            f"--resume {resume}: not a complete checkpoint (no {STATE_FILE}); give a "
            f"{checkpoints_dir(output_dir)}/step-N directory or --resume auto"
        )
    return path


# --------------------------------------------------------------------------- verification


def _read_state(path: Path) -> TrainerState:
    """``path``'s ``trainer_state.json``; MtaError naming the file when it is not a valid one."""
    state_file = path / STATE_FILE
    try:
        raw = json.loads(state_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MtaError(f"{state_file} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MtaError(f"{state_file} is not valid JSON (truncated or corrupt: {error})") from error
    known = {f.name for f in fields(TrainerState)}
    if not isinstance(raw, dict):
        raise MtaError(f"{state_file} is not a JSON object")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise MtaError(
            f"{state_file} has keys this mta does not know ({', '.join(unknown)}): it was written "
            "by a newer mta; resume with that version"
        )
    try:
        state = TrainerState(**raw)
    except TypeError as error:
        raise MtaError(f"{state_file} lacks a required key ({error})") from error
    if not (
        isinstance(state.step, int)
        and isinstance(state.total_steps, int)
        and isinstance(state.rng, list)
        and isinstance(state.run_id, str)
    ):
        raise MtaError(f"{state_file}: step/total_steps must be integers, rng a list, run_id a string")
    return state


def _problem(path: Path) -> tuple[str | None, bool]:
    """Why ``path`` cannot be resumed as it was written (None: it can), and whether it has a
    checksum list. Reads every file's bytes (hashing) and each state file's pickle opcodes."""
    if not (path / STATE_FILE).is_file():
        return f"{path} is not a complete checkpoint (no {STATE_FILE})", False
    try:
        recorded = read_checksums(path)
    except (MtaError, OSError, UnicodeDecodeError) as error:
        return f"{path}: {error}", True
    listed = recorded is not None
    if recorded is not None:
        changes = checksum_differences(path, recorded)
        if changes:
            return (
                f"{path} is not the checkpoint that was written: "
                + "; ".join(changes)
                + f" (compared with its {CHECKSUMS})"
            ), listed
    # Without a list (older mta) these are the only checks; with one they catch nothing new
    # but a state file written by other software with the list rewritten to match.
    state_dir = path / DEEPSPEED_DIR / DEEPSPEED_TAG
    if not state_dir.is_dir():
        return f"{state_dir} is missing: the checkpoint has no DeepSpeed state to resume", listed
    state_files = sorted(state_dir.glob("*.pt"))
    if not any(f.name.endswith("model_states.pt") for f in state_files):
        return f"{state_dir} holds no *model_states.pt file", listed
    try:
        _read_state(path)
        for state_file in state_files:
            safe_loading.check_state_file(state_file)
    except MtaError as error:
        return str(error), listed
    return None, listed


def _offer(path: Path) -> str:
    """The way on from a refused ``path``: the newest other checkpoint beside it that passes."""
    root = path.parent
    for _, other in reversed(_published(root)):
        if other.resolve() == path.resolve():
            continue
        if _problem(other)[0] is None:
            return f"Resume from the previous complete checkpoint instead: --resume {other}"
    return (
        f"No other checkpoint under {root} passes these checks: start over with --overwrite, "
        "or resume from a copy you trust"
    )


def verify_checkpoint(path: Path) -> None:
    """Refuse (MtaError naming the file(s) and the previous checkpoint) a checkpoint whose files
    are not the ones written, or that cannot be resumed; warn when it has no checksum list."""
    problem, listed = _problem(Path(path))
    if problem is not None:
        raise MtaError(
            f"{problem}; the checkpoint was not loaded (nothing of it was read into the run). {_offer(Path(path))}"
        )
    if not listed:
        log.warning(
            "%s has no %s (written by an older mta): its files could not be verified; resuming "
            "from it after structural checks only",
            path,
            CHECKSUMS,
        )


# --------------------------------------------------------------------------- saving


def student_state_dict(engine: Any) -> dict[str, torch.Tensor] | None:
    """The student's full state dict (on rank 0; under ZeRO-3 None elsewhere). Every rank calls."""
    if engine.zero_optimization_partition_weights():
        # Gathers one layer at a time onto rank 0's CPU (what accelerate's get_state_dict uses),
        # so a model larger than one device still exports.
        state = engine._zero3_consolidated_16bit_state_dict()
        prefix = "student."
        return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)} if state else None
    return engine.module.student.state_dict()


def export_student(
    engine: Any, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, directory: Path, *, adapter: bool = False
) -> None:
    """The student in Hugging Face format (+ tokenizer, recipe, versions) into ``directory``.

    Under ZeRO-3 the shards are gathered first; every rank must call this. A LoRA student is
    written with its adapters merged (``mta.training.lora``), and with ``adapter`` its adapter
    alone also into ``directory/adapter/`` (checkpoints).
    """
    state = student_state_dict(engine)
    if distributed.is_main():
        directory.mkdir(parents=True, exist_ok=True)
        student = engine.module.student
        if lora.is_wrapped(student):
            assert state is not None, "student_state_dict gives the main process the whole state"
            if adapter:
                lora.save_adapter(student, state, directory, base_model=getattr(student, "name_or_path", None))
            state = lora.merged_state_dict(student, state)
        student.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(str(directory))
        export_files = getattr(engine.module, "export_files", None)
        if export_files is not None:  # task: embedding: the sentence-transformers modules too
            export_files(directory)
        atomic_write_text(directory / "recipe.yaml", recipe_to_yaml(recipe))
        atomic_write_json(directory / "versions.json", package_versions())


def _write_checksums(directory: Path) -> None:
    """``checksums.sha256`` over everything in ``directory``: the last file before publishing."""
    atomic_write_text(directory / CHECKSUMS, checksum_text(directory_checksums(directory)))


@contextmanager
def _removed_on_error(final: Path, partial: Path, kept: str) -> Iterator[None]:
    """On any error the partial directory goes; a full disk or a directory that cannot be written
    (``mta.files.write_failure``: any library's form, safetensors' included) becomes one MtaError.

    kept: what the message can promise about what was there before (a clause).
    """
    try:
        yield
    except BaseException as error:
        # Before removing the partial files: they are what fills the disk.
        ours = isinstance(error, MtaError) or not isinstance(error, Exception)
        failure = None if ours else write_failure(error, final)
        if distributed.is_main():
            shutil.rmtree(partial, ignore_errors=True)
        if failure is not None:
            fix = failure.fix if failure.full else f"make {final.parent} writable by this user"
            raise MtaError(
                f"{failure.headline(final)}; nothing was lost: the unfinished {partial.name} "
                f"was removed and {kept}; {fix} and continue with --resume auto"
            ) from error
        raise


def _run_id_of(path: Path) -> str | None:
    """The run that wrote checkpoint ``path`` (None when its state cannot be read)."""
    try:
        raw = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
        return str(raw.get("run_id", "")) if isinstance(raw, dict) else None
    except (OSError, ValueError):
        return None


def prune_checkpoints(root: Path, state: TrainerState, keep: int) -> None:
    """Remove this run's checkpoints older than ``state.step`` beyond the newest ``keep`` (the
    one just written counts). Another run's, or one whose state cannot be read, stay. A
    checkpoint that is a link is pruned as a link: the link goes, what it points to stays (said in
    the log); one that cannot be removed is named in the log, never skipped in silence."""
    own_older = [path for step, path in _published(root) if step < state.step and _run_id_of(path) == state.run_id]
    for old in own_older[: max(0, len(own_older) - (keep - 1))]:
        target = old.readlink() if old.is_symlink() else None
        try:
            remove_path(old)
        except OSError as error:
            log.warning("could not prune %s (%s): it stays until removed by hand", old, error.strerror or error)
            continue
        if target is not None:
            log.warning("pruned %s, a link: the link was removed, %s (what it points to) is kept", old, target)


def save_checkpoint(
    engine: Any,
    tokenizer: PreTrainedTokenizerBase,
    recipe: Recipe,
    output_dir: Path,
    state: TrainerState,
    *,
    extra_state: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``checkpoints/step-N`` atomically, then drop this run's checkpoints beyond the
    newest ``keep_checkpoints``. ``extra_state(directory)``: more of the run's state, written by
    every rank into the checkpoint before its checksum list (JSON or Parquet, never pickles)."""
    root = checkpoints_dir(output_dir)
    final = root / f"step-{state.step}"
    partial = root / f"step-{state.step}.partial"
    earlier = [path.name for _, path in _published(root) if path != final]
    kept = (
        f"the earlier checkpoints ({', '.join(earlier)}) are intact" if earlier else "there was no earlier checkpoint"
    )
    with _removed_on_error(final, partial, kept):
        if distributed.is_main():
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        distributed.barrier()
        export_student(engine, tokenizer, recipe, partial, adapter=True)
        engine.save_checkpoint(str(partial / DEEPSPEED_DIR), tag=DEEPSPEED_TAG)
        if extra_state is not None:
            extra_state(partial)
            distributed.barrier()
        rng = distributed.gather_objects(torch.get_rng_state().tolist())
        if distributed.is_main():
            atomic_write_json(partial / STATE_FILE, asdict(state) | {"rng": rng})
            _write_checksums(partial)
            if final.exists() and _run_id_of(final) != state.run_id:
                log.warning("replacing %s, written by another run (run_id %r)", final, _run_id_of(final))
            # Replaces a checkpoint of the same step from an earlier, overtaken attempt.
            publish_directory(partial, final)
    if distributed.is_main():
        prune_checkpoints(root, state, recipe.train.keep_checkpoints)
    distributed.barrier()
    return final


def load_checkpoint(engine: Any, path: Path) -> TrainerState:
    """Verify ``path`` (``verify_checkpoint``), then restore weights, optimizer, schedule and
    this rank's RNG from it, reading DeepSpeed's files through ``mta.training.lifecycle.safe_loading``."""
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    path = Path(path)
    refusal = None
    if distributed.is_main():  # hashes every file once, not once per rank
        try:
            verify_checkpoint(path)
        except MtaError as error:
            refusal = str(error)
    refusal = distributed.broadcast_from_main(refusal)
    if refusal is not None:
        raise MtaError(refusal)
    state = _read_state(path)
    deepspeed_dir = path / DEEPSPEED_DIR
    try:
        with safe_loading.restricted_loading(engine):
            loaded, _ = engine.load_checkpoint(str(deepspeed_dir), tag=DEEPSPEED_TAG)
    except safe_loading.CheckpointFileError as error:
        raise MtaError(f"{error}; the file was not loaded and the resume stopped. {_offer(path)}") from error
    except (RuntimeError, KeyError, ValueError, AssertionError, ZeRORuntimeException) as error:
        raise MtaError(
            f"{deepspeed_dir}: DeepSpeed could not restore this state into the run "
            f"({type(error).__name__}: {error}); was it written with another model, ZeRO stage or "
            f"number of processes? {_offer(path)}"
        ) from error
    if loaded is None:
        raise MtaError(f"{deepspeed_dir}: DeepSpeed found no state to load. {_offer(path)}")
    if distributed.rank() < len(state.rng):
        torch.set_rng_state(torch.tensor(state.rng[distributed.rank()], dtype=torch.uint8))
    return state


def save_final(engine: Any, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, output_dir: Path) -> Path:
    """``final/`` in Hugging Face format, replacing an earlier one only once the new one is whole."""

    def card(directory: Path) -> None:
        # README.md: the model card, with the step of the newest checkpoint (the trainer saves
        # the last step just before) and the run's last dev metrics; checksummed with the rest.
        latest = latest_checkpoint(output_dir)
        step = _read_state(latest).step if latest is not None else None
        write_model_card(directory, recipe, step=step, metrics_path=output_dir / "metrics.jsonl")

    return _save_student(
        engine, tokenizer, recipe, output_dir / "final", "the checkpoints and any earlier final/ are intact", card
    )


def save_best(
    engine: Any, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, output_dir: Path, selection: dict[str, Any]
) -> Path:
    """``best/``: the student now, in Hugging Face format like ``final/``, with
    ``selection.json`` (``selection``: the metric, its value, the step; ``mta.training.lifecycle.selection``)
    and a model card that names them; it replaces an earlier ``best/`` only once whole."""

    def card(directory: Path) -> None:
        atomic_write_json(directory / SELECTION_FILE, selection)
        write_model_card(
            directory,
            recipe,
            step=selection["step"],
            metrics_path=output_dir / "metrics.jsonl",
            what="best",
            selection=selection,
        )

    return _save_student(
        engine,
        tokenizer,
        recipe,
        output_dir / BEST_DIR,
        "the checkpoints, final/ and the earlier best/ are intact",
        card,
    )


def _save_student(
    engine: Any,
    tokenizer: PreTrainedTokenizerBase,
    recipe: Recipe,
    final: Path,
    kept: str,
    finish: Callable[[Path], None],
) -> Path:
    """Export the student into ``final`` through ``<final>.partial``: ``finish(partial)`` adds the
    card (main process), then the checksum list, then the rename. Every rank calls this."""
    partial = final.with_name(final.name + ".partial")
    with _removed_on_error(final, partial, kept):
        if distributed.is_main():
            shutil.rmtree(partial, ignore_errors=True)
        distributed.barrier()
        export_student(engine, tokenizer, recipe, partial)
        if distributed.is_main():
            finish(partial)
            _write_checksums(partial)
            publish_directory(partial, final)
    distributed.barrier()
    return final
