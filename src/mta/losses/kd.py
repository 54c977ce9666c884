"""Base losses over response tokens: SFT cross-entropy and the token-level KD divergences.

docs/method.md §5, with p the teacher and q the student distribution at temperature τ (no τ² factor):
each loss is the sum over the vocabulary per token, then the mean over every response token
of the batch, the DistiLLM/torchtune convention (so ``ce`` is the usual causal-LM loss). Given
``num_items_in_batch`` (the response tokens of the whole global batch), the sum over this batch's
tokens is divided by it instead: micro batches' losses and gradients then add up to the global
batch's, whatever the split (Hugging Face's convention and name).

Inputs are aligned: ``student_logits[b, t]`` predicts ``labels[b, t]`` (the caller shifts),
``-100`` marks a position that is not a response token. Only the first ``vocab_size`` logits
are compared, so embedding rows a checkpoint pads beyond its tokenizer never count. All maths
is fp32 and in log space, a chunk of positions at a time (see ``mta.losses.chunked``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mta.errors import MtaError
from mta.losses import closed_form
from mta.losses.chunked import IGNORE_INDEX, TeacherLogits, chunked_token_loss
from mta.losses.closed_form import ClosedForm
from mta.losses.contrastive import DistiLLM2Loss
from mta.losses.cross_tokenizer import SharedDivergence, SharedVocabularyHybrid, UniversalLogitDistillation
from mta.losses.divergences import check_unit_interval, kl_terms, log_mixture
from mta.losses.fused_head import LossSum, OutputHead, TeacherSide, fused_head_loss, response_positions
from mta.losses.teacher_sampled import SampledTeacher, sampled_estimate


class BaseLoss(nn.Module):
    """Shared plumbing: vocabulary range, chunking, reduction. Subclasses define ``token_loss``.

    vocab_size: compare logits on ``[0, vocab_size)``, the tokenizer's real vocabulary
    (default: the smaller of the two logits widths). chunk_size: response positions per fp32
    chunk.
    """

    needs_teacher = True

    def __init__(self, *, vocab_size: int | None = None, chunk_size: int = 128) -> None:
        super().__init__()
        if chunk_size < 1:
            raise MtaError(f"chunk_size must be at least 1, got {chunk_size}")
        self.vocab_size = vocab_size
        self.chunk_size = chunk_size

    def token_loss(self, student: torch.Tensor, teacher: TeacherLogits | None, labels: torch.Tensor) -> torch.Tensor:
        """``student [n, vocab]``, ``teacher [n, vocab]`` fp32 logits (or a sampled teacher's
        ``[n, m]`` entries), ``labels [n]`` -> ``[n]``."""
        raise NotImplementedError

    def token_loss_and_grad(
        self, student: torch.Tensor, teacher: torch.Tensor | None, labels: torch.Tensor
    ) -> ClosedForm:
        """``token_loss`` and its gradient with respect to ``student`` in closed form
        (``mta.losses.closed_form``), overwriting both fp32 ``[n, vocab]`` logits; None where this
        loss has none (the fused head then runs autograd on ``token_loss``)."""
        return None

    def forward(
        self,
        student_logits: torch.Tensor,
        teacher_logits: TeacherLogits | None,
        labels: torch.Tensor,
        num_items_in_batch: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """student_logits ``[batch, seq, V_s]``, teacher_logits ``[batch, seq, V_t]`` (None for
        ``ce``; a :class:`~mta.losses.teacher_sampled.SampledTeacher` from a sampled cache),
        labels ``[batch, seq]`` -> fp32 scalar, the mean over response tokens, or their sum divided
        by ``num_items_in_batch`` when given (> 0)."""
        widths = [student_logits.shape[-1]]
        if self.needs_teacher:
            if teacher_logits is None:
                raise MtaError(f"{type(self).__name__} compares with a teacher; teacher_logits is None")
            if teacher_logits.shape[:-1] != student_logits.shape[:-1]:
                raise MtaError(
                    f"teacher logits {tuple(teacher_logits.shape)} and student logits "
                    f"{tuple(student_logits.shape)} do not cover the same positions"
                )
            widths.append(teacher_logits.shape[-1])
        else:
            teacher_logits = None
        vocab_size = self.vocab_size or min(widths)
        if vocab_size > min(widths):
            raise MtaError(
                f"vocab_size {vocab_size} exceeds the logits width {min(widths)}; pass the "
                f"tokenizer's real vocabulary size"
            )
        return chunked_token_loss(
            self.token_loss,
            student_logits,
            teacher_logits,
            labels,
            vocab_size=vocab_size,
            chunk_size=self.chunk_size,
            num_items_in_batch=num_items_in_batch,
        )

    def from_hidden(
        self,
        student_hidden: torch.Tensor,
        head: OutputHead,
        teacher: TeacherSide | None,
        labels: torch.Tensor,
    ) -> LossSum:
        """The same loss from the student's final hidden states and LM head, the logits formed a
        chunk of response positions at a time (``mta.losses.fused_head``).

        student_hidden ``[batch, seq, d]`` aligned with labels ``[batch, seq]`` (position t
        predicts ``labels[:, t]``); teacher: its side at the same ``[batch, seq]`` positions
        (``HeadTeacher`` or ``TopKTeacher``; None for ``ce``). Only the response positions reach
        either head. Returns the :class:`LossSum` (``.mean`` is :meth:`forward`'s value)."""
        if self.needs_teacher and teacher is None:
            raise MtaError(f"{type(self).__name__} compares with a teacher; the teacher's side is None")
        side = teacher if self.needs_teacher else None
        if student_hidden.shape[:2] != labels.shape:
            raise MtaError(
                f"hidden states {tuple(student_hidden.shape)} do not cover the labels' positions {tuple(labels.shape)}"
            )
        vocab_size = self.vocab_size or min(head.rows, *(() if side is None else (side.rows,)))
        rows, columns = response_positions(labels)
        return fused_head_loss(
            self.token_loss,
            student_hidden[rows, columns],
            head,
            None if side is None else side.select(rows, columns),
            labels[rows, columns],
            vocab_size=vocab_size,
            chunk_size=self.chunk_size,
            token_loss_and_grad=self.token_loss_and_grad,
        )


class CrossEntropy(BaseLoss):
    """SFT on the reference: ``−log q(y)`` (no temperature; the standard causal-LM loss)."""

    needs_teacher = False

    def token_loss(self, student: torch.Tensor, teacher: TeacherLogits | None, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(student, labels, reduction="none")

    def token_loss_and_grad(
        self, student: torch.Tensor, teacher: torch.Tensor | None, labels: torch.Tensor
    ) -> ClosedForm:
        return closed_form.cross_entropy(student, labels)


class DistributionLoss(BaseLoss):
    """A divergence between teacher and student distributions at temperature τ.

    From a sampled teacher cache a loss whose terms the teacher's p weighs (``importance_weighted``:
    forward KL, skew forward KL) is the unbiased importance-weighted estimate over the draws; the
    others (reverse KL, skew reverse KL, JSD, TVD: terms the student's q weighs, large where the
    teacher's p is too small to be drawn) read the rest rule's p̃, the head and draws exact and the
    rest of the mass spread evenly (biased as the tail rule is, with the draws kept exactly;
    docs/teacher-cache.md)."""

    importance_weighted = False
    rest_fill = "mass"  # the rest rule's fill: "mass" (a distribution) or "log_mean" (reverse KLs)

    def __init__(self, *, temperature: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if temperature <= 0:
            raise MtaError(f"temperature must be positive, got {temperature}")
        self.temperature = temperature

    def token_loss(self, student: torch.Tensor, teacher: TeacherLogits | None, labels: torch.Tensor) -> torch.Tensor:
        if teacher is None:
            raise MtaError(f"{type(self).__name__} compares with a teacher; teacher logits are None")
        log_q = F.log_softmax(student / self.temperature, dim=-1)
        if isinstance(teacher, SampledTeacher):  # a sampled cache (mta.losses.teacher_sampled)
            if self.importance_weighted:  # the unbiased estimate
                return sampled_estimate(self.terms, log_q, teacher)
            return self.divergence(teacher.dense_log_probs(self.rest_fill), log_q)  # the rest rule
        log_p = F.log_softmax(teacher / self.temperature, dim=-1)
        return self.divergence(log_p, log_q)

    def token_loss_and_grad(
        self, student: torch.Tensor, teacher: torch.Tensor | None, labels: torch.Tensor
    ) -> ClosedForm:
        return None if teacher is None else self.closed(student, teacher)

    def closed(self, student: torch.Tensor, teacher: torch.Tensor) -> ClosedForm:
        """This divergence at τ in closed form (``mta.losses.closed_form``), or None: autograd."""
        return None

    def divergence(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        """Teacher ``log_p`` and student ``log_q``, ``[n, vocab]`` -> ``[n]``: the terms' sum."""
        return self.terms(log_p, log_q).sum(dim=1)

    def terms(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        """The divergence's term at each token, ``f(p_v, q_v)``: ``[n, m]`` -> ``[n, m]`` (each
        divergence here is a sum of such terms over the vocabulary, which is what lets a
        sampled teacher estimate it: :mod:`mta.losses.teacher_sampled`)."""
        raise NotImplementedError


class ForwardKL(DistributionLoss):
    """``KL(p ‖ q)``: the student covers the teacher's mass (mean-seeking)."""

    importance_weighted = True

    def terms(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        return kl_terms(log_p, log_q)

    def closed(self, student: torch.Tensor, teacher: torch.Tensor) -> ClosedForm:
        return closed_form.forward_kl(student, teacher, self.temperature)


class ReverseKL(DistributionLoss):
    """``KL(q ‖ p)``: the student commits to the teacher's modes (MiniLLM)."""

    rest_fill = "log_mean"

    def terms(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        return kl_terms(log_q, log_p)

    def closed(self, student: torch.Tensor, teacher: torch.Tensor) -> ClosedForm:
        return closed_form.reverse_kl(student, teacher, self.temperature)


class _Skewed(DistributionLoss):
    """A divergence towards a mixture that puts weight ``skew_alpha`` on one side (DistiLLM)."""

    def __init__(self, *, skew_alpha: float = 0.1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_unit_interval("skew_alpha", skew_alpha)
        self.skew_alpha = skew_alpha

    def closed(self, student: torch.Tensor, teacher: torch.Tensor) -> ClosedForm:
        if self.skew_alpha in (0.0, 1.0):  # the ends (a plain KL, or 0): through autograd
            return None
        return self.between_the_ends(student, teacher)

    def between_the_ends(self, student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The closed form for 0 < α < 1."""
        raise NotImplementedError


class SkewForwardKL(_Skewed):
    """``KL(p ‖ αp + (1−α)q)`` (DistiLLM's skew KL, α = 0.1)."""

    importance_weighted = True

    def terms(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        return kl_terms(log_p, log_mixture(log_p, log_q, self.skew_alpha))

    def between_the_ends(self, student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return closed_form.skew_forward_kl(student, teacher, self.temperature, self.skew_alpha)


class SkewReverseKL(_Skewed):
    """``KL(q ‖ αq + (1−α)p)`` (DistiLLM's skew reverse KL, α = 0.1)."""

    rest_fill = "log_mean"

    def terms(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        return kl_terms(log_q, log_mixture(log_q, log_p, self.skew_alpha))

    def between_the_ends(self, student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return closed_form.skew_reverse_kl(student, teacher, self.temperature, self.skew_alpha)


class JensenShannon(DistributionLoss):
    """Generalised JSD: ``β KL(p ‖ m) + (1−β) KL(q ‖ m)`` with ``m = βp + (1−β)q`` (β = 0.5).

    At the ends, where that formula is 0 for every q, β = 0 is the forward ``KL(p ‖ q)`` and β = 1
    the reverse ``KL(q ‖ p)``: the limits of the JSD divided by β and by 1 − β, and what TRL's
    ``generalized_jsd_loss`` (and its ``DistillationConfig.beta``, default 1.0) mean by them."""

    def __init__(self, *, jsd_beta: float = 0.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_unit_interval("jsd_beta", jsd_beta)
        self.jsd_beta = jsd_beta

    def terms(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        if self.jsd_beta == 0.0:
            return kl_terms(log_p, log_q)
        if self.jsd_beta == 1.0:
            return kl_terms(log_q, log_p)
        log_m = log_mixture(log_p, log_q, self.jsd_beta)
        return self.jsd_beta * kl_terms(log_p, log_m) + (1.0 - self.jsd_beta) * kl_terms(log_q, log_m)

    def closed(self, student: torch.Tensor, teacher: torch.Tensor) -> ClosedForm:
        if self.jsd_beta == 0.0:
            return closed_form.forward_kl(student, teacher, self.temperature)
        if self.jsd_beta == 1.0:
            return closed_form.reverse_kl(student, teacher, self.temperature)
        return closed_form.jensen_shannon(student, teacher, self.temperature, self.jsd_beta)


class TotalVariation(DistributionLoss):
    """``½ Σ |p − q|``."""

    def terms(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        return 0.5 * (log_p.exp() - log_q.exp()).abs()

    def closed(self, student: torch.Tensor, teacher: torch.Tensor) -> ClosedForm:
        return closed_form.total_variation(student, teacher, self.temperature)


BASE_LOSSES: dict[str, type[nn.Module]] = {
    "ce": CrossEntropy,
    "fkl": ForwardKL,
    "rkl": ReverseKL,
    "skl": SkewForwardKL,
    "srkl": SkewReverseKL,
    "jsd": JensenShannon,
    "tvd": TotalVariation,
    "distillm2": DistiLLM2Loss,  # pairs: needs the batch's ``chosen`` (mta.losses.contrastive)
}
# Across vocabularies, on aligned units: (logits, teacher logits, both sides' labels, the boundary
# spans), unshifted (mta.losses.cross_tokenizer).
UNIT_LOSSES: dict[str, type[nn.Module]] = {"uld": UniversalLogitDistillation, "gold": SharedVocabularyHybrid}


def build_base_loss(
    name: str,
    *,
    temperature: float = 1.0,
    skew_alpha: float = 0.1,
    jsd_beta: float = 0.5,
    distillm2_beta: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int = 128,
    teacher_vocab_size: int | None = None,
    uld_weight: float = 1.5,
    uld_ce_weight: float = 1.0,
    shared_kl_weight: float = 1.0,
    shared_divergence: SharedDivergence = "fkl",
    shared_vocab: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> nn.Module:
    """The base loss a recipe names (``loss.base``), with the options that loss uses.

    ``uld`` and ``gold`` also take the teacher's real vocabulary and their weights; ``gold`` the
    shared vocabulary ``(student_ids [k], teacher_ids [k])`` (:func:`mta.losses.sra.shared_vocabulary`)."""
    known = {**BASE_LOSSES, **UNIT_LOSSES}
    if name not in known:
        raise MtaError(f"unknown base loss '{name}'; choose one of {', '.join(known)}")
    cls = known[name]
    kwargs: dict[str, Any] = {"vocab_size": vocab_size, "chunk_size": chunk_size}
    if cls in (UniversalLogitDistillation, SharedVocabularyHybrid):
        kwargs.update(
            temperature=temperature,
            ce_weight=uld_ce_weight,
            uld_weight=uld_weight,
            teacher_vocab_size=teacher_vocab_size,
        )
        if cls is UniversalLogitDistillation:
            return cls(**kwargs)
        if shared_vocab is None:  # refused by the hybrid, naming the fix
            shared_vocab = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        return SharedVocabularyHybrid(
            shared_vocab, divergence=shared_divergence, skew_alpha=skew_alpha, kl_weight=shared_kl_weight, **kwargs
        )
    if issubclass(cls, DistributionLoss):
        kwargs["temperature"] = temperature
    if cls in (SkewForwardKL, SkewReverseKL):
        kwargs["skew_alpha"] = skew_alpha
    if cls is JensenShannon:
        kwargs["jsd_beta"] = jsd_beta
    if cls is DistiLLM2Loss:
        kwargs.update(beta=distillm2_beta, skew_alpha=skew_alpha, temperature=temperature)
    return cls(**kwargs)


__all__ = [
    "BASE_LOSSES",
    "BaseLoss",
    "CrossEntropy",
    "DistributionLoss",
    "ForwardKL",
    "IGNORE_INDEX",
    "JensenShannon",
    "ReverseKL",
    "SkewForwardKL",
    "SkewReverseKL",
    "TotalVariation",
    "UNIT_LOSSES",
    "build_base_loss",
]
