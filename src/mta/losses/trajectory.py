"""The MTA loss module: DSA and HRA over the aligned layer pairs, with one projector per pair.

docs/method.md §2–4. Lower pairs align word spans, higher pairs phrase spans. Importance is computed
once per (model, layer) and span masks once per granularity, then shared by DSA and HRA.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

import torch
from torch import nn

from mta.errors import MtaError
from mta.losses.dsa import PairWeights, Reduction, dynamic_structural_alignment
from mta.losses.hra import hidden_representation_alignment
from mta.losses.importance import IMPORTANCE, ImportanceMode, token_importance
from mta.losses.pooling import pool_spans
from mta.losses.span_masks import SpanBatch

# The HF ``output_hidden_states`` tuple, or only the layers the loss uses as {index: tensor}.
HiddenStates = Sequence[torch.Tensor] | Mapping[int, torch.Tensor]


class LayerPairLike(Protocol):
    """A ``mta.training.config.schema.LayerPair`` or anything shaped like it (read-only: the
    schema's models are frozen)."""

    @property
    def student(self) -> int: ...

    @property
    def teacher(self) -> int: ...

    @property
    def granularity(self) -> str: ...


class TrajectoryAlignmentLoss(nn.Module):
    """DSA and HRA averaged over aligned (student layer, teacher layer, granularity) pairs.

    Layers are ``hidden_states`` indices (0 = embeddings). ``same_tokenizer`` selects
    token-level HRA over the union of the layer's span tokens (weights: teacher importance);
    otherwise HRA compares span representations, each model pooling its own tokens (weights:
    span salience). DSA is the same in both cases. ``self.projectors[i]`` maps the student
    width to the teacher width for pair i; give them their own learning rate.

    ``terms`` names the terms to compute (``"dsa"``, ``"hra"`` or both): a term not asked for
    is never computed, and without HRA no projector exists.

    ``reference_code`` (``loss.reference_code``) computes what the authors' ``span_utils.py``
    computes instead of the formulas (docs/method.md §8): importance averaged over every row of
    the padded batch, padding rows included; DSA one weighted mean over all the batch's pairs;
    token-level HRA counting a token once per span it lies in. With ``importance="uniform"`` it
    is their uniform-weights ablation (``ablation_span_finetune.py``): pooling keeps the
    importance weights, DSA averages the pairs and HRA the token-span memberships of the batch
    unweighted.
    """

    def __init__(
        self,
        layer_pairs: Sequence[LayerPairLike],
        student_hidden_size: int,
        teacher_hidden_size: int,
        *,
        same_tokenizer: bool,
        importance: ImportanceMode = "attention",
        terms: Collection[str] = ("dsa", "hra"),
        reference_code: bool = False,
    ) -> None:
        super().__init__()
        unknown = set(terms) - {"dsa", "hra"}
        if unknown or not terms:
            raise MtaError(f"alignment terms must be a non-empty subset of dsa, hra; got {sorted(terms)}")
        if not layer_pairs:
            raise MtaError("the alignment loss needs at least one (student, teacher, granularity) layer pair")
        for pair in layer_pairs:
            if pair.granularity not in ("word", "phrase"):
                raise MtaError(
                    f"layer pair {pair.student}->{pair.teacher}: granularity "
                    f"'{pair.granularity}' is not one of 'word', 'phrase'"
                )
        if importance not in IMPORTANCE:
            raise MtaError(f"importance '{importance}' is not one of {', '.join(IMPORTANCE)}")
        self.layer_pairs = [(p.student, p.teacher, p.granularity) for p in layer_pairs]
        self.same_tokenizer = same_tokenizer
        self.importance_mode = importance
        self.reference_code = reference_code
        # The authors' uniform ablation pools with the importance weights all the same.
        self._importance = (
            functools.partial(token_importance, padding_queries=True) if reference_code else IMPORTANCE[importance]
        )
        uniform = reference_code and importance == "uniform"
        # DSA: the authors' one weighted mean over the batch's pairs, or the per-sequence formula.
        self._dsa_reduction: Reduction = "batch" if reference_code else "sequence"
        self._dsa_pair_weights: PairWeights = "uniform" if uniform else "salience"
        self._uniform_items = uniform  # HRA: every membership weighs 1, one mean over the batch
        self.terms = tuple(term for term in ("dsa", "hra") if term in terms)
        self.projectors = (
            nn.ModuleList(nn.Linear(student_hidden_size, teacher_hidden_size) for _ in self.layer_pairs)
            if "hra" in self.terms
            else None
        )

    @property
    def student_layers(self) -> list[int]:
        """The student ``hidden_states`` indices the loss reads (ask the model for these only)."""
        return sorted({student for student, _, _ in self.layer_pairs})

    @property
    def teacher_layers(self) -> list[int]:
        """The teacher ``hidden_states`` indices the loss reads."""
        return sorted({teacher for _, teacher, _ in self.layer_pairs})

    @property
    def granularities(self) -> list[str]:
        """The span granularities the batch must provide in ``spans``."""
        return sorted({granularity for _, _, granularity in self.layer_pairs})

    def forward(
        self,
        student_hidden_states: HiddenStates,
        teacher_hidden_states: HiddenStates,
        student_attention_mask: torch.Tensor,
        teacher_attention_mask: torch.Tensor,
        spans: Mapping[str, SpanBatch],
        num_sequences: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """Layer-mean DSA and HRA for one batch.

        student_hidden_states: indexable by layer, each ``[batch, seq_s, d_student]``.
        teacher_hidden_states: indexable by layer, each ``[batch, seq_t, d_teacher]``.
        student_attention_mask ``[batch, seq_s]``, teacher_attention_mask ``[batch, seq_t]``.
        spans: ``{"word": SpanBatch, "phrase": SpanBatch}`` (the granularities in use).
        num_sequences: the sequences of the whole global batch: each term is then the sum of its
        per-sequence values over this count (micro batches add up to the global batch's mean)
        instead of the mean over this batch's contributing sequences. Not with ``reference_code``
        (the authors' one pool per micro batch).
        Returns ``{"dsa": scalar, "hra": scalar}`` in fp32 (the terms asked for).
        """
        if num_sequences is not None and self.reference_code:
            raise MtaError(
                "reference_code pools DSA and HRA over each micro batch as the authors' code does; it has no "
                "global-batch form: use train.loss_reduction=micro_batch (or no num_sequences)"
            )
        student_len = student_attention_mask.shape[1]
        teacher_len = teacher_attention_mask.shape[1]
        if self.same_tokenizer and student_len != teacher_len:
            raise MtaError(
                f"same_tokenizer is set but the student sees {student_len} tokens and the teacher "
                f"{teacher_len}; the batches must be built from the same ids"
            )
        # Spans are pooled for DSA, and for HRA across tokenizers; token-level HRA needs none.
        pooled = "dsa" in self.terms or not self.same_tokenizer
        student_masks, teacher_masks, span_tokens = self._span_masks(spans, student_len, teacher_len, pooled)

        student_weights = {
            layer: self._importance(_layer(student_hidden_states, layer, "student"), student_attention_mask)
            for layer in (self.student_layers if pooled else ())
        }
        teacher_weights = {
            layer: self._importance(_layer(teacher_hidden_states, layer, "teacher"), teacher_attention_mask)
            for layer in self.teacher_layers
        }

        terms: dict[str, list[torch.Tensor]] = {term: [] for term in self.terms}
        for index, (student_layer, teacher_layer, granularity) in enumerate(self.layer_pairs):
            student_hidden = _layer(student_hidden_states, student_layer, "student")
            teacher_hidden = _layer(teacher_hidden_states, teacher_layer, "teacher").detach()
            span_mask = spans[granularity].mask
            if pooled:
                student_spans, _ = pool_spans(
                    student_hidden, student_weights[student_layer], student_masks[granularity]
                )
                teacher_spans, salience = pool_spans(
                    teacher_hidden, teacher_weights[teacher_layer], teacher_masks[granularity]
                )
            if "dsa" in terms:
                terms["dsa"].append(
                    dynamic_structural_alignment(
                        student_spans,
                        teacher_spans,
                        salience,
                        span_mask,
                        reduction=self._dsa_reduction,
                        pair_weights=self._dsa_pair_weights,
                        num_sequences=num_sequences,
                    )
                )
            if "hra" in terms and self.same_tokenizer:
                terms["hra"].append(
                    self._hra(
                        apply_projector(self._projector(index), student_hidden),
                        teacher_hidden,
                        teacher_weights[teacher_layer],
                        span_tokens[granularity],
                        num_sequences,
                    )
                )
            elif "hra" in terms:
                terms["hra"].append(
                    self._hra(
                        apply_projector(self._projector(index), student_spans),
                        teacher_spans,
                        salience,
                        span_mask,
                        num_sequences,
                    )
                )
        return {term: torch.stack(values).mean() for term, values in terms.items()}

    def _span_masks(
        self, spans: Mapping[str, SpanBatch], student_len: int, teacher_len: int, pooled: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per granularity, built once and shared by every pair: the student's and the teacher's
        ``[B, K, T]`` 0/1 float span masks (when spans are pooled), and token-level HRA's span
        tokens ``[B, T_t]`` (same tokenizer)."""
        student_masks, teacher_masks, span_tokens = {}, {}, {}
        for granularity in self.granularities:
            if granularity not in spans:
                raise MtaError(f"the batch has no '{granularity}' spans (it has {sorted(spans)})")
            if pooled:
                teacher_masks[granularity] = spans[granularity].teacher_token_mask(teacher_len).float()
                student_masks[granularity] = spans[granularity].student_token_mask(student_len).float()
            if self.same_tokenizer and "hra" in self.terms:
                span_tokens[granularity] = (
                    spans[granularity].teacher_token_count(teacher_len)
                    if self.reference_code
                    else spans[granularity].teacher_token_union(teacher_len)
                )
        return student_masks, teacher_masks, span_tokens

    def _projector(self, index: int) -> nn.Linear:
        """Pair ``index``'s projector (HRA only: without it none was built)."""
        if self.projectors is None:
            raise MtaError("this alignment loss was built without 'hra', so it has no projectors")
        return projector_at(self.projectors, index)

    def _hra(
        self,
        projected: torch.Tensor,
        teacher: torch.Tensor,
        weights: torch.Tensor,
        members: torch.Tensor,
        num_sequences: float | None = None,
    ) -> torch.Tensor:
        """HRA over items (tokens or spans); members: ``[batch, items]`` bool, or with
        ``reference_code`` on tokens the int count of spans each token lies in (each membership
        counts once, as the authors' ``All_Indices`` does)."""
        if not self.reference_code:
            return hidden_representation_alignment(projected, teacher, weights, members, num_sequences=num_sequences)
        count = members.float()
        if self._uniform_items:  # every membership with a positive weight weighs 1
            weights = count * (weights > 0)
        else:
            weights = weights.float() * count
        return hidden_representation_alignment(
            projected, teacher, weights, members > 0, reduction="batch" if self._uniform_items else "sequence"
        )


def _layer(hidden_states: HiddenStates, index: int, side: str) -> torch.Tensor:
    try:
        return hidden_states[index]
    except (IndexError, KeyError) as error:
        available = sorted(hidden_states) if isinstance(hidden_states, Mapping) else f"0..{len(hidden_states) - 1}"
        raise MtaError(
            f"aligned layer {index} is not among the {side}'s hidden states ({available}); "
            f"fix loss.layers in the recipe"
        ) from error


def projector_at(projectors: nn.ModuleList, index: int) -> nn.Linear:
    """``projectors[index]``, checked to be the ``nn.Linear`` every projector is built as."""
    projector = projectors[index]
    if not isinstance(projector, nn.Linear):
        raise MtaError(f"projector {index} is a {type(projector).__name__}, not an nn.Linear")
    return projector


def apply_projector(projector: nn.Linear, states: torch.Tensor) -> torch.Tensor:
    """Apply a projector in its own dtype (the engine may hold it in bf16); result in fp32."""
    return projector(states.to(projector.weight.dtype)).float()
