"""What a benchmark JSON records about the machine it ran on (never a path or a host name)."""

from __future__ import annotations

import datetime
import os
import platform

import torch


def created() -> str:
    """Now, UTC, to the second: the JSON's ``created``."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def describe_machine(device: torch.device, **extra) -> dict:
    """The device (the GPU's name on CUDA), platform, cores, torch threads and version, the load
    average at the end (a shared machine's noise), and ``extra`` entries."""
    return {
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **extra,
        "load_average_at_end": os.getloadavg(),
    }
