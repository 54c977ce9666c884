"""DeepSpeed around the student: process group, config from the recipe, optimizer and schedule.

One code path for every launch (README, "Several GPUs and nodes"): without a launcher ``init_distributed``
sets the rendezvous variables itself and joins a one-process group (``gloo`` on CPU, ``nccl`` on
GPU); accumulation follows the world size, so the global batch stays ``train.batch_size``.
Precision (``TrainingPrecision``): on a GPU bf16 and fp16 are DeepSpeed's; on a CPU bf16 is torch
autocast over fp32 weights, gradients and optimizer state, DeepSpeed staying in fp32 (its own bf16
mode is 3 % faster, ``bench/cpu_precision.py``, but accumulates gradients, keeps the residual stream
and exports ``final/`` in bf16); a frozen teacher is held in bf16; fp16 on a CPU is refused.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import logging
import math
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mta import distributed
from mta.dtypes import DTYPES, auto_reason, resolve_precision
from mta.errors import MtaError
from mta.training.config.schema import TrainSpec

log = logging.getLogger(__name__)


def init_distributed() -> tuple[int, int]:
    """Join (or create) the process group once per process; returns ``(rank, world_size)``.

    Safe to call again: a second run in the same process reuses the group.
    """
    import deepspeed
    import deepspeed.ops

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed.free_port()))
    world_size = int(os.environ["WORLD_SIZE"])
    if not torch.cuda.is_available():
        # DeepSpeed JIT-compiles a shared-memory all-reduce kernel for CPU groups (minutes of
        # g++ on first use). CPU runs are tests and tiny recipes: gloo's all-reduce is plenty.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return int(os.environ["RANK"]), world_size


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """For CPU training: glibc malloc keeps the memory a step frees for the next step.

    By default glibc maps every block over 32 MB (the logits, the embedding's gradient, the
    optimizer's temporaries) freshly and unmaps it when freed, so each step page-faults and
    zeroes gigabytes again (900k faults a step at the demo's shapes). Serving every block from
    the heap, never trimmed below 2 GB, removes those faults: 8-13 % of a step's CPU time at the
    demo's shapes, for ~10 % more resident memory (the heap stays at its peak). Process-wide and
    once; a no-op (False) where the C library is not glibc.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        done = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError):
        return False
    log.debug("glibc malloc: no mmap blocks, trim threshold 2 GB (%s)", "set" if done else "refused")
    return done


@dataclass(frozen=True)
class TrainingPrecision:
    """What ``train.precision`` means on this run's device.

    requested: as the recipe wrote it (``auto``, ``fp32``, ``bf16``, ``fp16``); name: what it
    resolved to; autocast: bf16 on a CPU, applied by ``torch.autocast`` over fp32 weights (the
    engine then runs in fp32); reason: why ``auto`` chose ``name`` (None when not ``auto``).
    """

    requested: str
    name: str
    autocast: bool
    device_type: str
    reason: str | None = None

    @property
    def deepspeed(self) -> str:
        """The precision DeepSpeed's config enables: fp32 under autocast, else ``name``."""
        return "fp32" if self.autocast else self.name

    @property
    def frozen_dtype(self) -> torch.dtype | None:
        """The dtype a frozen fp32 teacher is held in: bf16 under autocast (its products run in
        bf16 either way; this saves casting its weights at every forward), else None (as loaded)."""
        return torch.bfloat16 if self.autocast else None

    def context(self) -> contextlib.AbstractContextManager[None]:
        """Around forwards (training, dev loss, sampling), never around ``backward``."""
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=DTYPES[self.name])

    def describe(self) -> str:
        """One log line: ``precision bf16 (train.precision=auto: ...): autocast over fp32 weights``."""
        line = f"precision {self.name}"
        if self.requested == "auto":
            line += f" (train.precision=auto: {self.reason})"
        if self.autocast:
            line += "; torch autocast over fp32 weights, gradients and optimizer state"
        elif self.name != "fp32":
            line += "; DeepSpeed's 16-bit weights with fp32 master weights"
        return line


def resolve_training_precision(train: TrainSpec, device: torch.device) -> TrainingPrecision:
    """``train.precision`` on ``device``; fp16 on a CPU is refused."""
    name = resolve_precision(train.precision, device)
    if name == "fp16" and device.type != "cuda":
        raise MtaError(
            f"train.precision=fp16 needs a GPU (DeepSpeed trains fp16 only there, and CPUs compute "
            f"fp16 slowly); this run is on {device.type}: use train.precision=bf16, or auto (bf16 "
            "where the processor has bf16 instructions, fp32 elsewhere)"
        )
    reason = auto_reason(device) if train.precision == "auto" else None
    return TrainingPrecision(train.precision, name, name == "bf16" and device.type == "cpu", device.type, reason)


def deepspeed_config(
    train: TrainSpec, passthrough: dict[str, Any], world_size: int, *, precision: str | None = None
) -> dict[str, Any]:
    """The DeepSpeed config ``train`` implies, with the recipe's ``deepspeed:`` mapping merged over it.

    The recipe owns batch sizes, precision, clipping and the ZeRO stage (the schema refuses
    those keys in the passthrough); everything else (offload, bucket sizes, ...) passes verbatim.
    precision: what DeepSpeed computes in (``TrainingPrecision.deepspeed``); default
    ``train.precision``, which must then not be ``auto``.
    """
    precision = precision or train.precision
    if precision not in DTYPES:
        raise ValueError(f"resolve train.precision={precision} first (resolve_training_precision)")
    config: dict[str, Any] = {
        "train_batch_size": train.batch_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.accumulation_steps(world_size),
        "gradient_clipping": train.grad_clip,
        "zero_optimization": {"stage": train.zero_stage},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
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


def build_optimizer(
    model: torch.nn.Module, projectors: list[torch.nn.Parameter], train: TrainSpec
) -> torch.optim.AdamW:
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


def restart_schedule(engine: Any, train: TrainSpec, step: int, total_steps: int) -> None:
    """After a resume at ``step``: each group's base rate is the recipe's (a resume may change
    ``train.lr`` / ``train.projector_lr``), under the schedule planned for ``total_steps`` (a
    resume may change the length). Loading the checkpoint restored the old rates; this is the
    rule ``mta.training.config.resume_rules.LR_RULE`` states.
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


def build_scheduler(
    optimizer: torch.optim.Optimizer, train: TrainSpec, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, total_steps, train.warmup_steps, train.schedule)
    )


def initialize(
    model: torch.nn.Module,
    projectors: list[torch.nn.Parameter],
    train: TrainSpec,
    passthrough: dict[str, Any],
    total_steps: int,
    world_size: int,
    precision: TrainingPrecision | None = None,
) -> Any:
    """The DeepSpeed engine over ``model`` (student + projectors) with optimizer and schedule.

    precision: as ``resolve_training_precision`` gives it (default: ``train.precision`` handed
    to DeepSpeed as it is). Under autocast the trainable weights are fp32 (a 16-bit student is
    upcast: they are the master weights).
    """
    import deepspeed

    if precision is not None and precision.autocast:
        model.float()
    optimizer = build_optimizer(model, projectors, train)
    scheduler = build_scheduler(optimizer, train, total_steps)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(
            train, passthrough, world_size, precision=precision.deepspeed if precision is not None else None
        ),
    )
    return engine


def teacher_zero3_engine(teacher: torch.nn.Module, micro_batch_size: int, world_size: int) -> Any:
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


def own_gradient_norm(engine: Any) -> float | None:
    """The gradient's 2-norm over the engine's parameters, taken just before the optimizer step,
    where DeepSpeed takes none; None where it does (``step_gradient_norm`` reads it after).

    DeepSpeed's ZeRO-1/2/3, bf16 and fp16 optimizers keep the norm they clip with
    (``get_global_grad_norm()``); with ZeRO-0 in fp32 the optimizer is mta's torch AdamW and the
    engine's clipping discards its norm (no norm at all with ``train.grad_clip: 0``). There the
    gradient is already averaged over the processes after the window's last backward, and the
    optimizer step zeroes it, so it is measured before the step: the norm DeepSpeed would clip.
    """
    if hasattr(engine.optimizer, "_global_grad_norm"):  # DeepSpeed's own test for keeping it
        return None
    grads = [p.grad.detach() for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0  # one foreach kernel, fp32 here


def step_gradient_norm(engine: Any, own: float | None) -> float:
    """The optimizer step's gradient norm (before clipping): ``own`` (``own_gradient_norm``,
    taken before the step) or DeepSpeed's ``get_global_grad_norm()`` after it; NaN when neither
    is known (ZeRO with ``compute_grad_norm: false`` in the ``deepspeed:`` passthrough)."""
    if own is not None:
        return own
    norm = engine.get_global_grad_norm()
    return math.nan if norm is None else float(norm)


def window_divisors(counts: Sequence[Mapping[str, float]], accumulation: int, world_size: int) -> dict[str, float]:
    """``train.loss_reduction: global``: what each micro batch divides its loss sums by, so that
    the step's gradient is that of the global batch's means (docs/method.md §5, "Reduction").

    counts: one mapping per micro batch of this process's window (``DistillationObjective.counts``),
    summed here and over every process (one all-reduce). DeepSpeed divides each micro batch's
    loss by ``gradient_accumulation_steps`` in ``engine.backward`` and averages the gradient over
    the data-parallel processes (ZeRO 0 to 3 alike, ``gradient_predivide_factor`` only splitting
    that division), so the divisor of a unit is its global count / (accumulation × world_size):
    after DeepSpeed's two divisions every micro batch's sum counts once over the global count,
    before clipping. A unit no micro batch has (count 0) divides by 1 / (accumulation ×
    world_size): its sums are 0 anyway.
    """
    names = sorted({name for micro_batch in counts for name in micro_batch})
    totals = distributed.sum_over_ranks([sum(batch.get(name, 0.0) for batch in counts) for name in names])
    return {name: max(total, 1.0) / (accumulation * world_size) for name, total in zip(names, totals, strict=True)}
