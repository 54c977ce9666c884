"""The output head fused with a token loss: logits a chunk of response positions at a time.

``mta.losses.chunked`` starts from whole ``[batch, seq, vocab]`` logits. Here the loss starts one
step earlier, from the models' final hidden states at the response positions and their LM heads:
each chunk of ``chunk_size`` positions gets its student logits ``h W[:V]ᵀ + b[:V]`` (and its
teacher logits, from the teacher's hidden states and head, or rebuilt from its cached top k), the
token loss, and the gradients with respect to that chunk's hidden states and the head's weight
and bias, all in the forward pass (the logits' gradient in closed form where the loss has one,
``mta.losses.closed_form``, else by autograd). The chunk's logits and their gradient are then dropped: no
tensor of more than ``chunk_size × V`` elements is ever formed besides the head's own weight and
its gradient. Backward only scales the kept gradients.

Numerics follow the materialised path: the logits come out of the head in the weight's dtype
(bf16 in a bf16 run, as the model's head gives them) and the loss is computed from them in fp32;
the gradient with respect to the logits is cast back to that dtype before the products with the
head and the hidden states, as autograd does through a bf16 head. The weight's gradient is summed
over the chunks in fp32 and cast to the weight's dtype once.

Only the first ``vocab_size`` rows of each head are read (the common-prefix rule of
``mta.losses.kd``: embedding rows a checkpoint pads beyond its tokenizer never count), so the
padded rows' gradient is 0.

The reduction is a :class:`LossSum`: the sum over the response tokens (weighted, given per-token
weights) and the token count, so that a caller may divide by the micro batch's tokens (today's
mean) or by the global batch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mta.errors import MtaError
from mta.losses.chunked import IGNORE_INDEX
from mta.losses.closed_form import ClosedForm
from mta.losses.teacher_topk import teacher_logits_from_top_k

# (student [n, vocab] fp32, teacher [n, vocab] fp32 or None, targets [n]) -> [n] per-token loss
TokenLossFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]
# The same inputs (overwritten) -> ([n] per-token loss, [n, vocab] its gradient with respect to the
# student's logits), or None where the loss has no closed form (mta.losses.closed_form)
TokenLossGradFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], ClosedForm]


@dataclass(frozen=True)
class OutputHead:
    """An LM head's parameters: ``weight [V', d]`` (rows: vocabulary ids; the input embedding's
    weight itself for a tied head) and ``bias [V']`` or None."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.weight.shape[0])

    def logits(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``hidden [n, d]`` -> ``[n, vocab_size]`` in the weight's dtype: the head's first rows only."""
        bias = None if self.bias is None else self.bias[:vocab_size]
        return F.linear(hidden.to(self.weight.dtype), self.weight[:vocab_size], bias)

    @classmethod
    def of(cls, model: nn.Module) -> OutputHead:
        """The head of a Hugging Face causal LM (``get_output_embeddings()``), refused when it is
        not a plain linear map of the final hidden state (a LoRA-adapted head, a scaled or soft-capped
        one): then the fused path would not compute the model's logits."""
        head = model.get_output_embeddings()  # type: ignore[operator]
        config = getattr(model, "config", None)
        for key in ("final_logit_softcapping", "logit_scale"):
            if getattr(config, key, None) not in (None, 1.0):
                raise MtaError(
                    f"loss.fused_head: the {type(model).__name__} transforms its logits after the head "
                    f"({key}={getattr(config, key)}); set loss.fused_head=false"
                )
        if type(head) is not nn.Linear:
            raise MtaError(
                f"loss.fused_head: the model's output head is a {type(head).__name__}, not a plain "
                "nn.Linear (a LoRA adapter on lm_head?); leave lm_head out of student.lora.target_modules "
                "or set loss.fused_head=false"
            )
        return cls(head.weight, head.bias)


class TeacherSide(Protocol):
    """The teacher's side of a fused loss at ``[batch, seq]`` positions, or at the ``n`` selected ones."""

    @property
    def rows(self) -> int:
        """The width of the teacher's distribution (its head's rows)."""
        ...

    def select(self, rows: torch.Tensor, columns: torch.Tensor) -> TeacherSide:
        """The side at positions ``(rows[i], columns[i])`` of the ``[batch, seq]`` layout."""
        ...

    def chunk_logits(self, begin: int, end: int, vocab_size: int) -> torch.Tensor:
        """Selected positions ``begin:end`` -> fp32 teacher logits ``[end − begin, vocab_size]``, a
        tensor of the caller's own (the loss overwrites it)."""
        ...


@dataclass(frozen=True)
class HeadTeacher:
    """The teacher's final hidden states ``[batch, seq, d_t]`` (or ``[n, d_t]`` once selected) and
    its head: its logits are formed a chunk at a time, without gradient."""

    hidden: torch.Tensor
    head: OutputHead

    @property
    def rows(self) -> int:
        return self.head.rows

    def select(self, rows: torch.Tensor, columns: torch.Tensor) -> HeadTeacher:
        return HeadTeacher(self.hidden.detach()[rows, columns], self.head)

    def chunk_logits(self, begin: int, end: int, vocab_size: int) -> torch.Tensor:
        return self.head.logits(self.hidden[begin:end], vocab_size).detach().float()


@dataclass(frozen=True)
class TopKTeacher:
    """The teacher's top k from its cache (``mta.losses.teacher_topk``): ``ids``, ``log_probs``
    ``[batch, seq, k]`` (or ``[n, k]``), ``tail`` ``[batch, seq]`` (or ``[n]``), over a vocabulary
    of ``vocab_size`` at ``temperature``; each chunk's logits are the tail rule's ``τ · log p̃``."""

    ids: torch.Tensor
    log_probs: torch.Tensor
    tail: torch.Tensor
    vocab_size: int
    temperature: float

    @property
    def rows(self) -> int:
        return self.vocab_size

    def select(self, rows: torch.Tensor, columns: torch.Tensor) -> TopKTeacher:
        return TopKTeacher(
            self.ids[rows, columns],
            self.log_probs[rows, columns],
            self.tail[rows, columns],
            self.vocab_size,
            self.temperature,
        )

    def chunk_logits(self, begin: int, end: int, vocab_size: int) -> torch.Tensor:
        chunk = slice(begin, end)
        logits = teacher_logits_from_top_k(
            self.ids[chunk], self.log_probs[chunk], self.tail[chunk], self.vocab_size, self.temperature
        )
        return logits[:, :vocab_size]


@dataclass(frozen=True)
class LogitsTeacher:
    """The teacher's logits as they are, ``[batch, seq, V']`` (or ``[n, V']`` once selected): for a
    caller that has them already (its own teacher run); only the selected rows are read."""

    logits: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.logits.shape[-1])

    def select(self, rows: torch.Tensor, columns: torch.Tensor) -> LogitsTeacher:
        return LogitsTeacher(self.logits.detach()[rows, columns])

    def chunk_logits(self, begin: int, end: int, vocab_size: int) -> torch.Tensor:
        chunk = self.logits[begin:end, :vocab_size]
        return chunk.clone() if chunk.dtype == torch.float32 else chunk.float()  # the loss overwrites it


@dataclass(frozen=True)
class LossSum:
    """A token loss reduced to ``total`` (fp32 scalar: the sum over the response tokens, or the
    weighted sum given per-token weights) and ``tokens`` (the count of response tokens, a Python
    int). ``weighted``: the weights already normalise (DistiLLM-2's per-row means)."""

    total: torch.Tensor
    tokens: int
    weighted: bool = False

    @property
    def mean(self) -> torch.Tensor:
        """The micro batch's reduction as the materialised losses give it: the token mean, or the
        weighted sum itself."""
        return self.total if self.weighted else self.total / max(self.tokens, 1)


def chunk_loss_and_grad(
    token_loss: TokenLossFn,
    token_loss_and_grad: TokenLossGradFn | None,
    logits: torch.Tensor,
    teacher: torch.Tensor | None,
    targets: torch.Tensor,
    token_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed loss and its gradient with respect to ``logits [c, V]`` (in their dtype):
    in closed form where the loss has one, else by autograd on ``token_loss``. ``logits`` and
    ``teacher`` are the chunk's own tensors, overwritten."""
    student = logits.float()  # in an fp32 run the same tensor
    closed = None if token_loss_and_grad is None else token_loss_and_grad(student, teacher, targets)
    if closed is not None:
        per_token, grad = closed
        if token_weights is not None:
            per_token = per_token * token_weights
            grad.mul_(token_weights.unsqueeze(1))
        return per_token.sum(), grad.to(logits.dtype)
    student.requires_grad_(True)
    with torch.enable_grad():
        per_token = token_loss(student, teacher, targets)
        loss = per_token.sum() if token_weights is None else (per_token * token_weights).sum()
    (grad,) = torch.autograd.grad(loss, student)
    return loss.detach(), grad.to(logits.dtype)  # as autograd hands it to a head of this dtype


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx, carrying the attributes this function sets on it
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        token_weights: torch.Tensor | None,
        token_loss: TokenLossFn,
        token_loss_and_grad: TokenLossGradFn | None,
        teacher: TeacherSide | None,
        vocab_size: int,
        chunk_size: int,
        wants: tuple[bool, bool, bool],
    ) -> torch.Tensor:
        wants_hidden, wants_weight, wants_bias = wants
        num_tokens = hidden.shape[0]
        head = OutputHead(weight, bias)
        grad_hidden = torch.zeros_like(hidden) if wants_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants_weight else None
        grad_bias = torch.zeros(vocab_size, dtype=torch.float32, device=weight.device) if wants_bias else None
        wants_logits = wants_hidden or wants_weight or wants_bias
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for begin in range(0, num_tokens, chunk_size):
            end = min(begin + chunk_size, num_tokens)
            rows = hidden[begin:end]
            logits = head.logits(rows, vocab_size)  # [c, V] in the weight's dtype
            teacher_logits = None if teacher is None else teacher.chunk_logits(begin, end, vocab_size)
            chunk_weights = None if token_weights is None else token_weights[begin:end]
            if wants_logits:
                loss, grad = chunk_loss_and_grad(
                    token_loss, token_loss_and_grad, logits, teacher_logits, targets[begin:end], chunk_weights
                )
                if grad_hidden is not None:
                    grad_hidden[begin:end] = (grad @ weight[:vocab_size]).to(hidden.dtype)
                if grad_weight is not None:
                    if grad.dtype == torch.float32:
                        grad_weight[:vocab_size].addmm_(grad.t(), rows.to(weight.dtype))
                    else:
                        grad_weight[:vocab_size] += grad.t().mm(rows.to(weight.dtype)).float()
                if grad_bias is not None:
                    grad_bias += grad.float().sum(dim=0)
                del grad
            else:
                loss = token_loss(logits.float(), teacher_logits, targets[begin:end])
                loss = loss.sum() if chunk_weights is None else (loss * chunk_weights).sum()
            del logits, teacher_logits  # before the next chunk's are formed
            total += loss.detach()
        ctx.save_for_backward(
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias,
        )
        ctx.bias_shape = None if bias is None else (bias.shape, bias.dtype)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        # grad_output is a 0-dim float tensor: the products keep the saved gradients' dtypes. The
        # weight's gradient (vocab × hidden) is scaled in place, not copied: this function's
        # backward runs once (it is not differentiable twice).
        hidden = None if grad_hidden is None else grad_hidden * grad_output.to(grad_hidden.dtype)
        weight = None if grad_weight is None else grad_weight.mul_(grad_output.to(grad_weight.dtype))
        bias = None
        if grad_bias is not None and ctx.bias_shape is not None:
            shape, dtype = ctx.bias_shape
            bias = torch.zeros(shape, dtype=dtype, device=grad_bias.device)
            bias[: grad_bias.shape[0]] = (grad_bias * grad_output).to(dtype)
        return hidden, weight, bias, None, None, None, None, None, None, None, None


def fused_head_loss(
    token_loss: TokenLossFn,
    hidden: torch.Tensor,
    head: OutputHead,
    teacher: TeacherSide | None,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    chunk_size: int,
    token_weights: torch.Tensor | None = None,
    token_loss_and_grad: TokenLossGradFn | None = None,
) -> LossSum:
    """``Σ token_loss`` over ``n`` selected positions, from hidden states, a chunk at a time.

    hidden ``[n, d]``: the student's final hidden states at the positions (gradient flows to it);
    head: the student's LM head (gradient flows to its weight and bias when they require it);
    teacher: its side at the same ``n`` positions (``select``-ed), or None (``ce``); targets ``[n]``
    integers handed to ``token_loss`` (labels, or DistiLLM-2's kinds); token_weights ``[n]`` or None
    (constants). Only the heads' first ``vocab_size`` rows are read. Returns a :class:`LossSum`.
    """
    if chunk_size < 1:
        raise MtaError(f"chunk_size must be at least 1, got {chunk_size}")
    if hidden.dim() != 2 or hidden.shape[1] != head.weight.shape[1]:
        raise MtaError(
            f"hidden states {tuple(hidden.shape)} do not fit the head's weight {tuple(head.weight.shape)}: "
            "give [tokens, hidden] rows of the model's final hidden state"
        )
    if vocab_size > head.rows or (teacher is not None and vocab_size > teacher.rows):
        raise MtaError(
            f"vocab_size {vocab_size} exceeds the heads' rows ({head.rows}"
            f"{'' if teacher is None else f', teacher {teacher.rows}'}); pass the tokenizer's real vocabulary size"
        )
    grad = torch.is_grad_enabled()
    wants = (
        grad and hidden.requires_grad,
        grad and head.weight.requires_grad,
        grad and head.bias is not None and head.bias.requires_grad,
    )
    weights = None if token_weights is None else token_weights.detach().float()
    total = _FusedHeadLoss.apply(
        hidden,
        head.weight,
        head.bias,
        targets,
        weights,
        token_loss,
        token_loss_and_grad,
        teacher,
        vocab_size,
        chunk_size,
        wants,
    )
    return LossSum(total, int(hidden.shape[0]), weighted=token_weights is not None)


def response_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``labels [batch, seq]`` (aligned; -100 off the response) -> ``(rows, columns)`` of the response
    positions, the only ones that reach a head."""
    rows, columns = (labels != IGNORE_INDEX).nonzero(as_tuple=True)
    return rows, columns


def is_zero3_partitioned(parameter: torch.Tensor) -> bool:
    """True for a parameter DeepSpeed ZeRO-3 partitions (its data is a shard between forwards)."""
    return hasattr(parameter, "ds_id")


@contextlib.contextmanager
def gathered(head: OutputHead) -> Iterator[None]:
    """The head's whole weight (and bias) for the duration, under ZeRO-3 (a no-op otherwise): the
    frozen teacher's head, gathered once per step for the whole fused loss (it gets no gradient)."""
    partitioned = [p for p in (head.weight, head.bias) if p is not None and is_zero3_partitioned(p)]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


__all__ = [
    "HeadTeacher",
    "LogitsTeacher",
    "LossSum",
    "OutputHead",
    "TeacherSide",
    "TopKTeacher",
    "fused_head_loss",
    "gathered",
    "is_zero3_partitioned",
    "response_positions",
]
