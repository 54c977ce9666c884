"""Checkpoints a person can use without mta, and a run can resume from exactly.

Layout under the run's output directory::

    checkpoints/step-N/             one complete checkpoint
        config.json, model.safetensors, tokenizer files   (plain Hugging Face format)
        recipe.yaml, versions.json                        (what produced it)
        deepspeed/                                        (engine, optimizer and scheduler state)
        trainer_state.json                                (step, RNG state; written last)
    final/                          the last weights, Hugging Face format + recipe + versions

Every checkpoint is written into ``step-N.partial`` and renamed to ``step-N`` only when
complete, so a crash at any point leaves the previous checkpoints untouched and never a
directory that looks complete; ``latest_checkpoint`` ignores anything else.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from transformers import PreTrainedTokenizerBase

from mta import distributed
from mta.errors import MtaError
from mta.files import atomic_write_json, atomic_write_text, publish_directory
from mta.versions import package_versions
from mta.training.recipe import Recipe, recipe_to_yaml

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"
DEEPSPEED_DIR = "deepspeed"
DEEPSPEED_TAG = "state"


@dataclass
class TrainerState:
    """What the loop needs beyond DeepSpeed's state to continue exactly where it stopped.

    step: optimizer steps completed; the batches to come follow from it (see
    ``mta.training.batching``). rng: the ``torch`` CPU generator state of each rank (dropout).
    """

    step: int
    total_steps: int
    rng: list[list[int]] = field(default_factory=list)


def checkpoints_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def complete_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint, oldest first."""
    root = checkpoints_dir(output_dir)
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = STEP_DIR.match(child.name)
            if match and (child / STATE_FILE).exists():
                found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(output_dir: Path) -> Optional[Path]:
    found = complete_checkpoints(output_dir)
    return found[-1][1] if found else None


def resolve_resume(resume: Optional[str], output_dir: Path) -> Optional[Path]:
    """``--resume``: None (start fresh), ``"auto"`` (newest complete checkpoint, if any) or a path."""
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


def _export_hf(engine, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, directory: Path) -> None:
    """The student in Hugging Face format (+ tokenizer, recipe, versions) into ``directory``.

    Under ZeRO-3 the shards are gathered first; every rank must call this.
    """
    student = engine.module.student
    if engine.zero_optimization_partition_weights():
        # Gathers one layer at a time onto rank 0's CPU (what accelerate's get_state_dict uses),
        # so a model larger than one device still exports.
        state = engine._zero3_consolidated_16bit_state_dict()
        prefix = "student."
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)} if state else None
    else:
        state = student.state_dict()
    if distributed.is_main():
        directory.mkdir(parents=True, exist_ok=True)
        student.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(str(directory))
        atomic_write_text(directory / "recipe.yaml", recipe_to_yaml(recipe))
        atomic_write_json(directory / "versions.json", package_versions())


def save_checkpoint(
    engine, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, output_dir: Path, state: TrainerState
) -> Path:
    """Write ``checkpoints/step-N`` atomically, then drop all but the newest ``keep_checkpoints``."""
    root = checkpoints_dir(output_dir)
    final = root / f"step-{state.step}"
    partial = root / f"step-{state.step}.partial"
    if distributed.is_main():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    distributed.barrier()
    _export_hf(engine, tokenizer, recipe, partial)
    engine.save_checkpoint(str(partial / DEEPSPEED_DIR), tag=DEEPSPEED_TAG)
    rng = distributed.gather_objects(torch.get_rng_state().tolist())
    if distributed.is_main():
        atomic_write_json(partial / STATE_FILE, asdict(state) | {"rng": rng})
        # Replaces a checkpoint of the same step from an earlier, overtaken attempt.
        publish_directory(partial, final)
        for _, old in complete_checkpoints(output_dir)[: -recipe.train.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return final


def load_checkpoint(engine, path: Path) -> TrainerState:
    """Restore weights, optimizer, schedule and this rank's RNG from ``path``."""
    loaded, _ = engine.load_checkpoint(str(path / DEEPSPEED_DIR), tag=DEEPSPEED_TAG)
    if loaded is None:
        raise MtaError(f"{path}: the DeepSpeed state could not be loaded; resume from another checkpoint")
    state = TrainerState(**json.loads((path / STATE_FILE).read_text(encoding="utf-8")))
    if distributed.rank() < len(state.rng):
        torch.set_rng_state(torch.tensor(state.rng[distributed.rank()], dtype=torch.uint8))
    return state


def save_final(engine, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, output_dir: Path) -> Path:
    """``final/`` in Hugging Face format, replacing an earlier one only once the new one is whole."""
    final = output_dir / "final"
    partial = output_dir / "final.partial"
    if distributed.is_main():
        shutil.rmtree(partial, ignore_errors=True)
    distributed.barrier()
    _export_hf(engine, tokenizer, recipe, partial)
    if distributed.is_main():
        publish_directory(partial, final)
    distributed.barrier()
    return final
