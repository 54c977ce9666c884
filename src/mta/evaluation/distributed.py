"""The few collective operations evaluation needs under ``torchrun``.

Ranks share work through files: each rank appends its rows to its own journal, and after a
barrier rank 0 merges the journals and writes every result. Without torchrun this is a world of
one and every call is a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    owns_group: bool = False  # we created the process group, so we tear it down

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        if self.world == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        if dist.get_backend() == "nccl":
            tensor = tensor.cuda()
        dist.all_reduce(tensor)
        return tensor.tolist()

    def close(self) -> None:
        if self.owns_group:
            dist.destroy_process_group()


def init_ranks() -> Ranks:
    """Join the torchrun process group (nccl on GPUs, gloo on CPUs) when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return Ranks()
    owns = False
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        owns = True
    return Ranks(rank=dist.get_rank(), world=dist.get_world_size(), owns_group=owns)
