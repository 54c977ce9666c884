"""Precision names as recipes and options write them, and the torch dtypes they stand for."""

from __future__ import annotations

import torch

from mta.errors import MtaError

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BYTES_PER_ELEMENT: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}


def torch_dtype(name: str) -> torch.dtype:
    """``fp32`` / ``bf16`` / ``fp16`` -> the torch dtype."""
    if name not in DTYPES:
        raise MtaError(f"unknown dtype '{name}'; choose from {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The torch dtype's name without the ``torch.`` prefix (``float32``), as results record it."""
    return str(dtype).removeprefix("torch.")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a GPU that supports it, fp32 elsewhere (fp16 CPU kernels are slow)."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise MtaError(f"unknown dtype '{name}'; choose from auto, {', '.join(DTYPES)}")
    return DTYPES[name]
