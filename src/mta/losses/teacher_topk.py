"""The teacher's next-token distribution kept as its top k, and the distribution rebuilt from it.

``mta teacher`` stores, per response position, the k most probable tokens of the teacher's
distribution at the loss temperature τ, ``p_τ = softmax(z / τ)``, with their log-probabilities,
and the exact log of the mass of all the other tokens (the tail), ``log Σ_{j ∉ top k} p_τ(j)``.

**The tail rule** (docs/teacher-cache.md): the rebuilt distribution p̃ keeps the top k exactly
and spreads the tail mass uniformly over the other ``V − k`` tokens. p̃ is a proper distribution
(it sums to 1), so every base loss reads it as it reads the teacher's own: forward and reverse
KL, their skewed forms, JSD, TVD and DistiLLM-2's two terms are the same functions of p̃ that
they are of p. With ``k = V`` (or a tail that underflows) p̃ = p. Where they differ, on the
tail: a tail token's p̃ is the tail's mean, so forward KL's tail terms weigh the student's log q
there by that mean, and reverse KL and the skewed KLs judge the student's mass on a tail token
against it (a token the teacher all but excludes looks likelier than it is when k is small).

The rebuilt distribution is handed to the losses as logits ``τ · log p̃``, whose softmax at τ is
p̃: the losses need no cached variant. A log-probability below ``LOG_FLOOR`` is stored at the
floor (``exp`` of it is 0 in fp32), so an empty tail never yields ``0 · −inf``.
"""

from __future__ import annotations

import math

import torch

LOG_FLOOR = -1.0e4
CHUNK_POSITIONS = 256  # positions per fp32 [chunk, vocab] softmax when compressing


@torch.no_grad()
def top_k_log_probs(
    logits: torch.Tensor, k: int, *, temperature: float = 1.0, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top ``k`` of ``softmax(logits / temperature)`` over the first ``vocab_size`` entries.

    logits: ``[n, V']`` teacher logits at n positions (any float dtype; only ``[:, :vocab_size]``
    count). Returns ``ids [n, k]`` int64 (most probable first), ``log_probs [n, k]`` fp32 and
    ``tail [n]`` fp32, the log of the mass outside the top k (``LOG_FLOOR`` when there is none).
    Computed ``CHUNK_POSITIONS`` positions at a time in fp32.
    """
    vocab = vocab_size or logits.shape[1]
    k = min(k, vocab)
    ids, values, tails = [], [], []
    for begin in range(0, logits.shape[0], CHUNK_POSITIONS):
        # [chunk, vocab] fp32: dim 1 is the vocabulary (topk's default, the last dim, is that too).
        log_p = (logits[begin : begin + CHUNK_POSITIONS, :vocab].float() / temperature).log_softmax(dim=1)
        top_values, top_ids = log_p.topk(k)
        # With k = vocab every entry is masked out: logsumexp gives −inf, clamped to LOG_FLOOR.
        rest = log_p.scatter(1, top_ids, -math.inf).logsumexp(dim=1)
        ids.append(top_ids)
        values.append(top_values.clamp(min=LOG_FLOOR))
        tails.append(rest.clamp(min=LOG_FLOOR))
    if not ids:
        empty = logits.new_zeros((0, k))
        return empty.long(), empty.float(), empty[:, 0].float()
    return torch.cat(ids), torch.cat(values), torch.cat(tails)


def dense_log_probs(ids: torch.Tensor, log_probs: torch.Tensor, tail: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """p̃ of the tail rule: ``ids, log_probs [n, k]``, ``tail [n]`` -> ``log p̃ [n, vocab_size]`` fp32,
    the top k at their stored values and every other token at ``tail − log(V − k)``."""
    n, k = ids.shape
    dense = tail_fill(tail, k, vocab_size).unsqueeze(1).expand(n, vocab_size).clone()
    return dense.scatter_(1, ids.long(), log_probs.float())


def tail_fill(tail: torch.Tensor, k: int, vocab_size: int) -> torch.Tensor:
    """``log p̃`` of each tail token: ``tail [n]`` -> ``[n]`` fp32, ``tail − log(V − k)``
    (``LOG_FLOOR`` when the top k is the whole vocabulary)."""
    if k >= vocab_size:
        return torch.full_like(tail, LOG_FLOOR, dtype=torch.float32)
    return (tail.float() - math.log(vocab_size - k)).clamp(min=LOG_FLOOR)


def teacher_logits_from_top_k(
    ids: torch.Tensor, log_probs: torch.Tensor, tail: torch.Tensor, vocab_size: int, temperature: float = 1.0
) -> torch.Tensor:
    """Logits whose softmax at ``temperature`` is p̃ (:func:`dense_log_probs`): what the base
    losses read in place of the teacher's. ``[n, k]``, ``[n]`` -> ``[n, vocab_size]`` fp32."""
    return dense_log_probs(ids, log_probs, tail, vocab_size) * temperature


__all__ = ["LOG_FLOOR", "dense_log_probs", "tail_fill", "teacher_logits_from_top_k", "top_k_log_probs"]
