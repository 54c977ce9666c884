"""Token losses with their gradient with respect to the student's logits, in closed form and in
place, for the fused head (``mta.losses.fused_head``).

Autograd through a divergence keeps every intermediate ``[chunk, vocab]`` tensor of its forward
for the backward: 5 (ce) to 15 (jsd) fp32 buffers a chunk, 74 MiB each at 128 positions of a
151,936-token vocabulary (bench/logit_memory.py). Written out, each loss needs 1 to 4, the student's
and the teacher's logits overwritten by their log-probabilities. Every function takes ``student``
and ``teacher`` fp32 logits ``[n, V]`` that it may overwrite (the caller's own chunk) and returns
the per-token loss ``[n]`` and ``∂loss/∂student`` ``[n, V]``, the same values as autograd through
``mta.losses.kd``'s formulas (tests/test_closed_form.py compares them).

With ``log q = log_softmax(s / τ)``, a loss ``L(log q)`` has ``∂L/∂s = (g − q · Σ_v g_v) / τ``
where ``g = ∂L/∂log q`` taken elementwise; each function below forms its ``g`` (docs/method.md §5
has the losses):

    fkl   Σ p (log p − log q)             g = −p
    rkl   Σ q (log q − log p)             g = q (log q − log p + 1)
    skl   KL(p ‖ m), m = αp + (1−α)q      g = −(1−α) p q / m
    srkl  KL(q ‖ m), m = αq + (1−α)p      g = q (log q − log m + 1 − α q / m)
    jsd   β KL(p‖m) + (1−β) KL(q‖m)       g = (1−β) q (log q − log m),  m = βp + (1−β)q
    tvd   ½ Σ |p − q|                     g = ½ sign(q − p) q
"""

from __future__ import annotations

import math

import torch

# A token loss and its gradient with respect to the student's logits, or None (no closed form).
ClosedForm = tuple[torch.Tensor, torch.Tensor] | None


def log_softmax_(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / τ)`` over the last dimension, written into ``logits``."""
    if temperature != 1.0:
        logits.div_(temperature)
    return logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` for ``[n, V]`` rows without an ``[n, V]`` product."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def softmax_backward_(grad: torch.Tensor, q: torch.Tensor, temperature: float) -> torch.Tensor:
    """``∂L/∂log q`` -> ``∂L/∂s`` for ``log q = log_softmax(s / τ)``, written into ``grad``."""
    grad.addcmul_(q, grad.sum(dim=-1, keepdim=True), value=-1.0)
    return grad.div_(temperature) if temperature != 1.0 else grad


def cross_entropy(student: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``−log q(y)`` (no temperature) and ``q − onehot(y)``: one buffer, the student's."""
    log_q = log_softmax_(student)
    rows = torch.arange(labels.shape[0], device=labels.device)
    loss = -log_q[rows, labels]
    grad = log_q.exp_()
    grad[rows, labels] -= 1.0
    return loss, grad


def forward_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    log_q, log_p = log_softmax_(student, temperature), log_softmax_(teacher, temperature)
    p = log_p.exp()
    loss = row_dot(p, log_p.sub_(log_q))
    return loss, softmax_backward_(p.neg_(), log_q.exp_(), temperature)


def reverse_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    log_q, log_p = log_softmax_(student, temperature), log_softmax_(teacher, temperature)
    difference = log_p.sub_(log_q).neg_()  # log q − log p
    q = log_q.exp_()
    loss = row_dot(q, difference)
    return loss, softmax_backward_(difference.add_(1.0).mul_(q), q, temperature)


def skew_forward_kl(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """0 < α < 1 (the ends are ``forward_kl`` and 0)."""
    log_q, log_p = log_softmax_(student, temperature), log_softmax_(teacher, temperature)
    p = log_p.exp()
    log_m = log_q + math.log(1.0 - alpha)
    torch.logaddexp(log_m, log_p.add_(math.log(alpha)), out=log_m)
    loss = row_dot(p, log_p.sub_(log_m).sub_(math.log(alpha)))  # p (log p − log m)
    grad = torch.sub(log_q, log_m, out=log_p).exp_().mul_(p).mul_(alpha - 1.0)  # −(1−α) p q/m
    return loss, softmax_backward_(grad, log_q.exp_(), temperature)


def skew_reverse_kl(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """0 < α < 1 (the ends are ``reverse_kl`` and 0)."""
    log_q, log_p = log_softmax_(student, temperature), log_softmax_(teacher, temperature)
    log_m = log_q + math.log(alpha)
    torch.logaddexp(log_m, log_p.add_(math.log(1.0 - alpha)), out=log_m)
    difference = log_m.sub_(log_q).neg_()  # log q − log m
    q = torch.exp(log_q, out=log_p)
    loss = row_dot(q, difference)
    grad = torch.exp(difference, out=log_q).mul_(-alpha).add_(difference).add_(1.0).mul_(q)
    return loss, softmax_backward_(grad, q, temperature)


def jensen_shannon(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """0 < β < 1 (the ends are ``forward_kl`` and ``reverse_kl``)."""
    log_q, log_p = log_softmax_(student, temperature), log_softmax_(teacher, temperature)
    log_m = log_p + math.log(beta)
    scratch = torch.add(log_q, math.log(1.0 - beta))
    torch.logaddexp(log_m, scratch, out=log_m)
    torch.sub(log_p, log_m, out=scratch)  # log p − log m
    teacher_part = row_dot(log_p.exp_(), scratch)
    difference = torch.sub(log_q, log_m, out=scratch)  # log q − log m
    q = log_q.exp_()
    loss = beta * teacher_part + (1.0 - beta) * row_dot(q, difference)
    return loss, softmax_backward_(difference.mul_(q).mul_(1.0 - beta), q, temperature)


def total_variation(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    q = log_softmax_(student, temperature).exp_()
    difference = log_softmax_(teacher, temperature).exp_().neg_().add_(q)  # q − p
    loss = 0.5 * torch.linalg.vector_norm(difference, ord=1, dim=-1)
    return loss, softmax_backward_(difference.sign_().mul_(q).mul_(0.5), q, temperature)


__all__ = [
    "cross_entropy",
    "forward_kl",
    "jensen_shannon",
    "log_softmax_",
    "reverse_kl",
    "row_dot",
    "skew_forward_kl",
    "skew_reverse_kl",
    "softmax_backward_",
    "total_variation",
]
