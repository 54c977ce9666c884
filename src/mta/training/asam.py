"""ASAM (Kwon et al., 2021: adaptive sharpness-aware minimisation) around any recipe's optimizer.

``train.asam: {rho, eta, scope}`` makes every optimizer step two passes over its accumulation
window: g = the window's gradient at w (``torch.autograd.grad``, so DeepSpeed never sees it);
ε = ρ · T_w² · g / ‖T_w · g‖₂ with T_w = |w| + η (``scope: weights``: T_w = 1 on parameters not
named ``*weight``); w ← w + ε from a kept copy; the engine's usual forward, backward and step at
w + ε, with w restored from the copy first (never w + ε − ε, which drifts in bf16). A zero or
non-finite norm perturbs nothing (a warning names the step). ZeRO 0-2 keep weights whole, so
every process forms the same ε; ZeRO-3 is refused. No state outlives a step, so checkpoints hold
none. Against TALAS's author's code: docs/method.md §9.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mta import distributed
from mta.errors import MtaError
from mta.training.config.schema import ZERO3_REFUSAL

if TYPE_CHECKING:
    from mta.training.config.schema import AsamSpec

log = logging.getLogger(__name__)


def perturbation(
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    adaptive: Sequence[bool],
    *,
    rho: float,
    eta: float,
) -> list[torch.Tensor] | None:
    """ASAM's ε for each parameter, or None when ‖T_w · g‖ is 0 or not finite.

    weights, grads: each parameter's value and gradient (same shapes); adaptive: per parameter,
    whether T_w = |w| + η (else T_w = 1). ε_i = ρ · T_i² g_i / ‖T · g‖₂, the norm over all of
    them. Computed in fp32 at least (float64 stays float64); each ε in its weight's dtype.
    """
    parts: list[tuple[torch.Tensor, torch.Tensor | None, torch.dtype]] = []  # (T·g, T or None, ε's dtype)
    for weight, grad, is_adaptive in zip(weights, grads, adaptive, strict=True):
        wide = torch.promote_types(weight.dtype, torch.float32)
        scale = weight.detach().to(wide).abs() + eta if is_adaptive else None
        parts.append((grad.to(wide) * scale if scale is not None else grad.to(wide), scale, weight.dtype))
    if not parts:
        return None
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(part) for part, _, _ in parts]))
    if not bool(torch.isfinite(norm)) or norm.item() == 0.0:
        return None
    factor = rho / norm
    return [(part * factor * (scale if scale is not None else 1.0)).to(dtype) for part, scale, dtype in parts]


class Asam:
    """ASAM over ``module``'s trainable parameters (the engine's module: student + projectors).

    ``perturbed(losses)`` is the whole of it: the gradient of ``losses`` (each micro batch's
    total loss at w) sets ε, the block runs at w + ε, and w is back on exit (also after an error).

    ``student_clip`` > 0 clips the student's part of g (the parameters under ``module.student``)
    as TALAS's author does before SAM's first step: ``clip_grad_norm_`` to that norm on the
    window's mean gradient, the other parameters' part (the projections') unclipped.
    """

    def __init__(self, spec: AsamSpec, module: nn.Module, *, student_clip: float = 0.0):
        self.rho, self.eta = spec.rho, spec.eta
        named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
        self.params = [param for _, param in named]
        self.adaptive = [spec.scope == "all" or name.endswith("weight") for name, _ in named]
        self.student = [name.startswith("student.") for name, _ in named]
        self.student_clip = student_clip
        self.skipped = 0

    @classmethod
    def for_engine(cls, spec: AsamSpec, engine: Any) -> Asam:
        """ASAM around a DeepSpeed engine's module; ``MtaError`` under ZeRO-3. The module's
        ``student_gradient_clip`` (if any) is ``student_clip``."""
        if engine.zero_optimization_partition_weights():
            raise MtaError(ZERO3_REFUSAL)
        return cls(spec, engine.module, student_clip=float(getattr(engine.module, "student_gradient_clip", 0.0)))

    def gradient(self, losses: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Σ ∂loss/∂w over ``losses`` (one backward each, its graph freed) and the processes, in
        fp32; a parameter a loss does not reach gets zeros. ``.grad`` is left untouched."""
        total = [
            torch.zeros_like(param, dtype=torch.promote_types(param.dtype, torch.float32)) for param in self.params
        ]
        count = 0
        for loss in losses:
            count += 1
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
            for index, grad in enumerate(grads):  # one per parameter, as total
                if grad is not None:
                    total[index].add_(grad)  # widened to total's dtype by add_
        distributed.sum_tensors_over_ranks(total)
        if self.student_clip and count:
            self.clip_student_part(total, count * distributed.world_size())
        return total

    def clip_student_part(self, total: list[torch.Tensor], count: int) -> None:
        """Scale the student's part of ``total`` (a sum of ``count`` gradients) in place by
        ``clip_grad_norm_``'s factor min(1, C / (‖mean‖ + 1e-6)) for its mean; the rest as it is."""
        parts = [grad for grad, is_student in zip(total, self.student, strict=True) if is_student]
        if not parts:
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(part) for part in parts])) / count
        factor = torch.clamp(self.student_clip / (norm + 1e-6), max=1.0)
        for part in parts:
            part.mul_(factor)

    @contextmanager
    def perturbed(self, losses: Iterable[torch.Tensor], *, step: int | None = None) -> Iterator[bool]:
        """w ← w + ε inside the block, ε from the gradient of ``losses``; w restored from a copy on
        exit. Yields whether w was perturbed (False: ‖T_w · g‖ was 0 or not finite)."""
        epsilon = perturbation(self.params, self.gradient(losses), self.adaptive, rho=self.rho, eta=self.eta)
        if epsilon is None:
            self.skipped += 1
            log.warning(
                "ASAM: the gradient%s is zero or not finite; this step is not perturbed",
                f" of step {step + 1}" if step is not None else "",
            )
            yield False
            return
        with torch.no_grad():
            saved = [(param, param.detach().clone()) for param in self.params]
            for index, param in enumerate(self.params):  # epsilon: one per parameter
                param.add_(epsilon[index])
        del epsilon
        try:
            yield True
        finally:
            with torch.no_grad():
                for param, weight in saved:
                    param.copy_(weight)  # in place: DeepSpeed's flat buffers keep their views
