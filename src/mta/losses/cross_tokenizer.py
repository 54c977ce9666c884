"""Logit losses across two vocabularies, on the units both tokenisations agree on (docs/method.md §5b).

An aligned unit is one of annotate's ``boundary_spans``: ``[first, end)`` tokens on each side,
starting at a common boundary. A side's ``P(u) = p_τ(· | x_<first) · Π_{j>first} p_τ(x_j | x_<j)``
(unnormalised; GOLD's "observed" merge). Each loss is the mean over the units whose first token
is a response token on both sides:

- ``uld``: ``λ_ce·CE + λ_uld·Σ_i |sort↓(P_S(u))_i − sort↓(P_T(u))_i|`` (W1 of the sorted vectors,
  the shorter padded with zeros);
- ``gold``: ``λ_ce·CE + λ_kl·D(p̂_T ‖ p̂_S) + λ_uld·W1(unshared)``, ``p̂`` the first token's
  distribution on the shared vocabulary, renormalised; W1 on the tokens outside it.

The student's product carries a gradient to its later tokens' logits. fp32, a chunk of units at
a time (``mta.losses.chunked``), no Python loop over tokens or units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from mta.errors import MtaError
from mta.losses.chunked import (
    IGNORE_INDEX,
    TeacherLogits,
    chunked_label_log_probs,
    chunked_token_loss,
    chunked_unit_loss,
)
from mta.losses.divergences import check_unit_interval, kl, log_mixture
from mta.losses.span_masks import SpanBatch

# The ULD authors' scripts (llm-recipes: --distillation_config.cross_entropy_factor 1,
# --distillation_config.distil_factor 1.5).
ULD_CE_WEIGHT = 1.0
ULD_WEIGHT = 1.5
SharedDivergence = Literal["fkl", "srkl"]


@dataclass(frozen=True)
class AlignedUnits:
    """The units a loss reads, flattened over the batch: ``[n]`` int64 each.

    row: the unit's row; student_first, student_end, teacher_first, teacher_end: its half-open
    token ranges (unshifted positions, as ``input_ids``)."""

    row: torch.Tensor
    student_first: torch.Tensor
    student_end: torch.Tensor
    teacher_first: torch.Tensor
    teacher_end: torch.Tensor

    def __len__(self) -> int:
        return int(self.row.numel())


def aligned_units(spans: SpanBatch, student_labels: torch.Tensor, teacher_labels: torch.Tensor) -> AlignedUnits:
    """The units of ``spans`` (``batch.spans["boundary"]``) a unit loss compares.

    spans: ``[batch, units]`` token ranges + mask; student_labels ``[batch, seq_s]``,
    teacher_labels ``[batch, seq_t]``: unshifted, ``-100`` off the response. A unit counts when it
    is real (mask), non-empty and inside the sequence on both sides, its first token is not the
    sequence's first (a position predicts it) and is a response token on both sides.
    """
    seq_s, seq_t = student_labels.shape[1], teacher_labels.shape[1]
    s_first, s_end = spans.student_start.long(), spans.student_end.long()
    t_first, t_end = spans.teacher_start.long(), spans.teacher_end.long()
    ok = spans.mask.bool() & (s_first >= 1) & (t_first >= 1) & (s_end > s_first) & (t_end > t_first)
    ok &= (s_end <= seq_s) & (t_end <= seq_t)
    ok &= student_labels.gather(1, s_first.clamp(0, max(seq_s - 1, 0))) != IGNORE_INDEX
    ok &= teacher_labels.gather(1, t_first.clamp(0, max(seq_t - 1, 0))) != IGNORE_INDEX
    row, index = ok.nonzero(as_tuple=True)
    return AlignedUnits(row, s_first[row, index], s_end[row, index], t_first[row, index], t_end[row, index])


def unit_log_scales(
    logits: torch.Tensor,
    labels: torch.Tensor,
    row: torch.Tensor,
    first: torch.Tensor,
    end: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    chunk_size: int = 128,
) -> torch.Tensor:
    """``log c`` of each unit on one side: ``Σ_{j=first+1}^{end−1} log p_τ(x_j | x_<j)``.

    logits ``[batch, seq, V']`` (unshifted: position t predicts token t + 1), labels ``[batch, seq]``
    (unshifted token ids, ``-100`` off the response), row / first / end ``[n]`` (the units).
    Returns ``[n]`` fp32 (0 for a one-token unit), differentiable in ``logits``; only the positions
    inside multi-token units are computed.
    """
    batch, seq = labels.shape
    # Shifted frame: entry t is token t + 1, predicted at position t; a unit's later tokens are t in [first, end − 1).
    edges = torch.zeros(batch, seq + 1, dtype=torch.long, device=labels.device)
    edges.index_put_((row, first), torch.ones_like(first), accumulate=True)
    edges.index_put_((row, end - 1), -torch.ones_like(end), accumulate=True)
    inside = edges.cumsum(dim=1)[:, : seq - 1] > 0
    targets = torch.where(inside, labels[:, 1:], IGNORE_INDEX)
    log_probs = chunked_label_log_probs(
        logits[:, :-1], targets, vocab_size=vocab_size, temperature=temperature, chunk_size=chunk_size
    )
    cumulative = F.pad(log_probs.cumsum(dim=1), (1, 0))  # [batch, seq]: entry t = Σ of shifted entries < t
    return cumulative[row, end - 1] - cumulative[row, first]


def sorted_l1(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """ULD's distance: ``student [n, a]``, ``teacher [n, b]`` (non-negative) -> ``[n]``,
    ``Σ_i |sort↓(student)_i − sort↓(teacher)_i|`` with the shorter row padded with zeros."""
    width = max(student.shape[1], teacher.shape[1])
    high_s = F.pad(student.sort(dim=1, descending=True).values, (0, width - student.shape[1]))
    high_t = F.pad(teacher.sort(dim=1, descending=True).values, (0, width - teacher.shape[1]))
    return (high_s - high_t).abs().sum(dim=1)


def uld_unit_loss(
    student: torch.Tensor,
    student_log_scale: torch.Tensor,
    teacher: torch.Tensor,
    teacher_log_scale: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``W1(P_S, P_T)`` per unit: logits ``student [n, V_s]``, ``teacher [n, V_t]`` at the units'
    first tokens, log scales ``[n]`` (``log c``) -> ``[n]`` (:func:`sorted_l1` of ``c · p_τ``)."""
    merged_s = (student / temperature).softmax(dim=1) * student_log_scale.exp().unsqueeze(1)
    merged_t = (teacher / temperature).softmax(dim=1) * teacher_log_scale.exp().unsqueeze(1)
    return sorted_l1(merged_s, merged_t)


def shared_divergence(
    log_p: torch.Tensor, log_q: torch.Tensor, divergence: SharedDivergence, skew_alpha: float = 0.1
) -> torch.Tensor:
    """Teacher ``log_p``, student ``log_q`` ``[n, k]`` (normalised over k) -> ``[n]``: forward KL
    ``KL(p ‖ q)`` or skew reverse KL ``KL(q ‖ αq + (1−α)p)``."""
    if divergence == "fkl":
        return kl(log_p, log_q)
    if divergence == "srkl":
        return kl(log_q, log_mixture(log_q, log_p, skew_alpha))
    raise MtaError(f"the shared-vocabulary divergence must be fkl or srkl, not {divergence!r}")


def hybrid_unit_loss(
    student: torch.Tensor,
    student_log_scale: torch.Tensor,
    teacher: torch.Tensor,
    teacher_log_scale: torch.Tensor,
    *,
    shared: tuple[torch.Tensor, torch.Tensor],
    unshared: tuple[torch.Tensor, torch.Tensor],
    divergence: SharedDivergence = "fkl",
    skew_alpha: float = 0.1,
    kl_weight: float = 1.0,
    uld_weight: float = ULD_WEIGHT,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``kl_weight · D(p̂_T ‖ p̂_S) + uld_weight · W1(P_S|unshared, P_T|unshared)`` per unit.

    student ``[n, V_s]``, teacher ``[n, V_t]`` logits at the units' first tokens, log scales
    ``[n]``; shared: ``(student_ids [k], teacher_ids [k])`` the token pairs of the shared vocabulary
    (k >= 1); unshared: ``(student_ids, teacher_ids)`` every other id of each side. ``p̂`` is
    ``softmax`` over the shared ids alone (the shared mass renormalised). Returns ``[n]``.
    """
    log_q = (student[:, shared[0]] / temperature).log_softmax(dim=1)
    log_p = (teacher[:, shared[1]] / temperature).log_softmax(dim=1)
    loss = kl_weight * shared_divergence(log_p, log_q, divergence, skew_alpha)
    if uld_weight:
        merged_s = (student / temperature).softmax(dim=1) * student_log_scale.exp().unsqueeze(1)
        merged_t = (teacher / temperature).softmax(dim=1) * teacher_log_scale.exp().unsqueeze(1)
        loss = loss + uld_weight * sorted_l1(merged_s[:, unshared[0]], merged_t[:, unshared[1]])
    return loss


class UnitLogitLoss(nn.Module):
    """A base loss across vocabularies: ``ce_weight · CE`` on the reference + the mean of
    :meth:`unit_loss` over the aligned units. Subclasses define ``unit_loss``.

    vocab_size / teacher_vocab_size: each tokenizer's real vocabulary (default: the logits'
    widths); chunk_size: units (and positions) per fp32 chunk.
    """

    needs_teacher = True
    needs_units = True  # reads batch.spans["boundary"] (the objective checks the attribute)

    def __init__(
        self,
        *,
        ce_weight: float = ULD_CE_WEIGHT,
        temperature: float = 1.0,
        vocab_size: int | None = None,
        teacher_vocab_size: int | None = None,
        chunk_size: int = 128,
    ) -> None:
        super().__init__()
        if temperature <= 0:
            raise MtaError(f"temperature must be positive, got {temperature}")
        if ce_weight < 0:
            raise MtaError(f"the cross-entropy weight must be >= 0, got {ce_weight}")
        if chunk_size < 1:
            raise MtaError(f"chunk_size must be at least 1, got {chunk_size}")
        self.ce_weight, self.temperature, self.chunk_size = float(ce_weight), float(temperature), chunk_size
        self.vocab_size, self.teacher_vocab_size = vocab_size, teacher_vocab_size

    def unit_loss(
        self,
        student: torch.Tensor,
        student_log_scale: torch.Tensor,
        teacher: torch.Tensor,
        teacher_log_scale: torch.Tensor,
    ) -> torch.Tensor:
        """``student [n, V_s]``, ``teacher [n, V_t]`` fp32 logits at the units' first tokens,
        log scales ``[n]`` -> ``[n]``."""
        raise NotImplementedError

    def forward(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        student_labels: torch.Tensor,
        teacher_labels: torch.Tensor,
        spans: SpanBatch,
    ) -> torch.Tensor:
        """student_logits ``[batch, seq_s, V_s']``, teacher_logits ``[batch, seq_t, V_t']``, labels
        ``[batch, seq_*]`` — all unshifted (Hugging Face convention: position t predicts token
        t + 1; ``-100`` off the response) — and the aligned spans ``[batch, units]`` -> fp32 scalar."""
        if teacher_logits is None:
            raise MtaError(f"{type(self).__name__} compares with a teacher; teacher_logits is None")
        vocab_s = self._vocab(self.vocab_size, student_logits, "student")
        vocab_t = self._vocab(self.teacher_vocab_size, teacher_logits, "teacher")
        units = aligned_units(spans, student_labels, teacher_labels)
        options: dict[str, Any] = {"temperature": self.temperature, "chunk_size": self.chunk_size}
        student_scale = unit_log_scales(
            student_logits,
            student_labels,
            units.row,
            units.student_first,
            units.student_end,
            vocab_size=vocab_s,
            **options,
        )
        with torch.no_grad():
            teacher_scale = unit_log_scales(
                teacher_logits.detach(),
                teacher_labels,
                units.row,
                units.teacher_first,
                units.teacher_end,
                vocab_size=vocab_t,
                **options,
            )
        loss = chunked_unit_loss(
            self.unit_loss,
            student_logits,
            student_scale,
            teacher_logits.detach(),
            teacher_scale,
            units.row,
            units.student_first - 1,
            units.teacher_first - 1,
            vocab_sizes=(vocab_s, vocab_t),
            chunk_size=self.chunk_size,
        )
        if self.ce_weight:
            ce = chunked_token_loss(
                _cross_entropy,
                student_logits[:, :-1],
                None,
                student_labels[:, 1:],
                vocab_size=vocab_s,
                chunk_size=self.chunk_size,
            )
            loss = loss + self.ce_weight * ce
        return loss

    @staticmethod
    def _vocab(given: int | None, logits: torch.Tensor, side: str) -> int:
        if given is not None and given > logits.shape[-1]:
            raise MtaError(
                f"the {side} vocabulary ({given} tokens) exceeds its logits' width {logits.shape[-1]}; pass the "
                "tokenizer's real vocabulary size"
            )
        return given or logits.shape[-1]


def _cross_entropy(student: torch.Tensor, teacher: TeacherLogits | None, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(student, labels, reduction="none")


class UniversalLogitDistillation(UnitLogitLoss):
    """``loss.base: uld``: ``ce_weight · CE + uld_weight · W1(P_S(u), P_T(u))`` (module docstring)."""

    def __init__(self, *, uld_weight: float = ULD_WEIGHT, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if uld_weight < 0:
            raise MtaError(f"the ULD weight must be >= 0, got {uld_weight}")
        self.uld_weight = float(uld_weight)

    def unit_loss(
        self,
        student: torch.Tensor,
        student_log_scale: torch.Tensor,
        teacher: torch.Tensor,
        teacher_log_scale: torch.Tensor,
    ) -> torch.Tensor:
        return self.uld_weight * uld_unit_loss(
            student, student_log_scale, teacher, teacher_log_scale, temperature=self.temperature
        )


class SharedVocabularyHybrid(UnitLogitLoss):
    """``loss.base: gold``: ``ce_weight · CE + kl_weight · D(p̂_T ‖ p̂_S) + uld_weight · W1`` on the
    tokens outside the shared vocabulary (module docstring).

    shared_vocab: ``(student_ids [k], teacher_ids [k])`` from :func:`mta.losses.sra.shared_vocabulary`
    (k >= 1); divergence: ``fkl`` or ``srkl`` (with ``skew_alpha``).
    """

    def __init__(
        self,
        shared_vocab: tuple[torch.Tensor, torch.Tensor],
        *,
        divergence: SharedDivergence = "fkl",
        skew_alpha: float = 0.1,
        kl_weight: float = 1.0,
        uld_weight: float = ULD_WEIGHT,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        student_ids, teacher_ids = (torch.as_tensor(ids, dtype=torch.long) for ids in shared_vocab)
        if student_ids.numel() == 0 or student_ids.shape != teacher_ids.shape:
            raise MtaError(
                "loss.base=gold compares the tokens both vocabularies share, and the tokenizers share none "
                f"(got {tuple(student_ids.shape)} and {tuple(teacher_ids.shape)} ids); use loss.base=uld"
            )
        check_unit_interval("skew_alpha", skew_alpha)
        if divergence not in ("fkl", "srkl"):
            raise MtaError(f"the shared-vocabulary divergence must be fkl or srkl, not {divergence!r}")
        if kl_weight < 0 or uld_weight < 0:
            raise MtaError(f"the hybrid's weights must be >= 0, got kl {kl_weight}, uld {uld_weight}")
        self.divergence: SharedDivergence = divergence
        self.skew_alpha, self.kl_weight, self.uld_weight = float(skew_alpha), float(kl_weight), float(uld_weight)
        self.register_buffer("student_ids", student_ids, persistent=False)
        self.register_buffer("teacher_ids", teacher_ids, persistent=False)

    def shared_ids(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared vocabulary ``(student_ids [k], teacher_ids [k])`` on ``device``."""
        student_ids, teacher_ids = self.student_ids, self.teacher_ids
        assert isinstance(student_ids, torch.Tensor) and isinstance(teacher_ids, torch.Tensor), "registered buffers"
        return student_ids.to(device), teacher_ids.to(device)

    def unit_loss(
        self,
        student: torch.Tensor,
        student_log_scale: torch.Tensor,
        teacher: torch.Tensor,
        teacher_log_scale: torch.Tensor,
    ) -> torch.Tensor:
        student_ids, teacher_ids = self.shared_ids(student.device)
        keep = (student_ids < student.shape[1]) & (teacher_ids < teacher.shape[1])  # inside the real vocabularies
        shared = (student_ids[keep], teacher_ids[keep])
        unshared = (_complement(shared[0], student.shape[1]), _complement(shared[1], teacher.shape[1]))
        return hybrid_unit_loss(
            student,
            student_log_scale,
            teacher,
            teacher_log_scale,
            shared=shared,
            unshared=unshared,
            divergence=self.divergence,
            skew_alpha=self.skew_alpha,
            kl_weight=self.kl_weight,
            uld_weight=self.uld_weight,
            temperature=self.temperature,
        )


def _complement(ids: torch.Tensor, width: int) -> torch.Tensor:
    """The ids of ``[0, width)`` not in ``ids``, ascending."""
    keep = torch.ones(width, dtype=torch.bool, device=ids.device)
    keep[ids] = False
    return keep.nonzero().squeeze(1)


__all__ = [
    "ULD_CE_WEIGHT",
    "ULD_WEIGHT",
    "AlignedUnits",
    "SharedVocabularyHybrid",
    "UnitLogitLoss",
    "UniversalLogitDistillation",
    "aligned_units",
    "hybrid_unit_loss",
    "shared_divergence",
    "sorted_l1",
    "uld_unit_loss",
    "unit_log_scales",
]
