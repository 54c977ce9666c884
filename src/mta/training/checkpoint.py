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
import os
import platform
import re
import shutil
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from mta.errors import MtaError
from mta.training.recipe import Recipe, recipe_to_yaml

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"
DEEPSPEED_DIR = "deepspeed"
DEEPSPEED_TAG = "state"
VERSIONED_PACKAGES = (
    "mta", "torch", "transformers", "tokenizers", "deepspeed", "safetensors", "spacy", "pyarrow",
)


@dataclass
class TrainerState:
    """What the loop needs beyond DeepSpeed's state to continue exactly where it stopped.

    step: optimizer steps completed; the batches to come follow from it (see
    ``mta.training.batching``). rng: the ``torch`` CPU generator state of each rank (dropout).
    """

    step: int
    total_steps: int
    rng: list[list[int]] = field(default_factory=list)


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


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


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_json(path: Path, payload: Any) -> None:
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


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
    if _is_main():
        directory.mkdir(parents=True, exist_ok=True)
        student.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(str(directory))
        (directory / "recipe.yaml").write_text(recipe_to_yaml(recipe), encoding="utf-8")
        _write_json(directory / "versions.json", package_versions())


def save_checkpoint(
    engine, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, output_dir: Path, state: TrainerState
) -> Path:
    """Write ``checkpoints/step-N`` atomically, then drop all but the newest ``keep_checkpoints``."""
    root = checkpoints_dir(output_dir)
    final = root / f"step-{state.step}"
    partial = root / f"step-{state.step}.partial"
    if _is_main():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    _export_hf(engine, tokenizer, recipe, partial)
    engine.save_checkpoint(str(partial / DEEPSPEED_DIR), tag=DEEPSPEED_TAG)
    rng = [None] * dist.get_world_size() if dist.is_initialized() else None
    own = torch.get_rng_state().tolist()
    if rng is not None:
        dist.all_gather_object(rng, own)
    if _is_main():
        _write_json(partial / STATE_FILE, asdict(state) | {"rng": rng or [own]})
        if final.exists():  # a checkpoint of the same step from an earlier, overtaken attempt
            shutil.rmtree(final)
        os.replace(partial, final)
        for _, old in complete_checkpoints(output_dir)[: -recipe.train.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(engine, path: Path) -> TrainerState:
    """Restore weights, optimizer, schedule and this rank's RNG from ``path``."""
    loaded, _ = engine.load_checkpoint(str(path / DEEPSPEED_DIR), tag=DEEPSPEED_TAG)
    if loaded is None:
        raise MtaError(f"{path}: the DeepSpeed state could not be loaded; resume from another checkpoint")
    state = TrainerState(**json.loads((path / STATE_FILE).read_text(encoding="utf-8")))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank < len(state.rng):
        torch.set_rng_state(torch.tensor(state.rng[rank], dtype=torch.uint8))
    return state


def save_final(engine, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, output_dir: Path) -> Path:
    """``final/`` in Hugging Face format, replacing an earlier one only once the new one is whole."""
    final = output_dir / "final"
    partial = output_dir / "final.partial"
    if _is_main():
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    _export_hf(engine, tokenizer, recipe, partial)
    if _is_main():
        previous = output_dir / "final.previous"
        shutil.rmtree(previous, ignore_errors=True)
        if final.exists():
            os.replace(final, previous)
        os.replace(partial, final)
        shutil.rmtree(previous, ignore_errors=True)
    _barrier()
    return final
