"""DeepSpeed around the student: process group, config from the recipe, optimizer and schedule.

Launch modes (one code path for all):

* single process: ``mta distill --recipe R``. When no launcher set ``RANK``/``WORLD_SIZE``,
  ``init_distributed`` sets the rendezvous variables itself (a free local port) and joins a
  one-process group (``gloo`` on CPU, ``nccl`` on GPU).
* several GPUs or nodes: ``torchrun --nproc-per-node 8 $(which mta) distill --recipe R`` or
  ``deepspeed --no_local_rank --num_gpus 8 $(which mta) distill --recipe R`` (``--no_local_rank``:
  ``LOCAL_RANK`` comes from the environment, not an extra argument). Add ``--nnodes``/
  ``--node-rank``/``--master-addr`` (torchrun) or a hostfile (deepspeed) for several nodes. The
  launcher sets the variables; the global batch stays ``train.batch_size`` because accumulation
  is derived from the world size.
"""

from __future__ import annotations

import copy
import math
import os
import socket
from typing import Any

import torch

from mta.training.recipe import TrainSpec


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed() -> tuple[int, int]:
    """Join (or create) the process group once per process; returns ``(rank, world_size)``.

    Safe to call again: a second run in the same process reuses the group.
    """
    import deepspeed
    import deepspeed.ops

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    world_size = int(os.environ["WORLD_SIZE"])
    if not torch.cuda.is_available():
        # DeepSpeed JIT-compiles a shared-memory all-reduce kernel for CPU groups (minutes of
        # g++ on first use). CPU runs are tests and tiny recipes: gloo's all-reduce is plenty.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return int(os.environ["RANK"]), world_size


def deepspeed_config(train: TrainSpec, passthrough: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The DeepSpeed config ``train`` implies, with the recipe's ``deepspeed:`` mapping merged over it.

    The recipe owns batch sizes, precision, clipping and the ZeRO stage (the schema refuses
    those keys in the passthrough); everything else (offload, bucket sizes, ...) passes verbatim.
    """
    config: dict[str, Any] = {
        "train_batch_size": train.batch_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.accumulation_steps(world_size),
        "gradient_clipping": train.grad_clip,
        "zero_optimization": {"stage": train.zero_stage},
        "bf16": {"enabled": train.precision == "bf16"},
        "fp16": {"enabled": train.precision == "fp16"},
        # mta's own AdamW (torch): DeepSpeed allows it with ZeRO once told it is intended.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return _merge(config, passthrough)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def build_optimizer(model: torch.nn.Module, projectors: list[torch.nn.Parameter], train: TrainSpec):
    """Torch AdamW: the student at ``train.lr``, the HRA projectors at ``train.projector_lr``.

    Both groups use ``train.weight_decay`` (docs/method.md §3: projectors decay like the student).
    """
    projector_ids = {id(param) for param in projectors}
    student = [p for p in model.parameters() if p.requires_grad and id(p) not in projector_ids]
    groups = [{"params": student, "lr": train.lr, "name": "student"}]
    if projectors:
        groups.append({"params": projectors, "lr": train.projector_lr, "name": "projectors"})
    return torch.optim.AdamW(groups, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay)


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """The factor on each group's base lr after ``step`` optimizer steps."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def restart_schedule(engine, train: TrainSpec, step: int, total_steps: int) -> None:
    """After a resume at ``step``: each group's base rate is the recipe's (a resume may change
    ``train.lr`` / ``train.projector_lr``), under the schedule planned for ``total_steps`` (a
    resume may change the length). Loading the checkpoint restored the old rates; this is the
    rule ``mta.training.resume_rules.LR_RULE`` states.
    """
    scheduler = engine.lr_scheduler
    bases = {"student": train.lr, "projectors": train.projector_lr}
    multiplier = lr_multiplier(step, total_steps, train.warmup_steps, train.schedule)
    for index, group in enumerate(engine.optimizer.param_groups):
        base = bases[group.get("name", "student" if index == 0 else "projectors")]
        group["initial_lr"] = base
        scheduler.base_lrs[index] = base
        group["lr"] = base * multiplier
    scheduler._last_lr = [group["lr"] for group in engine.optimizer.param_groups]


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainSpec, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, total_steps, train.warmup_steps, train.schedule)
    )


def initialize(model: torch.nn.Module, projectors: list[torch.nn.Parameter], train: TrainSpec,
               passthrough: dict[str, Any], total_steps: int, world_size: int):
    """The DeepSpeed engine over ``model`` (student + projectors) with optimizer and schedule."""
    import deepspeed

    optimizer = build_optimizer(model, projectors, train)
    scheduler = build_scheduler(optimizer, train, total_steps)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler,
        config=deepspeed_config(train, passthrough, world_size),
    )
    return engine


def teacher_zero3_engine(teacher: torch.nn.Module, micro_batch_size: int, world_size: int):
    """Partition a frozen teacher's weights over the processes with ZeRO-3 (inference only).

    For teachers larger than one device (``train.teacher_zero3``): DeepSpeed gathers each
    layer's shards just before it runs. Precision follows the teacher's dtype.
    """
    import deepspeed

    dtype = next(teacher.parameters()).dtype
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "train_batch_size": micro_batch_size * world_size,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 2**31 - 1,
    }
    engine, _, _, _ = deepspeed.initialize(model=teacher, config=config)
    engine.eval()
    return engine
