"""DistiLLM-2's contrastive loss over teacher-response / student-response pairs.

Each prompt comes twice in the micro batch: with the teacher's response ("chosen") and the
student's ("rejected"). With p the teacher and q the student distribution at temperature τ at each
response position, and sg the stop-gradient::

    SKL(t)  = KL(p ‖ α·p + (1−α)·q)                   on chosen rows (gradient through both q's)
    SRKL(t) = KL(q ‖ α·sg(q) + (1−α)·p)               on rejected rows (q in the mixture is constant)
    loss    = (2−β) · mean_{chosen rows}  [mean_{t in row} SKL(t)]
            +   β   · mean_{rejected rows}[mean_{t in row} SRKL(t)]

Rows without a response token count nowhere; given ``num_pairs`` (the global batch's pairs) each
kind's row sum is divided by it instead, so micro batches add up. For P whole pairs this is the
published trainer's loss exactly (docs/method.md §5). One pass of ``chunked_token_loss`` with
per-token weights ``(2−β) / n_b / R_chosen`` or ``β / n_b / R_rejected`` (n_b: tokens in row b).
"""

from __future__ import annotations

import torch
from torch import nn

from mta.errors import MtaError
from mta.losses.chunked import IGNORE_INDEX, TeacherLogits, chunked_token_loss, item_count
from mta.losses.divergences import check_unit_interval, kl_terms, log_mixture
from mta.losses.fused_head import LossSum, OutputHead, TeacherSide, fused_head_loss, response_positions
from mta.losses.teacher_sampled import SampledTeacher, sampled_estimate

# Kind of a response position, passed to the chunked loop in place of its label.
_CHOSEN, _REJECTED = 0, 1


class DistiLLM2Loss(nn.Module):
    """``(2−β)·SKL`` on the teacher's responses + ``β·SRKL`` (stop-gradient mixture) on the student's.

    beta: weight β in [0, 2] (β = 0: skew forward KL only, doubled; β = 2: skew reverse KL only,
    doubled). skew_alpha: α in [0, 1]. temperature: τ > 0 for both distributions (no τ²).
    vocab_size: compare logits on ``[0, vocab_size)`` (default: the narrower logits width).
    chunk_size: response positions per fp32 chunk.
    """

    needs_teacher = True

    def __init__(
        self,
        *,
        beta: float = 1.0,
        skew_alpha: float = 0.1,
        temperature: float = 1.0,
        vocab_size: int | None = None,
        chunk_size: int = 128,
    ) -> None:
        super().__init__()
        if not 0.0 <= beta <= 2.0:
            raise MtaError(f"distillm2_beta must lie in [0, 2], got {beta}")
        check_unit_interval("skew_alpha", skew_alpha)
        if not temperature > 0:
            raise MtaError(f"temperature must be positive, got {temperature}")
        if vocab_size is not None and vocab_size < 1:
            raise MtaError(f"vocab_size must be at least 1, got {vocab_size}")
        if chunk_size < 1:
            raise MtaError(f"chunk_size must be at least 1, got {chunk_size}")
        self.beta = float(beta)
        self.skew_alpha = float(skew_alpha)
        self.temperature = float(temperature)
        self.vocab_size = vocab_size
        self.chunk_size = chunk_size

    def _token_loss(self, student: torch.Tensor, teacher: TeacherLogits | None, kind: torch.Tensor) -> torch.Tensor:
        """``student [n, vocab]``, ``teacher [n, vocab]`` fp32 logits (or a sampled teacher's
        ``[n, m]`` entries), ``kind [n]`` -> ``[n]``:
        SKL where ``kind`` is chosen, SRKL where it is rejected."""
        if teacher is None:
            raise MtaError("DistiLLM2Loss compares with a teacher; teacher logits are None")
        log_q = (student / self.temperature).log_softmax(dim=1)
        alpha = self.skew_alpha
        loss = torch.zeros(kind.shape[0], dtype=log_q.dtype, device=log_q.device)
        forward = kind == _CHOSEN
        reverse = ~forward

        def skl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
            return kl_terms(p, log_mixture(p, q, alpha))

        def srkl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
            return kl_terms(q, log_mixture(q.detach(), p, alpha))

        for rows, terms in ((forward, skl), (reverse, srkl)):
            if not rows.any():
                continue
            if isinstance(teacher, SampledTeacher) and terms is skl:  # the unbiased estimate
                value = sampled_estimate(terms, log_q[rows], teacher[rows])
            elif isinstance(teacher, SampledTeacher):  # SRKL: the rest rule (kd.DistributionLoss)
                value = terms(teacher[rows].dense_log_probs("log_mean"), log_q[rows]).sum(dim=1)
            else:
                value = terms((teacher[rows] / self.temperature).log_softmax(dim=1), log_q[rows]).sum(dim=1)
            loss = loss.index_put((rows,), value)
        return loss

    def forward(
        self,
        student_logits: torch.Tensor,
        teacher_logits: TeacherLogits | None,
        labels: torch.Tensor,
        chosen: torch.Tensor,
        num_pairs: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """student_logits ``[batch, seq, V_s]``, teacher_logits ``[batch, seq, V_t]`` (already
        shifted: position t predicts ``labels[:, t]``), labels ``[batch, seq]`` with -100 off the
        response, chosen ``[batch]`` bool (True: the teacher's response, False: the student's).
        num_pairs (optional, > 0): divide each kind's sum of row means by this (the global
        batch's pairs) instead of by this batch's rows of that kind.
        Returns an fp32 scalar; the gradient flows to ``student_logits`` only."""
        vocab_size = self._check(student_logits, teacher_logits, labels, chosen)
        kind, weights = self._kinds_and_weights(labels, chosen, num_pairs)
        return chunked_token_loss(
            self._token_loss,
            student_logits,
            teacher_logits,
            kind,
            vocab_size=vocab_size,
            chunk_size=self.chunk_size,
            token_weights=weights,
        )

    def from_hidden(
        self,
        student_hidden: torch.Tensor,
        head: OutputHead,
        teacher: TeacherSide | None,
        labels: torch.Tensor,
        chosen: torch.Tensor,
        num_pairs: float | torch.Tensor | None = None,
    ) -> LossSum:
        """The same loss from the student's final hidden states ``[batch, seq, d]`` and LM head and
        the teacher's side at those positions (``mta.losses.fused_head``), the logits formed a chunk
        of response positions at a time. Returns the :class:`LossSum` (weighted: ``.mean`` is
        :meth:`forward`'s value)."""
        if teacher is None:
            raise MtaError("DistiLLM2Loss compares with a teacher; the teacher's side is None")
        if chosen.dtype != torch.bool or chosen.shape != labels.shape[:1]:
            raise MtaError(
                f"chosen must be a bool tensor [batch] = [{labels.shape[0]}], got {chosen.dtype} {tuple(chosen.shape)}"
            )
        if student_hidden.shape[:2] != labels.shape:
            raise MtaError(
                f"hidden states {tuple(student_hidden.shape)} do not cover the labels' positions {tuple(labels.shape)}"
            )
        kind, weights = self._kinds_and_weights(labels, chosen, num_pairs)
        rows, columns = response_positions(kind)
        return fused_head_loss(
            self._token_loss,
            student_hidden[rows, columns],
            head,
            teacher.select(rows, columns),
            kind[rows, columns],
            vocab_size=self.vocab_size or min(head.rows, teacher.rows),
            chunk_size=self.chunk_size,
            token_weights=weights[rows, columns],
        )

    def _kinds_and_weights(
        self, labels: torch.Tensor, chosen: torch.Tensor, num_pairs: float | torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, seq]`` each: the kind of every position that counts (-100 elsewhere) and its
        weight (each kind's row means over ``num_pairs``, or this batch's rows of that kind)."""
        pairs = item_count(num_pairs, "num_pairs")
        chosen = chosen.to(labels.device)
        response = labels != IGNORE_INDEX  # [batch, seq]
        tokens = response.sum(dim=1)  # [batch]
        has_tokens = tokens > 0
        if pairs is None:
            rows_chosen = (has_tokens & chosen).sum().clamp(min=1)
            rows_rejected = (has_tokens & ~chosen).sum().clamp(min=1)
        else:
            rows_chosen = rows_rejected = torch.tensor(pairs, device=labels.device)
        row_weight = torch.where(chosen, (2.0 - self.beta) / rows_chosen, self.beta / rows_rejected) / tokens.clamp(
            min=1
        )  # [batch]
        # Rows whose weight is 0 (β = 0 or 2) are skipped, not computed.
        visit = response & (row_weight > 0).unsqueeze(1)
        kind = torch.where(chosen, _CHOSEN, _REJECTED).unsqueeze(1).expand_as(labels)
        kind = torch.where(visit, kind, torch.full_like(kind, IGNORE_INDEX))
        weights = row_weight.float().unsqueeze(1).expand_as(labels)
        return kind, weights

    def _check(
        self,
        student_logits: torch.Tensor,
        teacher_logits: TeacherLogits | None,
        labels: torch.Tensor,
        chosen: torch.Tensor,
    ) -> int:
        """Validate shapes; return the vocabulary width to compare."""
        if teacher_logits is None:
            raise MtaError("DistiLLM2Loss compares with a teacher; teacher_logits is None")
        if student_logits.dim() != 3:
            raise MtaError(f"student logits must be [batch, seq, vocab], got {tuple(student_logits.shape)}")
        if teacher_logits.dim() != 3 or teacher_logits.shape[:2] != student_logits.shape[:2]:
            raise MtaError(
                f"teacher logits {tuple(teacher_logits.shape)} and student logits "
                f"{tuple(student_logits.shape)} do not cover the same positions"
            )
        if labels.shape != student_logits.shape[:2]:
            raise MtaError(
                f"labels {tuple(labels.shape)} do not match the logits positions {tuple(student_logits.shape[:2])}"
            )
        if chosen.dtype != torch.bool or chosen.shape != labels.shape[:1]:
            raise MtaError(
                f"chosen must be a bool tensor [batch] = [{labels.shape[0]}], got {chosen.dtype} {tuple(chosen.shape)}"
            )
        width = min(student_logits.shape[-1], teacher_logits.shape[-1])
        vocab_size = self.vocab_size or width
        if vocab_size > width:
            raise MtaError(
                f"vocab_size {vocab_size} exceeds the logits width {width}; pass the tokenizer's real vocabulary size"
            )
        return vocab_size


__all__ = ["DistiLLM2Loss"]
