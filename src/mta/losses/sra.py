"""Span Representation Alignment (SRA, arXiv 2605.01205): cross-tokenizer distillation on spans.

Each span both tokenizers agree on is a cluster of token "particles" on either side, represented
by its weighted centre of mass (:func:`span_centres`, weights from :func:`last_token_attention`).
:class:`SpanRepresentationLoss` aligns the centres three ways:

- span: ``1 − cos(P_i s_k, t_k)`` per layer pair i, weighted by the teacher's span weights;
- geometry: the span cosine-similarity matrices of the last pair (DSA, :mod:`mta.losses.dsa`);
- logit: ``KL(teacher ‖ student)`` of each side's LM head on its span centres, restricted to the
  vocabulary both tokenizers share (:func:`shared_vocabulary`).

``sra = span + geometry_weight · geometry + logit_weight · logit``. Pure torch, all maths in fp32;
no loop over spans or tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mta.errors import MtaError
from mta.losses.divergences import kl
from mta.losses.dsa import COS_EPS, WEIGHT_EPS, dynamic_structural_alignment, sequence_mean
from mta.losses.pooling import MASS_EPS
from mta.losses.span_masks import SpanBatch, span_token_mask
from mta.losses.trajectory import apply_projector, projector_at

# The port's defaults (ICARE code/arguments.py: --sra-geom-weight 50.0; the logit term enters
# its total with weight 1; --kd-temperature 1.0).
GEOMETRY_WEIGHT = 50.0
LOGIT_WEIGHT = 1.0

# (hidden [n, d], vocab_rows [k]) -> logits [n, k] over those rows of that side's vocabulary, in
# their order (final norm + LM head, composed by the caller: mta.training.logit_lens.LogitLens.for_layer).
Head = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class VocabularyTokenizer(Protocol):
    """What :func:`tokenizers_shared_vocabulary` reads of a tokenizer (a Hugging Face one has both)."""

    @property
    def all_special_tokens(self) -> list[str]: ...

    def get_vocab(self) -> dict[str, int]: ...


# Space markers of byte-level BPE (GPT-2's byte-to-unicode map sends " " to "Ġ") and SentencePiece.
SPACE_MARKERS = ("\u0120", "\u2581")


def centre_weights(token_mask: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each span's centre-of-mass weights over the tokens, and its mass.

    token_mask: ``[batch, spans, seq]`` bool (``span_token_mask``); weights: ``[batch, seq]`` >= 0
    (detached here). Returns ``(matrix [batch, spans, seq], mass [batch, spans])`` in fp32:
    ``matrix[b, k]`` is ``w_t / Σ w`` over span k's tokens, or ``1 / n`` (the plain mean) when
    its mass ``Σ w`` is at most ``MASS_EPS``, and 0 for an empty (or padding) span. The matrix
    does not depend on the layer: one per side serves every layer pair.
    """
    mask = token_mask.float()
    weighted = mask * weights.detach().float().unsqueeze(1)
    mass = weighted.sum(dim=-1)
    plain = mask / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    heavy = (mass > MASS_EPS).unsqueeze(-1)
    return torch.where(heavy, weighted / mass.clamp(min=MASS_EPS).unsqueeze(-1), plain), mass


def span_centres(hidden: torch.Tensor, token_mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted centre of mass of every span's token states.

    hidden: ``[batch, seq, d]``; token_mask: ``[batch, spans, seq]`` bool (``SpanBatch``'s
    ``student_token_mask`` / ``teacher_token_mask``); weights: ``[batch, seq]`` >= 0 (detached
    here). Returns ``[batch, spans, d]`` fp32: ``Σ_t w_t h_t / Σ_t w_t`` over the span's tokens;
    a span whose total weight is at most ``MASS_EPS`` gets the plain mean of its tokens, an
    empty (or padding) span 0 (:func:`centre_weights`).
    """
    matrix, _ = centre_weights(token_mask, weights)
    return torch.bmm(matrix, hidden.float())


@torch.no_grad()
def last_token_attention(attentions: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The port's token weights: the attention row of each sequence's last real token.

    attentions: ``[batch, heads, seq, seq]`` one layer's attention probabilities (query, key);
    attention_mask: ``[batch, seq]`` 1/True for real tokens (left or right padding).
    Returns ``[batch, seq]`` fp32, detached: that row summed over heads, 0 on padding keys and
    all 0 for a sequence without a real token. (The port reads row ``-1``, a padding row under
    right padding.) The scale is irrelevant downstream: span weights are normalised per sequence.
    """
    real = attention_mask.bool()
    positions = torch.arange(real.shape[1], device=real.device)
    last = torch.where(real, positions, 0).amax(dim=1)  # [B]; 0 when no real token (then all masked below)
    rows = attentions[torch.arange(real.shape[0], device=real.device), :, last]  # [B, H, T]
    return rows.float().sum(dim=1) * real  # a real row never attends a later padding key anyway


def shared_vocabulary(
    student_vocab: Mapping[str, int],
    teacher_vocab: Mapping[str, int],
    student_special: Collection[str] = (),
    teacher_special: Collection[str] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids the two vocabularies share, as ``(student_ids [k], teacher_ids [k])`` LongTensors.

    student_vocab, teacher_vocab: ``tokenizer.get_vocab()`` (string -> id). student_special,
    teacher_special: each side's special tokens (``tokenizer.all_special_tokens``).
    Ordinary tokens match when equal after mapping the space markers ``Ġ`` (byte-level BPE) and
    ``▁`` (SentencePiece) to a space; a special token matches only a special token spelt
    identically on the other side. Pairs are sorted by student id; where two tokens of one side
    normalise to the same string, the lowest id is kept.
    """
    student_special, teacher_special = set(student_special), set(teacher_special)

    def keyed(vocab: Mapping[str, int], special: set[str]) -> dict[tuple[bool, str], int]:
        out: dict[tuple[bool, str], int] = {}
        for token, index in vocab.items():
            key = (True, token) if token in special else (False, _normalise(token))
            if key not in out or index < out[key]:
                out[key] = index
        return out

    student, teacher = keyed(student_vocab, student_special), keyed(teacher_vocab, teacher_special)
    pairs = sorted((index, teacher[key]) for key, index in student.items() if key in teacher)
    ids = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
    return ids[:, 0].contiguous(), ids[:, 1].contiguous()


def tokenizers_shared_vocabulary(
    student_tokenizer: VocabularyTokenizer, teacher_tokenizer: VocabularyTokenizer
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`shared_vocabulary` of two loaded tokenizers (anything with ``get_vocab()`` and
    ``all_special_tokens``, as Hugging Face tokenizers have): the one place both are read."""
    return shared_vocabulary(
        student_tokenizer.get_vocab(),
        teacher_tokenizer.get_vocab(),
        student_special=tuple(student_tokenizer.all_special_tokens),
        teacher_special=tuple(teacher_tokenizer.all_special_tokens),
    )


def _normalise(token: str) -> str:
    for marker in SPACE_MARKERS:
        token = token.replace(marker, " ")
    return token


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine ``[..., d] x [..., d] -> [...]``, 0 against a zero vector (finite gradient)."""
    return (F.normalize(a.float(), dim=-1, eps=COS_EPS) * F.normalize(b.float(), dim=-1, eps=COS_EPS)).sum(-1)


def _sequence_mean(
    per_span: torch.Tensor, span_weights: torch.Tensor, num_sequences: float | None = None
) -> torch.Tensor:
    """``Σ_k w̃_k x_k`` per sequence (``w̃`` normalised over its spans), averaged over the
    sequences with positive weight, or summed over ``num_sequences`` (the global batch's
    sequences) when given; a zero that keeps the graph when none has any.

    per_span, span_weights: ``[batch, spans]``.
    """
    total = span_weights.sum(dim=1, keepdim=True)
    per_sequence = (per_span * span_weights / total.clamp(min=WEIGHT_EPS)).sum(dim=1)
    return sequence_mean(per_sequence, total.squeeze(1) > 0, num_sequences)


class SpanRepresentationLoss(nn.Module):
    """SRA's span, geometry and span-logit terms over aligned (student, teacher) layer pairs.

    ``self.projectors[i]`` (``nn.Linear(student_hidden, teacher_hidden)``) maps the student's
    span centres of pair i to the teacher's width (the port shares one projector across pairs).
    geometry_weight, logit_weight: the terms' weights in ``sra`` (port: 50 and 1).
    temperature: of the span-logit KL (port: ``--kd-temperature``, default 1; no ``T²`` factor).
    chunk_size: span centres per head application of the span-logit KL (``loss.chunk_size``): the
    ``[spans, shared vocabulary]`` logits exist a chunk at a time, recomputed in backward. None:
    one application over every span, however many (a ZeRO-3-partitioned head is gathered at each
    application, so every process must apply it equally often whatever its span count).
    """

    def __init__(
        self,
        num_pairs: int,
        student_hidden: int,
        teacher_hidden: int,
        *,
        geometry_weight: float = GEOMETRY_WEIGHT,
        logit_weight: float = LOGIT_WEIGHT,
        temperature: float = 1.0,
        chunk_size: int | None = 128,
    ) -> None:
        super().__init__()
        if chunk_size is not None and chunk_size < 1:
            raise MtaError(f"chunk_size must be at least 1, got {chunk_size}")
        self.chunk_size = chunk_size
        if num_pairs < 1:
            raise MtaError(f"SRA needs at least one (student, teacher) layer pair, got {num_pairs}")
        if temperature <= 0:
            raise MtaError(f"the SRA logit temperature must be positive, got {temperature}")
        if geometry_weight < 0 or logit_weight < 0:
            raise MtaError(f"SRA term weights must be >= 0, got geometry {geometry_weight}, logit {logit_weight}")
        self.num_pairs = num_pairs
        self.geometry_weight = float(geometry_weight)
        self.logit_weight = float(logit_weight)
        self.temperature = float(temperature)
        self.projectors = nn.ModuleList(nn.Linear(student_hidden, teacher_hidden) for _ in range(num_pairs))

    def forward(
        self,
        student_states: Sequence[torch.Tensor],
        teacher_states: Sequence[torch.Tensor],
        student_weights: torch.Tensor,
        teacher_weights: torch.Tensor,
        spans: SpanBatch,
        span_scope_mask: torch.Tensor,
        student_head: Head | None = None,
        teacher_head: Head | None = None,
        shared_vocab: tuple[torch.Tensor, torch.Tensor] | None = None,
        num_sequences: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """The SRA terms for one batch.

        student_states: one ``[batch, seq_s, d_student]`` per pair; teacher_states: one
        ``[batch, seq_t, d_teacher]`` per pair (detached here). student_weights ``[batch, seq_s]``,
        teacher_weights ``[batch, seq_t]``: token weights >= 0 (e.g. :func:`last_token_attention`).
        spans: the aligned spans; span_scope_mask ``[batch, spans]`` bool: the spans that count
        (e.g. the response's). student_head / teacher_head: ``head(hidden [n, d], ids [k])`` -> that
        side's logits ``[n, k]`` at those vocabulary ids (:data:`Head`); shared_vocab:
        ``(student_ids [k], teacher_ids [k])`` from :func:`shared_vocabulary`, or None to switch the
        logit term off. num_sequences: the global batch's sequences: each term's per-sequence
        values summed over it (micro batches add up to the global batch's mean) instead of
        averaged over this batch's contributing sequences.
        Returns fp32 scalars ``{"sra_span", "sra_geometry", "sra_logit", "sra"}``.
        """
        if len(student_states) != self.num_pairs or len(teacher_states) != self.num_pairs:
            raise MtaError(
                f"SRA was built for {self.num_pairs} layer pairs but got {len(student_states)} student "
                f"and {len(teacher_states)} teacher hidden states"
            )
        in_scope = spans.mask.bool() & span_scope_mask.bool()  # [B, K]
        student_len, teacher_len = student_states[0].shape[1], teacher_states[0].shape[1]
        student_tokens = span_token_mask(spans.student_start, spans.student_end, student_len, in_scope)
        teacher_tokens = span_token_mask(spans.teacher_start, spans.teacher_end, teacher_len, in_scope)
        # One centre matrix per side for every pair; the teacher's span weights are its spans'
        # mass, the summed token weights (0 out of scope), [B, K].
        student_matrix, _ = centre_weights(student_tokens, student_weights)
        teacher_matrix, span_weights = centre_weights(teacher_tokens, teacher_weights)

        span_terms = []
        for index in range(self.num_pairs):  # over layer pairs (a handful), not spans
            student = torch.bmm(student_matrix, student_states[index].float())
            teacher = torch.bmm(teacher_matrix, teacher_states[index].detach().float())
            projected = apply_projector(projector_at(self.projectors, index), student)
            span_terms.append(_sequence_mean(1.0 - _cosine(projected, teacher), span_weights, num_sequences))
        span_loss = torch.stack(span_terms).mean()

        # Last pair, raw student centres (no projector): DSA normalises the weights itself and
        # excludes the diagonal; sequences with fewer than two spans in scope add nothing.
        geometry = dynamic_structural_alignment(student, teacher, span_weights, in_scope, num_sequences=num_sequences)

        terms = {"sra_span": span_loss, "sra_geometry": geometry}
        total = span_loss + self.geometry_weight * geometry
        if shared_vocab is None:
            terms["sra_logit"] = torch.zeros((), dtype=torch.float32, device=span_loss.device)
        else:
            if student_head is None or teacher_head is None:
                raise MtaError("the SRA logit term needs both the student's and the teacher's head")
            logit = self._span_logit_kl(
                student,
                teacher,
                student_states[-1].dtype,
                teacher_states[-1].dtype,
                span_weights,
                in_scope,
                student_head,
                teacher_head,
                shared_vocab,
                num_sequences,
            )
            terms["sra_logit"] = logit
            total = total + self.logit_weight * logit
        terms["sra"] = total
        return terms

    def _span_logit_kl(
        self,
        student: torch.Tensor,
        teacher: torch.Tensor,
        student_dtype: torch.dtype,
        teacher_dtype: torch.dtype,
        span_weights: torch.Tensor,
        in_scope: torch.Tensor,
        student_head: Head,
        teacher_head: Head,
        shared_vocab: tuple[torch.Tensor, torch.Tensor],
        num_sequences: float | None = None,
    ) -> torch.Tensor:
        """Weighted ``KL(teacher ‖ student)`` over the shared vocabulary, on in-scope spans only.

        student ``[B, K, d_s]``, teacher ``[B, K, d_t]`` centres; each head sees its side's hidden dtype.
        """
        student_ids, teacher_ids = (ids.to(student.device) for ids in shared_vocab)
        if student_ids.numel() == 0 or student_ids.shape != teacher_ids.shape:
            raise MtaError(
                f"the shared vocabulary must be two equally long, non-empty id lists; got "
                f"{tuple(student_ids.shape)} and {tuple(teacher_ids.shape)}"
            )
        rows = in_scope  # the LM heads run on the spans in scope only: [n, d]
        temperature = self.temperature

        def chunk_kl(student_rows: torch.Tensor, teacher_rows: torch.Tensor) -> torch.Tensor:
            """``[c, d_s]``, ``[c, d_t]`` centres -> ``[c]`` KL over the shared vocabulary."""
            student_logits = student_head(student_rows, student_ids).float()
            with torch.no_grad():
                teacher_logits = teacher_head(teacher_rows, teacher_ids).float()
            return kl(
                (teacher_logits / temperature).log_softmax(dim=1),  # [c, k]
                (student_logits / temperature).log_softmax(dim=1),
            )

        # chunk_size centres at a time, each chunk's logits recomputed in backward (not kept); None:
        # one application, also over no span, so that every process gathers a partitioned head once.
        student_rows, teacher_rows = student[rows].to(student_dtype), teacher[rows].to(teacher_dtype)
        if self.chunk_size is None:
            pieces: Iterable[tuple[torch.Tensor, torch.Tensor]] = [(student_rows, teacher_rows)]
        else:
            pieces = zip(student_rows.split(self.chunk_size), teacher_rows.split(self.chunk_size), strict=True)
        per_chunk = [
            checkpoint(chunk_kl, s, t, use_reentrant=False) if torch.is_grad_enabled() else chunk_kl(s, t)
            for s, t in pieces
        ]
        per_row = torch.cat(per_chunk) if per_chunk else student.new_zeros(0)  # [n]
        per_span = torch.zeros_like(span_weights).masked_scatter(rows, per_row)
        return _sequence_mean(per_span, span_weights, num_sequences)
