"""How a teacher cache stores its values in few bytes: token ids in the fewest bits the
vocabulary allows, hidden states in 8 bits with a scale.

**Ids**: ``id_bits(V)`` bits each (16 for GPT-2's 50,257 tokens and SmolLM2's 49,152, 17 for
131,072, 18 for Qwen's 151,936), little-endian bit order, a row's ids one after another in one
byte string (:func:`pack_ids`, :func:`unpack_ids`). Lossless.

**States** (``teacher_cache.states``): ``storage`` keeps them in the storage's precision (fp16 or
fp32); ``int8_token`` stores each token's state of each layer as int8 with one fp32 scale,
``absmax / 127`` over its d channels; ``int8_channel`` one scale per channel, layer and row,
over the row's tokens (an outlier channel then costs only its own precision). Rounding to the
nearest step bounds each value's error by half a step, ``absmax / 254`` of its token (or channel).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from mta.errors import MtaError

STATES = ("storage", "int8_token", "int8_channel")
SCALE_BYTES = 4  # an fp32 scale


def id_bits(vocab_size: int) -> int:
    """The bits a token id takes: the fewest that hold ``vocab_size − 1`` (at least 1)."""
    return max(1, (vocab_size - 1).bit_length())


def packed_bytes(count: int, bits: int) -> int:
    """Bytes of ``count`` ids packed at ``bits`` bits."""
    return math.ceil(count * bits / 8)


def pack_ids(ids: np.ndarray, bits: int) -> bytes:
    """``ids`` (any integer shape, each in ``[0, 2**bits)``) -> ``packed_bytes(ids.size, bits)`` bytes."""
    flat = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= 1 << bits):
        raise MtaError(f"token id {int(flat.max())} does not fit {bits} bits: the cache's vocabulary is too small")
    as_bytes = flat.astype("<u4").view(np.uint8).reshape(-1, 4)  # [n, 4] little-endian
    return np.packbits(np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :bits], bitorder="little").tobytes()


def unpack_ids(data: bytes | np.ndarray, bits: int, count: int) -> np.ndarray:
    """The ``count`` ids of :func:`pack_ids`'s output -> ``[count]`` int64."""
    raw = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else np.asarray(data, dtype=np.uint8)
    if raw.size != packed_bytes(count, bits):
        raise MtaError(f"{raw.size} bytes of packed ids, {packed_bytes(count, bits)} expected for {count} ids")
    unpacked = np.unpackbits(raw, bitorder="little")[: count * bits].reshape(count, bits)
    return unpacked.astype(np.int64) @ (np.int64(1) << np.arange(bits, dtype=np.int64))


def quantize_states(states: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``[layers, tokens, d]`` -> int8 values of the same shape and fp32 scales, ``[layers,
    tokens]`` (``int8_token``) or ``[layers, d]`` (``int8_channel``); ``values · scale`` rebuilds
    them (:func:`dequantize_states`)."""
    x = states.float()
    if mode == "int8_token":
        scale = x.abs().amax(dim=2) / 127  # [layers, tokens]
        expanded = scale.unsqueeze(2)
    elif mode == "int8_channel":
        scale = x.abs().amax(dim=1) / 127  # [layers, d]
        expanded = scale.unsqueeze(1)
    else:
        raise MtaError(f"unknown 8-bit states {mode!r}; choose int8_token or int8_channel")
    safe = torch.where(expanded > 0, expanded, torch.ones_like(expanded))
    return (x / safe).round().clamp(-127, 127).to(torch.int8), scale


def dequantize_states(values: torch.Tensor, scale: torch.Tensor, mode: str) -> torch.Tensor:
    """``int8 [layers, tokens, d]`` and :func:`quantize_states`'s scales -> fp32 states."""
    expanded = scale.float().unsqueeze(2) if mode == "int8_token" else scale.float().unsqueeze(1)
    return values.float() * expanded


def state_bytes(mode: str, *, value_bytes: int, layers: int, tokens: int, hidden_size: int, rows: int) -> int:
    """Bytes the states of ``rows`` rows of ``tokens`` tokens in all take in ``mode``."""
    if mode == "storage":
        return layers * tokens * hidden_size * value_bytes
    scales = layers * tokens if mode == "int8_token" else layers * rows * hidden_size
    return layers * tokens * hidden_size + scales * SCALE_BYTES


__all__ = [
    "STATES",
    "dequantize_states",
    "id_bits",
    "pack_ids",
    "packed_bytes",
    "quantize_states",
    "state_bytes",
    "unpack_ids",
]
