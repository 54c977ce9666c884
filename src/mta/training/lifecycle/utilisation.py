"""How close a training step is to the machine's limit: model FLOPs per second, and on a GPU the
fraction of the device's bf16 peak (MFU).

Model FLOPs of one micro batch, the usual accounting (Kaplan et al. 2020; Chowdhery et al. 2022,
appendix B) without the attention's ``seq²`` term::

    (4·N_student + 2·N_trainable) · student tokens + 2·N_teacher · teacher tokens

``N_student``: the student's parameters that take part in matrix products (all of them, less an
input embedding that is not tied to the LM head: a lookup), with the HRA / SRA projectors;
``N_trainable``: those of them the optimizer updates (all, so ``6·N``, unless LoRA freezes the
base weights: their weight gradients are never computed). The forward costs ``2·N`` per token,
the backward ``2·N`` for the activations' gradients and ``2·N_trainable`` for the weights'.
``N_teacher``: the teacher's parameters that run (a teacher truncated at its deepest aligned
layer counts only those blocks; its LM head only when logits are computed), forward only.
Tokens are real (non-padding) tokens, as ``tokens_per_s`` counts them. Not counted: the losses,
the logit lens, ASAM's second pass, sampling during training, recomputation.

``metrics.jsonl`` train lines carry ``flops_per_s`` (these FLOPs over the wall time since the last
line, summed over processes) and ``mfu``: ``flops_per_s / (processes × the device's dense bf16
peak)`` from ``PEAK_BF16_TFLOPS``, or null on a CPU or an unknown device (the ratio is then
``bench/cpu_precision.py``'s: FLOP/s against a measured matrix-product peak).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

# Dense (no sparsity) bf16 tensor throughput per device, TFLOP/s, from the vendors' data sheets.
# Matched in order against torch.cuda.get_device_name(): the first pattern found wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bGB200\b", 2500.0),
    (r"\bB200\b", 2250.0),
    (r"\bGH200\b", 989.0),
    (r"\bH200 NVL\b", 835.0),
    (r"\bH200\b", 989.0),  # SXM
    (r"\bH100 NVL\b", 835.0),
    (r"\bH100 PCIe\b", 756.0),
    (r"\bH100\b", 989.0),  # SXM (NVIDIA H100 80GB HBM3)
    (r"\bH800\b", 989.0),
    (r"\bA100\b", 312.0),
    (r"\bA800\b", 312.0),
    (r"\bL40S\b", 362.0),
    (r"\bL40\b", 181.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),
    (r"\bRTX 4090\b", 165.0),
    (r"\bMI300X\b", 1307.0),
)


def peak_bf16_tflops(device_name: str) -> float | None:
    """The table's dense bf16 peak of a device by its name, or None when the table lacks it."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


def device_peak_flops(device: torch.device) -> float | None:
    """FLOP/s of ``device``'s dense bf16 peak, or None (a CPU, or a GPU the table lacks)."""
    if device.type != "cuda":
        return None
    tflops = peak_bf16_tflops(torch.cuda.get_device_name(device))
    return None if tflops is None else tflops * 1e12


def _count(parameters: Iterable[nn.Parameter]) -> int:
    # ZeRO-3 leaves a partition on each process: ds_numel is the whole parameter's size.
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in parameters)


def matmul_parameters(model: nn.Module, *, runs_head: bool = True) -> int:
    """Parameters of a Hugging Face causal LM that take part in matrix products: all of them,
    less an input embedding not shared with the LM head (a lookup), less the LM head when it
    does not run (``runs_head=False``; a head tied to the input embedding is then a lookup)."""
    return _count(_in_products(model, runs_head=runs_head))


def _in_products(model: nn.Module, *, runs_head: bool = True) -> list[nn.Parameter]:
    unique = {id(p): p for p in model.parameters()}
    input_embeddings = getattr(model, "get_input_embeddings", None)  # a Hugging Face model's
    output_embeddings = getattr(model, "get_output_embeddings", None)
    embedding = input_embeddings() if input_embeddings is not None else None
    head = output_embeddings() if output_embeddings is not None else None
    embedding_weight = getattr(embedding, "weight", None)
    head_weight = getattr(head, "weight", None)
    skipped: set[int] = set()
    if embedding_weight is not None and (embedding_weight is not head_weight or not runs_head):
        skipped.add(id(embedding_weight))
    if head_weight is not None and not runs_head:
        skipped.add(id(head_weight))
    return [p for key, p in unique.items() if key not in skipped]


class MicroBatch(Protocol):
    """What ``StepFlops.count`` reads of a micro batch: a ``TrainBatch``, or a task's own batch
    (``teacher`` is read only when a teacher runs, and is then a ``TokenBatch``)."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def teacher(self) -> Any: ...


class StepFlops:
    """Model FLOPs of the micro batches counted since the last ``take`` (see the module's note).

    student: the trained module (student + projectors); student_lm: the student's causal LM in
    it; teacher: a ``FrozenTeacher`` (or the ZeRO-3 engine around one), or None.
    """

    def __init__(self, student: nn.Module, student_lm: nn.Module, teacher: nn.Module | None = None):
        lm_ids = {id(p) for p in student_lm.parameters()}
        others = [p for p in {id(p): p for p in student.parameters()}.values() if id(p) not in lm_ids]
        products = _in_products(student_lm) + others  # the projectors are matrix products too
        self.student = _count(products)
        self.trainable = _count(p for p in products if p.requires_grad)
        self.teacher = 0
        if teacher is not None:
            frozen = getattr(teacher, "module", teacher)  # a ZeRO-3 engine holds the FrozenTeacher
            runs_head = bool(getattr(frozen, "need_logits", True))
            self.teacher = matmul_parameters(getattr(frozen, "model", frozen), runs_head=runs_head)
        self.pending = 0.0

    def of(self, student_tokens: int, teacher_tokens: int = 0) -> float:
        return (4 * self.student + 2 * self.trainable) * student_tokens + 2 * self.teacher * teacher_tokens

    def count(self, batch: MicroBatch) -> None:
        """Add one micro batch (a ``TrainBatch``)."""
        teacher_tokens = int(batch.teacher.attention_mask.sum()) if self.teacher and batch.teacher is not None else 0
        self.pending += self.of(batch.num_tokens, teacher_tokens)

    def take(self) -> float:
        """The FLOPs counted since the last call."""
        pending, self.pending = self.pending, 0.0
        return pending


def mfu(flops_per_s: float, peak_flops: float | None, world_size: int = 1) -> float | None:
    """``flops_per_s`` (summed over ``world_size`` devices) as a fraction of their peak, or None."""
    if not peak_flops:
        return None
    return flops_per_s / (peak_flops * world_size)
