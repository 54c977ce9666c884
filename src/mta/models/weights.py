"""What a model directory's safetensors files hold, read from their headers only (no tensor loads)."""

from __future__ import annotations

from pathlib import Path


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
