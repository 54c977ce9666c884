"""Ranks, devices and the few collective operations every stage needs.

One process group per process, set up either by DeepSpeed (``mta distill``, see
``mta.training.engine.init_distributed``) or by ``joined_process_group`` (``mta evaluate`` under
torchrun). Without a launcher this is a world of one and every collective is a no-op, so the
helpers below are safe to call anywhere.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

LOADAVG = Path("/proc/loadavg")  # Linux: the load averages, then runnable/total scheduling entities


def is_distributed() -> bool:
    """True inside a process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    """Rank 0 writes every shared file."""
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


@contextmanager
def main_process_first() -> Iterator[None]:
    """Run the block on rank 0 first, then on the others (which then find its files cached)."""
    if is_distributed() and not is_main():
        dist.barrier()
    try:
        yield
    finally:
        if is_distributed() and is_main():
            dist.barrier()


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now (a world's MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def available_cores() -> int:
    """Cores this process may run on (the affinity mask under Slurm or taskset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch on ``threads`` threads meanwhile, its own number restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def runnable_now(readings: int = 10, interval: float = 0.01) -> int | None:
    """Threads of other work runnable now: the most of ``readings`` reads of ``LOADAVG``'s
    runnable count (``R`` of its ``R/T`` field), less this reader; None where it cannot be read."""
    counts = []
    try:
        for reading in range(readings):
            if reading:
                time.sleep(interval)
            counts.append(int(LOADAVG.read_text().split()[3].split("/")[0]) - 1)
    except (OSError, ValueError, IndexError):
        return None
    return max(0, *counts)


def idle_cores() -> int:
    """The available cores not busy with other work now: ``available_cores()`` less the 1-minute
    load average (rounded), or less the threads runnable now where fewer (the average lags a job
    that has just ended: the full demo took one thread and 12.1 min instead of 8.0 at load 0.9 on
    an idle machine), at least 1. A torch pool wider than this waits at each op for a thread
    another process holds: a quick demo took 350 s with 2 threads and 147 s with 1 on the 2-core
    machine at load 4 (issue 50)."""
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    now = runnable_now()
    return max(1, available_cores() - (busy if now is None else min(busy, now)))


def local_device() -> torch.device:
    """This process's GPU (``LOCAL_RANK`` under a launcher), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def resolve_device(spec: str = "auto") -> torch.device:
    """``auto``: :func:`local_device`; anything else as torch reads it (``cpu``, ``cuda:1``)."""
    return local_device() if spec == "auto" else torch.device(spec)


def _collective_device() -> torch.device:
    return local_device() if dist.get_backend() == "nccl" else torch.device("cpu")


def sum_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise sum over every process (float64)."""
    if not is_distributed():
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.float64, device=_collective_device())
    dist.all_reduce(tensor)
    return tensor.tolist()


def sum_tensors_over_ranks(tensors: Sequence[torch.Tensor]) -> None:
    """Sum each tensor over every process, in place (one all-reduce of all of them, flattened
    in their common dtype); every rank ends with the same values."""
    if not is_distributed() or not tensors:
        return
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors]).to(_collective_device())
    dist.all_reduce(flat)
    for tensor, part in zip(tensors, flat.split([tensor.numel() for tensor in tensors]), strict=True):
        tensor.copy_(part.view_as(tensor))


def all_ranks_agree(flag: bool) -> bool:
    """True only when ``flag`` is True on every process (so all stop together, none waits)."""
    if not is_distributed():
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=_collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return bool(tensor.item())


def max_over_ranks(value: int) -> int:
    """The largest ``value`` any process holds (e.g. batches to run, so all run as many)."""
    if not is_distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s whole state on the CPU, however an engine holds it: parameters DeepSpeed
    ZeRO-3 partitions are gathered (``GatheredParameters``), FSDP2's ``DTensor`` shards joined
    (``full_tensor``). A collective under either engine: every rank calls it, every rank gets
    the whole state. Elsewhere (one process, DDP, ZeRO-1/2) the module's own state, copied."""
    from torch.distributed.tensor import DTensor

    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id")]  # ZeRO-3's mark
    gathering: ContextManager[object] = nullcontext()
    if partitioned:
        import deepspeed

        gathering = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
    state = {}
    with gathering:
        for name, tensor in module.state_dict().items():
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            state[name] = whole.detach().to("cpu", copy=True).contiguous()
    return state


def gather_objects(value) -> list:
    """``value`` of every rank, in rank order (picklable values only)."""
    if not is_distributed():
        return [value]
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


@contextmanager
def joined_process_group() -> Iterator[None]:
    """Join the launcher's process group (nccl on GPUs, gloo on CPUs) when ``WORLD_SIZE > 1``.

    A group created here is destroyed on exit; one that already exists is left as it is.
    """
    owns = False
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        owns = True
    try:
        yield
    finally:
        if owns:
            dist.destroy_process_group()


def broadcast_from_main(value):
    """Rank 0's ``value`` on every rank (picklable values only)."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
