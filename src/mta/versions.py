"""The package versions every artefact records (checkpoints, evaluation results)."""

from __future__ import annotations

import platform
from importlib import metadata

PACKAGES = (
    "mta",
    "torch",
    "transformers",
    "tokenizers",
    "deepspeed",
    "safetensors",
    "spacy",
    "pyarrow",
    "rouge-score",
    "nltk",
    "peft",  # peft: a LoRA student's adapters (student.lora)
)


def package_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """``{"python": ..., package: version or None when it is not installed}``."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions
