"""A model directory's weights: which files they are, what their safetensors headers hold (no
tensor loads), and their fingerprint."""

from __future__ import annotations

import fnmatch
from pathlib import Path

from mta.hashing import file_sha256, json_sha256

# The weight and config files transformers reads from a model directory (the rest of the list,
# adapter and tokenizer files: mta.models.fingerprint.MODEL_FILE_PATTERNS).
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json")
CONFIG_PATTERNS = ("config.json", "generation_config.json")


def weights_fingerprint(directory: str | Path) -> str | None:
    """``sha256:`` of a model directory's top-level weight and config files (``{name: sha256}``,
    canonical JSON): what decides a frozen teacher's outputs, its tokenizer aside. None when the
    directory holds no weight file (deleted, or never downloaded)."""
    names = sorted(
        path.name
        for path in Path(directory).iterdir()
        if path.is_file() and any(fnmatch.fnmatch(path.name, p) for p in (*WEIGHT_PATTERNS, *CONFIG_PATTERNS))
    )
    if not any(fnmatch.fnmatch(name, p) for name in names for p in WEIGHT_PATTERNS):
        return None
    return "sha256:" + json_sha256({name: file_sha256(Path(directory) / name) for name in names})


def stored_parameters(path: str | Path) -> int:
    """Parameters (elements of every tensor) stored in one safetensors file."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():
            count = 1
            for size in handle.get_slice(name).get_shape():
                count *= int(size)
            total += count
    return total


def parameter_count(model_dir: str | Path) -> int:
    """Parameters stored in a checkpoint's (top-level) safetensors files."""
    return sum(stored_parameters(shard) for shard in sorted(Path(model_dir).glob("*.safetensors")))
