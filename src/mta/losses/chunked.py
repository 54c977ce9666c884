"""Token losses over huge vocabularies, a chunk of positions at a time.

A plain autograd graph would keep fp32 softmax intermediates for every response position
until backward: ``[tokens, vocab]`` fp32, several GiB at a 150k vocabulary. Here the forward
pass visits the response positions in chunks, computes each chunk's loss *and* its gradient
in fp32, and keeps only the gradient, in the logits' own dtype; backward just scales it.

The reduction is the mean over response tokens, or, given ``token_weights`` ``[batch, seq]``,
the weighted sum ``Σ w[b, t] · loss[b, t]`` over the response positions (a caller builds a
per-sequence mean from it, e.g. ``w = 1 / tokens in row b / rows``). Weights are constants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mta.errors import MtaError
from mta.losses.teacher_sampled import SampledTeacher

IGNORE_INDEX = -100

# The teacher's side of a logit loss: logits, or a sampled cache's entries (mta.losses.teacher_sampled).
TeacherLogits = torch.Tensor | SampledTeacher
# (student [n, vocab] fp32, teacher [n, vocab] fp32 / [n, m] entries or None, labels [n]) -> [n] per-token loss
TokenLossFn = Callable[[torch.Tensor, TeacherLogits | None, torch.Tensor], torch.Tensor]


def _teacher_rows(teacher: TeacherLogits | None, where: tuple[torch.Tensor, torch.Tensor], vocab_size: int) -> Any:
    """The chunk's rows of the teacher's side: fp32 logits ``[n, vocab_size]``, or ``[n, m]`` entries."""
    if teacher is None or isinstance(teacher, SampledTeacher):
        return None if teacher is None else teacher[where]
    return teacher[where][:, :vocab_size].float()


class _ChunkedTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx, carrying the attributes this function sets on it
        student_logits: torch.Tensor,
        teacher_logits: TeacherLogits | None,
        labels: torch.Tensor,
        token_loss: TokenLossFn,
        vocab_size: int,
        chunk_size: int,
        token_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # (row, position) of each response token. Indexing the 3-d logits directly keeps a
        # sliced, non-contiguous view (``logits[:, :-1]``) from being copied whole by a reshape.
        rows, columns = (labels != IGNORE_INDEX).nonzero(as_tuple=True)
        num_tokens = rows.numel()
        wants_grad = ctx.needs_input_grad[0]
        # Weighted sum (divisor 1) or plain token mean (divisor: the token count).
        weights = None if token_weights is None else token_weights[rows, columns].float()
        divisor = 1 if weights is not None else max(num_tokens, 1)

        total = torch.zeros((), dtype=torch.float32, device=student_logits.device)
        grad_rows = (
            torch.empty(num_tokens, vocab_size, dtype=student_logits.dtype, device=student_logits.device)
            if wants_grad
            else None
        )
        for begin in range(0, num_tokens, chunk_size):
            chunk = slice(begin, begin + chunk_size)
            where = (rows[chunk], columns[chunk])
            # Indexing copies only this chunk; the fp32 cast happens per chunk.
            student = student_logits[where][:, :vocab_size].float().requires_grad_(wants_grad)
            teacher = _teacher_rows(teacher_logits, where, vocab_size)
            with torch.enable_grad():
                loss = token_loss(student, teacher, labels[where])
                loss = loss.sum() if weights is None else (loss * weights[chunk]).sum()
            if grad_rows is not None:  # exactly when wants_grad
                (grad,) = torch.autograd.grad(loss, student)
                grad_rows[chunk] = grad
            total += loss.detach()

        ctx.save_for_backward(rows, columns, grad_rows if wants_grad else None)
        ctx.logits_shape = student_logits.shape
        ctx.vocab_size = vocab_size
        ctx.divisor = divisor
        return total / divisor

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, columns, grad_rows = ctx.saved_tensors
        grad: torch.Tensor | None = None  # forward kept no gradient: only the teacher asked for one
        if grad_rows is not None:
            grad = torch.zeros(ctx.logits_shape, dtype=grad_rows.dtype, device=grad_rows.device)
            scale = grad_output / ctx.divisor
            # scale is a 0-dim float tensor: the product keeps grad_rows' dtype, which is grad's.
            grad[rows, columns, : ctx.vocab_size] = grad_rows * scale
        # The teacher is a constant of the loss: no gradient flows to it.
        return grad, None, None, None, None, None, None


def chunked_token_loss(
    token_loss: TokenLossFn,
    student_logits: torch.Tensor,
    teacher_logits: TeacherLogits | None,
    labels: torch.Tensor,
    *,
    vocab_size: int,
    chunk_size: int,
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean of ``token_loss`` over the positions whose label is not ``-100``.

    student_logits ``[batch, seq, V_s]``, teacher_logits ``[batch, seq, V_t]`` or None (or a
    sampled teacher's ``[batch, seq, m]`` entries, handed to ``token_loss`` as they are),
    labels ``[batch, seq]`` (already aligned with the logits). Only the first ``vocab_size``
    logits of each row are used. Returns an fp32 scalar (0 with a zero gradient when the
    batch has no response token).

    token_weights ``[batch, seq]`` (optional, read only where the label is not ``-100``; no
    gradient flows to it): return ``Σ token_weights · token_loss`` over those positions
    instead of their mean. None (default) keeps the plain token mean.
    """
    if token_weights is not None and token_weights.shape != labels.shape:
        raise MtaError(f"token_weights {tuple(token_weights.shape)} must match labels {tuple(labels.shape)}")
    return _ChunkedTokenLoss.apply(
        student_logits, teacher_logits, labels, token_loss, vocab_size, chunk_size, token_weights
    )
