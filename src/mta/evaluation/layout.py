"""Where one checkpoint's evaluation lives on disk, and the claim on that directory.

::

    predictions/<label>/generation.json                 what generated the predictions (the claim)
    predictions/<label>/<set>/seed-<s>.jsonl            one line per row: prompt, prediction, scores
    predictions/<label>/<set>/seed-<s>.rank<r>.journal.jsonl   rows finished by rank r, while running
    predictions/<label>/perplexity.json                 teacher-forced perplexity (with --perplexity)

The claim records the checkpoint, its fingerprint (``mta.models.weights``: the sha256 of its weight,
tokenizer and config files, so weights changed in place at the same path are told apart), the
lengths, the dtype and the sampler; a later run with any of them changed is refused, naming what
changed, instead of reporting an old score or mixing predictions made two ways in one directory.
Every claim is checked before the first model loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mta import distributed
from mta.dtypes import dtype_name
from mta.errors import MtaError
from mta.evaluation.settings import EvalSettings
from mta.files import atomic_write_json, disk_full_is_reported, read_artefact_json
from mta.models.weights import describe_changes


@dataclass(frozen=True)
class CheckpointPaths:
    """The files under ``predictions/<label>/`` of one checkpoint."""

    root: Path

    @classmethod
    def of(cls, out_dir: Path, label: str) -> CheckpointPaths:
        """The directory of checkpoint ``label`` in the evaluation output ``out_dir``."""
        return cls(Path(out_dir) / "predictions" / label)

    @property
    def out_dir(self) -> Path:
        """The evaluation's output directory (``-o``): no link out of it is followed."""
        return self.root.parent.parent

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

    def stored_manifest(self) -> dict | None:
        """generation.json's content, or None when the directory is not claimed yet."""
        return read_artefact_json(
            self.manifest,
            "what made the predictions beside it cannot be told: delete that directory to regenerate them, "
            "or write to another -o",
        )

    def stored_perplexity(self) -> dict | None:
        """perplexity.json's content, or None when there is none yet."""
        return read_artefact_json(self.perplexity, "delete it and re-run the same `mta evaluate` (it is scored again)")


FINGERPRINT = "checkpoint_fingerprint"
FILES = "checkpoint_files"


def generation_manifest(
    checkpoint: str, settings: EvalSettings, dtype: torch.dtype, fingerprint: str, files: dict[str, str]
) -> dict:
    """What generation.json records: everything a prediction depends on besides its row."""
    from mta.generation.vllm_engine import ENGINE_KEY, engine_name

    source = Path(checkpoint)
    return {
        "checkpoint": str(source.resolve()) if source.exists() else checkpoint,
        FINGERPRINT: fingerprint,
        FILES: files,
        "max_prompt_length": settings.max_prompt_length,
        "max_new_tokens": settings.max_new_tokens,
        "dtype": dtype_name(dtype),
        "sampling": settings.sampling_description(),
        ENGINE_KEY: engine_name(settings.engine),  # predictions of two engines never share a directory
    }


def check_claim(paths: CheckpointPaths, manifest: dict) -> bool:
    """Whether ``paths`` is already claimed by ``manifest``'s generation (False: unclaimed);
    refuse, naming what changed, when it is claimed by another."""
    previous = paths.stored_manifest()
    if previous is None:
        return False
    from mta.generation.vllm_engine import UNRECORDED

    reasons = []
    settings = [
        f"{k}: {previous.get(k, UNRECORDED.get(k))!r} -> {v!r}"
        for k, v in manifest.items()
        if k not in (FINGERPRINT, FILES) and previous.get(k, UNRECORDED.get(k)) != v
    ]
    if settings:
        reasons.append(f"they were made with other settings ({'; '.join(settings)})")
    if FINGERPRINT not in previous:
        reasons.append(
            f"an earlier mta made them without recording the fingerprint of {manifest['checkpoint']}, so "
            "whether its weights changed since cannot be told"
        )
    elif previous[FINGERPRINT] != manifest[FINGERPRINT]:
        what = describe_changes(previous.get(FILES) or {}, manifest[FILES]) or (
            f"fingerprint {previous[FINGERPRINT]} -> {manifest[FINGERPRINT]}"
        )
        reasons.append(f"the checkpoint {manifest['checkpoint']} changed since they were made: {what}")
    if reasons:
        raise MtaError(
            f"{paths.root} holds predictions that cannot be reused: {'; and '.join(reasons)}. Write to "
            "another -o, give this checkpoint another --names label, or delete that directory to "
            "regenerate them."
        )
    return True


def claim_directory(paths: CheckpointPaths, manifest: dict) -> None:
    """Record what generates this directory's predictions; refuse to mix in another checkpoint
    or other settings. Every rank calls it; rank 0 writes the manifest."""
    if check_claim(paths, manifest):
        return
    distributed.barrier()  # every rank has read the absent manifest before rank 0 writes it
    if distributed.is_main():
        with disk_full_is_reported(paths.manifest):
            atomic_write_json(paths.manifest, manifest)
    distributed.barrier()
