"""Precision names as recipes and options write them, and the torch dtypes they stand for.

``auto`` means: bf16 where the device computes it natively, fp32 elsewhere. A GPU qualifies
when torch says it supports bf16; a CPU when it has bf16 matrix instructions (x86 AVX512-BF16 or
AMX, Arm's BF16 extension), where a bf16 training step or sampling run is about 1.4x faster than
fp32 (``bench/cpu_precision.py``). ``MTA_CPU_BF16=0`` (or ``1``) overrides what the processor
reports: ``auto`` then gives fp32 (or bf16) on the CPU. The test suite sets ``0``, so that its
results are the same on every machine.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from mta.errors import MtaError

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BYTES_PER_ELEMENT: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
CPU_BF16_ENV = "MTA_CPU_BF16"
# /proc/cpuinfo flags of native bf16 arithmetic: x86 (AVX512-BF16, AMX-BF16) and Arm ("bf16").
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def torch_dtype(name: str) -> torch.dtype:
    """``fp32`` / ``bf16`` / ``fp16`` -> the torch dtype."""
    if name not in DTYPES:
        raise MtaError(f"unknown dtype '{name}'; choose from {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The torch dtype's name without the ``torch.`` prefix (``float32``), as results record it."""
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=1)
def cpu_bf16_instructions() -> tuple[str, ...]:
    """The bf16 instruction sets this processor reports (empty when it has none): torch's own
    probes where it has them, else the flags of ``/proc/cpuinfo``."""
    found = []
    probes = {"avx512_bf16": "_is_avx512_bf16_supported", "amx_bf16": "_is_amx_tile_supported"}
    for name, probe in probes.items():
        check = getattr(torch.cpu, probe, None)
        try:
            if check is not None and check():
                found.append(name)
        except Exception:  # a torch built without the probe's backend
            pass
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:  # not Linux
        cpuinfo = ""
    found += [flag for flag in bf16_flags(cpuinfo) if flag not in found]
    return tuple(found)


def bf16_flags(cpuinfo: str) -> tuple[str, ...]:
    """The bf16 flags (``CPU_BF16_FLAGS``) in a ``/proc/cpuinfo`` text: x86's ``flags`` lines,
    Arm's ``Features``."""
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return tuple(flag for flag in CPU_BF16_FLAGS if flag in flags)


def cpu_has_native_bf16() -> bool:
    """True when ``auto`` should compute in bf16 on this CPU: ``MTA_CPU_BF16`` when set (``0`` /
    ``1``), else whether the processor reports bf16 instructions. Tests fake a processor by
    replacing this function."""
    forced = os.environ.get(CPU_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise MtaError(f"{CPU_BF16_ENV}={forced!r}: use 0 (fp32 for auto on the CPU) or 1 (bf16), or unset it")
    return bool(cpu_bf16_instructions())


def has_native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 natively (what ``auto`` follows)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_has_native_bf16()
    return False


def resolve_precision(name: str, device: torch.device) -> str:
    """``auto`` -> ``bf16`` where ``device`` computes it natively, else ``fp32``; any other known
    name as it is."""
    if name == "auto":
        return "bf16" if has_native_bf16(device) else "fp32"
    if name not in DTYPES:
        raise MtaError(f"unknown dtype '{name}'; choose from auto, {', '.join(DTYPES)}")
    return name


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a GPU that supports it or a CPU with bf16 instructions, fp32 elsewhere
    (fp16 CPU kernels are slow); ``fp32`` / ``bf16`` / ``fp16``: that dtype."""
    return DTYPES[resolve_precision(name, device)]


def auto_reason(device: torch.device) -> str:
    """Why ``auto`` chose what it chose on ``device``, for the log: ``"this CPU reports
    avx512_bf16"``, ``"MTA_CPU_BF16=0"``, ..."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"{name} {'supports' if torch.cuda.is_bf16_supported() else 'does not support'} bf16"
    if device.type != "cpu":
        return f"{device.type} devices compute in fp32"
    forced = os.environ.get(CPU_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return f"{CPU_BF16_ENV}={forced}"
    if cpu_has_native_bf16():
        instructions = cpu_bf16_instructions()
        return "this CPU computes bf16 natively" + (f" ({', '.join(instructions)})" if instructions else "")
    return "this CPU has no bf16 instructions"
