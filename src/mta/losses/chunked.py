"""Token losses over huge vocabularies, a chunk of positions at a time.

A plain autograd graph would keep fp32 softmax intermediates for every response position
until backward: ``[tokens, vocab]`` fp32, several GiB at a 150k vocabulary. Here the forward
pass visits the response positions in chunks, computes each chunk's loss *and* its gradient
in fp32, and keeps only the gradient, in the logits' own dtype; backward just scales it.

The reduction is the mean over response tokens, or, given ``token_weights`` ``[batch, seq]``,
the weighted sum ``Σ w[b, t] · loss[b, t]`` over the response positions (a caller builds a
per-sequence mean from it, e.g. ``w = 1 / tokens in row b / rows``). Weights are constants.
``num_items_in_batch`` replaces the batch's own token count as the divisor (Hugging Face's name):
given the token count of a whole accumulation window, micro batches' losses add up to the
window's token mean (docs/method.md §5, "Reduction").
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
        num_items_in_batch: float | None = None,
    ) -> torch.Tensor:
        # (row, position) of each response token. Indexing the 3-d logits directly keeps a
        # sliced, non-contiguous view (``logits[:, :-1]``) from being copied whole by a reshape.
        rows, columns = (labels != IGNORE_INDEX).nonzero(as_tuple=True)
        num_tokens = rows.numel()
        wants_grad = ctx.needs_input_grad[0]
        # Weighted sum (divisor 1), a sum over a count given from outside, or the token mean.
        weights = None if token_weights is None else token_weights[rows, columns].float()
        if num_items_in_batch is not None:
            divisor: float = num_items_in_batch
        else:
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
        return grad, None, None, None, None, None, None, None


def chunked_token_loss(
    token_loss: TokenLossFn,
    student_logits: torch.Tensor,
    teacher_logits: TeacherLogits | None,
    labels: torch.Tensor,
    *,
    vocab_size: int,
    chunk_size: int,
    token_weights: torch.Tensor | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
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

    num_items_in_batch (optional, > 0): divide the (weighted) sum by this instead, e.g. the
    response tokens of the whole global batch, so that micro batches' values and gradients add
    up to the global batch's mean.
    """
    if token_weights is not None and token_weights.shape != labels.shape:
        raise MtaError(f"token_weights {tuple(token_weights.shape)} must match labels {tuple(labels.shape)}")
    divisor = item_count(num_items_in_batch)
    return _ChunkedTokenLoss.apply(
        student_logits, teacher_logits, labels, token_loss, vocab_size, chunk_size, token_weights, divisor
    )


class _ChunkedLabelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        temperature: float,
        chunk_size: int,
    ) -> torch.Tensor:
        rows, columns = (labels != IGNORE_INDEX).nonzero(as_tuple=True)
        out = torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
        with torch.no_grad():
            for begin in range(0, rows.numel(), chunk_size):
                where = (rows[begin : begin + chunk_size], columns[begin : begin + chunk_size])
                log_q = (logits[where][:, :vocab_size].float() / temperature).log_softmax(dim=1)
                out[where] = log_q.gather(1, labels[where].unsqueeze(1)).squeeze(1)
        ctx.save_for_backward(logits, labels, rows, columns)
        ctx.vocab_size, ctx.temperature, ctx.chunk_size = vocab_size, temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, labels, rows, columns = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        grad = torch.zeros_like(logits)
        vocab = ctx.vocab_size
        for begin in range(0, rows.numel(), ctx.chunk_size):
            where = (rows[begin : begin + ctx.chunk_size], columns[begin : begin + ctx.chunk_size])
            # d log softmax(z / τ)[y] / dz = (onehot(y) − softmax(z / τ)) / τ, recomputed per chunk.
            chunk = -(logits[where][:, :vocab].float() / ctx.temperature).softmax(dim=1)
            chunk.scatter_add_(1, labels[where].unsqueeze(1), torch.ones_like(chunk[:, :1]))
            grad[where[0], where[1], :vocab] = (chunk * (grad_output[where] / ctx.temperature).unsqueeze(1)).to(
                grad.dtype
            )
        return grad, None, None, None, None


def chunked_label_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int, temperature: float = 1.0, chunk_size: int = 128
) -> torch.Tensor:
    """``log softmax(logits / τ)[label]`` at every position whose label is not ``-100`` (0 elsewhere).

    logits ``[batch, seq, V']`` (only ``[:vocab_size]`` count), labels ``[batch, seq]`` aligned with
    them (``logits[b, t]`` predicts ``labels[b, t]``). Returns ``[batch, seq]`` fp32; the gradient
    flows to the logits, recomputed a chunk of positions at a time in backward (no
    ``[tokens, vocab]`` fp32 softmax is kept between the passes).
    """
    return _ChunkedLabelLogProbs.apply(logits, labels, vocab_size, temperature, chunk_size)


# (student rows [n, V_s] fp32, student log scale [n], teacher rows [n, V_t] fp32, teacher log
# scale [n]) -> [n] per-unit loss (mta.losses.cross_tokenizer).
UnitLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _ChunkedUnitLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        student_logits: torch.Tensor,
        student_log_scale: torch.Tensor,
        teacher_logits: torch.Tensor,
        teacher_log_scale: torch.Tensor,
        rows: torch.Tensor,
        student_positions: torch.Tensor,
        teacher_positions: torch.Tensor,
        unit_loss: UnitLossFn,
        vocab_sizes: tuple[int, int],
        chunk_size: int,
    ) -> torch.Tensor:
        count = rows.numel()
        wants = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        student_vocab, teacher_vocab = vocab_sizes
        total = torch.zeros((), dtype=torch.float32, device=student_logits.device)
        grad_rows = (
            torch.empty(count, student_vocab, dtype=student_logits.dtype, device=student_logits.device)
            if wants[0]
            else None
        )
        grad_scale = torch.zeros(count, dtype=torch.float32, device=student_logits.device)
        for begin in range(0, count, chunk_size):
            chunk = slice(begin, begin + chunk_size)
            student = student_logits[rows[chunk], student_positions[chunk]][:, :student_vocab].float()
            student = student.requires_grad_(wants[0])
            scale = student_log_scale[chunk].detach().float().requires_grad_(wants[1])
            teacher = teacher_logits[rows[chunk], teacher_positions[chunk]][:, :teacher_vocab].float()
            with torch.enable_grad():
                loss = unit_loss(student, scale, teacher, teacher_log_scale[chunk].detach().float()).sum()
            inputs = [tensor for tensor, wanted in zip((student, scale), wants, strict=True) if wanted]
            if inputs:
                grads = list(torch.autograd.grad(loss, inputs, allow_unused=True))
                if wants[0]:
                    assert grad_rows is not None, "allocated exactly when the student rows want a gradient"
                    grad = grads.pop(0)
                    grad_rows[chunk] = 0 if grad is None else grad
                if wants[1]:
                    grad = grads.pop(0)
                    grad_scale[chunk] = 0 if grad is None else grad
            total += loss.detach()
        ctx.save_for_backward(rows, student_positions, grad_rows if wants[0] else None, grad_scale)
        ctx.logits_shape, ctx.student_vocab, ctx.divisor = student_logits.shape, student_vocab, max(count, 1)
        return total / ctx.divisor

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, positions, grad_rows, grad_scale = ctx.saved_tensors
        scale = grad_output / ctx.divisor
        grad_logits = None
        if grad_rows is not None:
            grad_logits = torch.zeros(ctx.logits_shape, dtype=grad_rows.dtype, device=grad_rows.device)
            # Units never share a first position: one row of the gradient per unit.
            grad_logits[rows, positions, : ctx.student_vocab] = grad_rows * scale
        grad_log_scale = grad_scale * scale if ctx.needs_input_grad[1] else None
        return grad_logits, grad_log_scale, None, None, None, None, None, None, None, None


def chunked_unit_loss(
    unit_loss: UnitLossFn,
    student_logits: torch.Tensor,
    student_log_scale: torch.Tensor,
    teacher_logits: torch.Tensor,
    teacher_log_scale: torch.Tensor,
    rows: torch.Tensor,
    student_positions: torch.Tensor,
    teacher_positions: torch.Tensor,
    *,
    vocab_sizes: tuple[int, int],
    chunk_size: int,
) -> torch.Tensor:
    """Mean of ``unit_loss`` over n aligned units, a chunk of units at a time.

    student_logits ``[batch, seq_s, V_s']``, teacher_logits ``[batch, seq_t, V_t']``: each unit reads
    the row ``(rows[u], student_positions[u])`` of one and ``(rows[u], teacher_positions[u])`` of the
    other (the first ``vocab_sizes`` entries); student_log_scale, teacher_log_scale ``[n]``: a
    per-unit log factor handed to ``unit_loss`` as it is (the gradient flows back to the student's,
    e.g. from :func:`chunked_label_log_probs`; the teacher's is a constant). Units must not share a
    student position. Returns an fp32 scalar (0 with zero gradients when n = 0); as in
    :func:`chunked_token_loss`, only each chunk's gradient is kept, in the logits' dtype.
    """
    return _ChunkedUnitLoss.apply(
        student_logits,
        student_log_scale,
        teacher_logits,
        teacher_log_scale,
        rows,
        student_positions,
        teacher_positions,
        unit_loss,
        vocab_sizes,
        chunk_size,
    )


def item_count(count: float | torch.Tensor | None, name: str = "num_items_in_batch") -> float | None:
    """A divisor given from outside (a number, or a one-element tensor as Hugging Face's
    ``num_items_in_batch`` is) as a float; it must be positive. None stays None (the batch's own
    count)."""
    if count is None:
        return None
    value = float(count.item()) if isinstance(count, torch.Tensor) else count
    if not (isinstance(value, int | float) and value > 0):
        raise MtaError(f"{name} must be a positive number (the global batch's count), got {count!r}")
    return float(value)
