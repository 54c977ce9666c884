"""Where one checkpoint's evaluation lives on disk, and the claim on that directory.

::

    predictions/<label>/generation.json                 what generated the predictions (the claim)
    predictions/<label>/<set>/seed-<s>.jsonl            one line per row: prompt, prediction, scores
    predictions/<label>/<set>/seed-<s>.rank<r>.journal.jsonl   rows finished by rank r, while running
    predictions/<label>/perplexity.json                 teacher-forced perplexity (with --perplexity)

The claim records the checkpoint, the lengths, the dtype and the sampler; a later run with any of
them changed is refused instead of mixing predictions made two ways in one directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mta import distributed
from mta.dtypes import dtype_name
from mta.errors import MtaError
from mta.evaluation.settings import EvalSettings
from mta.files import atomic_write_json


@dataclass(frozen=True)
class CheckpointPaths:
    """The files under ``predictions/<label>/`` of one checkpoint."""

    root: Path

    @classmethod
    def of(cls, out_dir: Path, label: str) -> "CheckpointPaths":
        """The directory of checkpoint ``label`` in the evaluation output ``out_dir``."""
        return cls(Path(out_dir) / "predictions" / label)

    @property
    def manifest(self) -> Path:
        return self.root / "generation.json"

    @property
    def perplexity(self) -> Path:
        return self.root / "perplexity.json"

    def predictions(self, set_name: str, seed: int) -> Path:
        return self.root / set_name / f"seed-{seed}.jsonl"

    def journal(self, set_name: str, seed: int, rank: int) -> Path:
        return self.root / set_name / f"seed-{seed}.rank{rank}.journal.jsonl"

    def journals(self, set_name: str, seed: int) -> list[Path]:
        return sorted((self.root / set_name).glob(f"seed-{seed}.rank*.journal.jsonl"))

    def stored_perplexity(self) -> dict | None:
        """perplexity.json's content, or None when there is none yet."""
        if not self.perplexity.exists():
            return None
        return json.loads(self.perplexity.read_text(encoding="utf-8"))


def generation_manifest(checkpoint: str, settings: EvalSettings, dtype: torch.dtype) -> dict:
    """What generation.json records: everything a prediction depends on besides its row."""
    source = Path(checkpoint)
    return {
        "checkpoint": str(source.resolve()) if source.exists() else checkpoint,
        "max_prompt_length": settings.max_prompt_length,
        "max_new_tokens": settings.max_new_tokens,
        "dtype": dtype_name(dtype),
        "sampling": settings.sampling_description(),
    }


def claim_directory(paths: CheckpointPaths, checkpoint: str, settings: EvalSettings, dtype: torch.dtype) -> None:
    """Record what generates this directory's predictions; refuse to mix in other settings.

    Every rank calls it; rank 0 writes the manifest.
    """
    manifest = generation_manifest(checkpoint, settings, dtype)
    if paths.manifest.exists():
        previous = json.loads(paths.manifest.read_text(encoding="utf-8"))
        changed = [f"{k}: {previous.get(k)!r} -> {v!r}" for k, v in manifest.items() if previous.get(k) != v]
        if changed:
            raise MtaError(
                f"{paths.root} holds predictions made with other settings ({'; '.join(changed)}). "
                "Write to another -o, give this checkpoint another --names label, or delete that directory."
            )
        return
    distributed.barrier()  # every rank has read the absent manifest before rank 0 writes it
    if distributed.is_main():
        atomic_write_json(paths.manifest, manifest)
    distributed.barrier()
