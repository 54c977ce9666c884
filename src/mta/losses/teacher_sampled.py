"""The teacher's next-token distribution kept as a head and a few tokens sampled from the rest
(Sparse Logit Sampling, Anshumann et al., ACL 2025, with a head), and the base losses read from it.

With a base loss ``Σ_v f(p_v, q_v)`` (``DistributionLoss.terms``), the head's k tokens, the tail
mass ``P_T`` and ``c_v`` the count of v among N draws from the tail, ::

    L̂ = Σ_{v ∈ head} f(p_v, q_v) + Σ_{v drawn} (c_v / N) · (P_T / p_v) · f(p_v, q_v)

is unbiased, its gradient in the student's logits too; forward KL and skew forward KL read it.
The losses the student's q weighs (reverse KLs, JSD, TVD) read the biased *rest rule* instead
(:meth:`SampledTeacher.dense_log_probs`): a finite N misses most of their loss (docs/teacher-cache.md).
:class:`SampledTeacher` holds, per position, ids, teacher log-probs and weights (1 on the head,
``c_v / N · P_T / p_v`` on a draw, 0 on padding) and stands in for ``[batch, seq, vocab]`` logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mta.losses.teacher_topk import CHUNK_POSITIONS, LOG_FLOOR

SAMPLE_CHUNK_POSITIONS = 32  # positions per fp64 [chunk, vocab] cumulative sum when drawing
MAX_SAMPLES = 255  # draws per position: counts fit one byte

# (teacher log p [n, m], student log q [n, m]) -> [n, m] per-token terms of a divergence
TermsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TailSamples:
    """What the cache stores for n positions: ``head_ids, head_log_probs [n, k]`` (int64, fp32),
    ``tail [n]`` fp32 (``log P_T``, ``LOG_FLOOR`` when the head is everything), ``distinct [n]``
    int64 (distinct drawn ids per position), and, position after position, ``ids, counts,
    log_probs [Σ distinct]`` (int64, int64, fp32), ids ascending within a position. ``samples``: N.
    ``rest_log_mean [n]`` fp32: the mean of ``log p`` over the tokens neither in the head nor
    drawn (None: not stored; the rest rule then fills by mass)."""

    head_ids: torch.Tensor
    head_log_probs: torch.Tensor
    tail: torch.Tensor
    distinct: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor
    log_probs: torch.Tensor
    samples: int
    rest_log_mean: torch.Tensor | None = None


@torch.no_grad()
def draw_tail_samples(
    logits: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    top_k: int,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> TailSamples:
    """The head and N draws from the rest of ``softmax(logits / temperature)`` at n positions.

    logits: ``[n, V']`` (only ``[:, :vocab_size]`` count); uniforms: ``[n, N]`` in [0, 1), the
    position's random numbers (:func:`mta.generation.sampling.keyed_uniforms`): draw j of a
    position is the token where the tail's cumulative mass (fp64, ids ascending) first exceeds
    ``uniforms[i, j] · P_T``, so the same uniforms and logits give the same tokens on any batch.
    A position whose tail has no mass (``top_k ≥ V``, or an underflow) keeps no draw.
    """
    vocab = vocab_size or logits.shape[1]
    k = min(top_k, vocab)
    n, samples = uniforms.shape
    if logits.shape[0] != n:
        raise ValueError(f"{logits.shape[0]} positions of logits and {n} of uniforms")
    heads, head_values, tails, distinct, ids, counts, values, log_means = [], [], [], [], [], [], [], []
    step = min(CHUNK_POSITIONS, SAMPLE_CHUNK_POSITIONS)
    for begin in range(0, n, step):
        # [chunk, vocab] fp32; dim 1 is the vocabulary.
        log_p = (logits[begin : begin + step, :vocab].float() / temperature).log_softmax(dim=1)
        rows = log_p.shape[0]
        top_values, top_ids = log_p.topk(k, dim=1)
        rest = log_p.scatter(1, top_ids, -math.inf)
        tail = rest.logsumexp(dim=1)
        cdf = rest.double().exp().cumsum(dim=1)  # [chunk, vocab] fp64: the tail's mass, ids ascending
        total = cdf[:, -1:]
        targets = uniforms[begin : begin + step].to(cdf.device, torch.float64) * total
        drawn = torch.searchsorted(cdf, targets, right=True).clamp_(max=vocab - 1)  # [chunk, N]
        has_tail = (total.squeeze(1) > 0) & (tail > LOG_FLOOR)
        keys = (torch.arange(rows, device=drawn.device).unsqueeze(1) * vocab + drawn)[has_tail].reshape(-1)
        unique, count = torch.unique(keys, sorted=True, return_counts=True)
        row, token = unique // vocab, unique % vocab
        heads.append(top_ids)
        head_values.append(top_values.clamp(min=LOG_FLOOR))
        tails.append(tail.clamp(min=LOG_FLOOR))
        distinct.append(torch.bincount(row, minlength=rows))
        ids.append(token)
        counts.append(count)
        values.append(log_p[row, token].clamp(min=LOG_FLOOR))
        # The mean log p over the tokens neither in the head nor drawn (fp64 sums).
        drawn_sum = torch.zeros(rows, dtype=torch.float64, device=log_p.device)
        drawn_sum.index_add_(0, row, log_p[row, token].double())
        others = vocab - k - distinct[-1]
        rest_sum = log_p.double().sum(dim=1) - top_values.double().sum(dim=1) - drawn_sum
        mean = (rest_sum / others.clamp(min=1)).float().clamp(min=LOG_FLOOR)
        log_means.append(torch.where(others > 0, mean, torch.full_like(mean, LOG_FLOOR)))
    if not heads:
        empty = logits.new_zeros((0, k), dtype=torch.float32)
        nothing = torch.zeros(0, dtype=torch.long, device=logits.device)
        return TailSamples(
            empty.long(), empty, empty[:, 0], nothing, nothing, nothing, empty[:, 0], samples, empty[:, 0]
        )
    return TailSamples(
        torch.cat(heads),
        torch.cat(head_values),
        torch.cat(tails),
        torch.cat(distinct),
        torch.cat(ids),
        torch.cat(counts),
        torch.cat(values),
        samples,
        torch.cat(log_means),
    )


@dataclass(frozen=True)
class SampledTeacher:
    """The estimator's entries in place of teacher logits ``[*lead, vocab_size]``: ``ids`` int64,
    ``log_probs`` fp32 (the teacher's ``log p`` at τ), ``weights`` fp32, each ``[*lead, m]``
    (m: the widest position's head + distinct draws; padding entries weigh 0). Indexing takes the
    leading dimensions of all three (``teacher[:, :-1]``, ``teacher[rows, columns]``)."""

    ids: torch.Tensor
    log_probs: torch.Tensor
    weights: torch.Tensor
    vocab_size: int
    rest: torch.Tensor  # [*lead] log p̃ of each token neither in the head nor drawn: the mass left, spread evenly
    rest_log_mean: torch.Tensor  # [*lead] the mean log p over those tokens

    @property
    def shape(self) -> torch.Size:
        """The shape of the logits it stands for: ``[*lead, vocab_size]``."""
        return torch.Size((*self.ids.shape[:-1], self.vocab_size))

    def dim(self) -> int:
        return self.ids.dim()

    def __getitem__(self, index: Any) -> SampledTeacher:
        return SampledTeacher(
            self.ids[index],
            self.log_probs[index],
            self.weights[index],
            self.vocab_size,
            self.rest[index],
            self.rest_log_mean[index],
        )

    def to(self, device: torch.device | str) -> SampledTeacher:
        return SampledTeacher(
            self.ids.to(device),
            self.log_probs.to(device),
            self.weights.to(device),
            self.vocab_size,
            self.rest.to(device),
            self.rest_log_mean.to(device),
        )

    def dense_log_probs(self, fill: str = "mass") -> torch.Tensor:
        """``[n, vocab_size]`` fp32 log p̃ of the rest rule (from ``[n, m]`` rows): the head and
        every drawn token at its stored log-probability, every other token at ``rest``, the mass
        the head and the draws leave spread evenly (the tail rule of :mod:`mta.losses.teacher_topk`
        with the draws kept exactly). ``fill="log_mean"``: every other token at the mean of their
        ``log p`` instead (not a distribution: what reverse-type losses read, whose terms weigh
        ``log p`` by the student's q at tokens the teacher all but excludes)."""
        n = self.ids.shape[0]
        value = self.rest if fill == "mass" else self.rest_log_mean
        dense = value.float().unsqueeze(1).expand(n, self.vocab_size).clone()
        row, column = (self.weights > 0).nonzero(as_tuple=True)
        dense[row, self.ids[row, column]] = self.log_probs[row, column].float()
        return dense

    @classmethod
    def from_samples(cls, stored: TailSamples, vocab_size: int) -> SampledTeacher:
        """``[n, m]`` entries of the n positions of ``stored``: the head (weight 1), then each
        distinct draw (weight ``c / N · P_T / p``), then padding (id 0, weight 0)."""
        n, k = stored.head_ids.shape
        distinct = stored.distinct.long()
        width = k + int(distinct.max()) if n and distinct.numel() else k
        ids = torch.zeros(n, width, dtype=torch.long)
        log_probs = torch.full((n, width), LOG_FLOOR)
        weights = torch.zeros(n, width)
        ids[:, :k] = stored.head_ids.long()
        log_probs[:, :k] = stored.head_log_probs.float()
        weights[:, :k] = 1.0
        if stored.ids.numel():
            position = torch.repeat_interleave(torch.arange(n), distinct)
            starts = distinct.cumsum(0) - distinct
            slot = k + torch.arange(stored.ids.numel()) - starts[position]
            values = stored.log_probs.float()
            ids[position, slot] = stored.ids.long()
            log_probs[position, slot] = values
            weights[position, slot] = (
                stored.counts.float() / stored.samples * (stored.tail.float()[position] - values).exp()
            )
        # The rest rule's fill: the tail's mass less the draws', over the tokens not kept.
        drawn_mass = torch.zeros(n, dtype=torch.float64)
        if stored.ids.numel():
            drawn_mass.index_add_(0, position, stored.log_probs.double().exp())
        left = (stored.tail.double().exp() - drawn_mass).clamp(min=0)
        others = (vocab_size - k - distinct).clamp(min=0)
        rest = (left.clamp(min=1e-300).log() - others.clamp(min=1).double().log()).float()
        rest = torch.where((others > 0) & (left > 0), rest.clamp(min=LOG_FLOOR), torch.full_like(rest, LOG_FLOOR))
        log_mean = rest if stored.rest_log_mean is None else stored.rest_log_mean.float()
        return cls(ids, log_probs, weights, vocab_size, rest, log_mean)


def sampled_estimate(terms: TermsFn, log_q: torch.Tensor, teacher: SampledTeacher) -> torch.Tensor:
    """``Σ_j weights[:, j] · terms(log p_j, log q_j)``: the unbiased estimate of ``Σ_v terms`` over
    the whole vocabulary (module docstring). ``log_q [n, vocab]`` the student's full
    log-probabilities at τ, ``teacher`` ``[n, m]`` entries -> ``[n]``."""
    gathered = log_q.gather(1, teacher.ids)
    return (terms(teacher.log_probs, gathered) * teacher.weights).sum(dim=1)


__all__ = ["MAX_SAMPLES", "SampledTeacher", "TailSamples", "TermsFn", "draw_tail_samples", "sampled_estimate"]
