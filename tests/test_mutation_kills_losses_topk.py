"""Edges of the teacher's top k (mta.losses.teacher_topk) and of the shared divergences
(mta.losses.divergences) that mutation testing (bench/mutation.py) found unchecked.

The default temperature of 1 of both ends of the cache, more positions than one fp32 chunk, a k
at or above the vocabulary, no position at all, the fp32 of the tail fill whatever the stored
dtype, and the per-row KL and log-mixture at their ends. Every expected value comes from python
floats and loops over the tail rule of the module docstring (docs/teacher-cache.md), not from the
code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from fixtures.losses import softmax
from mta.losses.divergences import kl, log_mixture
from mta.losses.teacher_topk import (
    CHUNK_POSITIONS,
    LOG_FLOOR,
    dense_log_probs,
    tail_fill,
    teacher_logits_from_top_k,
    top_k_log_probs,
)

# ---------------------------------------------------------------- python-float reference


def top_k_by_hand(row: list[float], k: int, tau: float = 1.0) -> tuple[list[int], list[float], float]:
    """ids (most probable first), their log-probabilities and log of the rest's mass."""
    p = softmax(row, tau)
    ids = sorted(range(len(p)), key=lambda j: -p[j])[:k]
    rest = sum(p[j] for j in range(len(p)) if j not in ids)
    return ids, [math.log(p[j]) for j in ids], math.log(rest) if rest > 0 else LOG_FLOOR


def logits_of(seed: int, rows: int, vocab: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * scale


def assert_top_k_is_by_hand(logits: torch.Tensor, k: int, tau: float, got) -> None:
    ids, log_probs, tail = got
    for row, (want_ids, want_log_probs, want_tail) in enumerate(top_k_by_hand(r, k, tau) for r in logits.tolist()):
        assert ids[row].tolist() == want_ids, row
        assert log_probs[row].tolist() == pytest.approx(want_log_probs, rel=1e-5, abs=1e-5), row
        assert tail[row].item() == pytest.approx(want_tail, rel=1e-5, abs=1e-5), row


# ---------------------------------------------------------------- top_k_log_probs


def test_the_top_k_is_taken_at_temperature_1_by_default():
    logits = logits_of(60, 4, 9)
    assert_top_k_is_by_hand(logits, 3, 1.0, top_k_log_probs(logits, 3))


def test_positions_beyond_one_chunk_are_all_compressed():
    """More positions than one fp32 chunk holds (and more than the vocabulary has entries):
    every one of them comes back, each its own top k."""
    rows = CHUNK_POSITIONS + 9
    logits = logits_of(61, rows, 5)
    ids, log_probs, tail = top_k_log_probs(logits, 2, temperature=1.5)
    assert ids.shape == log_probs.shape == (rows, 2) and tail.shape == (rows,)
    sample = [0, CHUNK_POSITIONS - 1, CHUNK_POSITIONS, rows - 1]
    assert_top_k_is_by_hand(logits[sample], 2, 1.5, (ids[sample], log_probs[sample], tail[sample]))


@pytest.mark.parametrize("k", [4, 6])
def test_a_k_at_or_above_the_vocabulary_keeps_every_token_and_an_empty_tail(k):
    """k is capped at the vocabulary (the first vocab_size columns): all tokens are kept, most
    probable first, and the tail holds no mass (LOG_FLOOR)."""
    logits = logits_of(62, 3, 6)
    ids, log_probs, tail = top_k_log_probs(logits, k, vocab_size=4)
    assert ids.shape == (3, 4)
    assert_top_k_is_by_hand(logits[:, :4], 4, 1.0, (ids, log_probs, tail))
    assert tail.tolist() == [LOG_FLOOR] * 3


@pytest.mark.parametrize(("k", "vocab"), [(1, 5), (3, 5), (7, 5)])
def test_no_positions_give_empty_results_of_the_documented_shapes_and_dtypes(k, vocab):
    ids, log_probs, tail = top_k_log_probs(torch.zeros(0, vocab, dtype=torch.bfloat16), k)
    width = min(k, vocab)
    assert ids.shape == (0, width) and ids.dtype == torch.int64
    assert log_probs.shape == (0, width) and log_probs.dtype == torch.float32
    assert tail.shape == (0,) and tail.dtype == torch.float32


# ---------------------------------------------------------------- the rebuilt teacher


def test_rebuilt_logits_are_the_log_tail_rule_at_temperature_1_by_default():
    """Without a temperature the logits are log p̃ itself: the top k at their log-probabilities,
    every other token at log(tail mass / (V − k))."""
    logits = logits_of(63, 3, 7)
    ids, log_probs, tail = top_k_log_probs(logits, 2)
    got = teacher_logits_from_top_k(ids, log_probs, tail, 7)
    for row, values in enumerate(logits.tolist()):
        p = softmax(values)
        kept = sorted(range(7), key=lambda j: -p[j])[:2]
        rest = (1.0 - sum(p[j] for j in kept)) / 5
        expected = [math.log(p[j]) if j in kept else math.log(rest) for j in range(7)]
        assert got[row].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_tail_fill_is_fp32_whatever_the_stored_dtype(dtype):
    tail = torch.tensor([-0.5, -2.0], dtype=dtype)
    full = tail_fill(tail, 4, 4)
    assert full.dtype == torch.float32 and full.tolist() == [LOG_FLOOR, LOG_FLOOR]
    spread = tail_fill(tail, 2, 6)
    assert spread.dtype == torch.float32
    assert spread.tolist() == pytest.approx([-0.5 - math.log(4), -2.0 - math.log(4)], rel=1e-6)
    dense = dense_log_probs(torch.tensor([[2], [0]]), torch.tensor([[-0.125], [-0.25]], dtype=dtype), tail, 3)
    fill = [-0.5 - math.log(2), -2.0 - math.log(2)]
    assert dense.dtype == torch.float32
    assert dense.tolist() == [pytest.approx([fill[0], fill[0], -0.125]), pytest.approx([-0.25, fill[1], fill[1]])]


# ---------------------------------------------------------------- divergences


def test_kl_is_one_value_per_row_over_the_vocabulary():
    """[n, vocab] -> [n]: each row's Σ p (log p − log q), with rows and vocabulary of different
    sizes so that no other reduction fits."""
    generator = torch.Generator().manual_seed(64)
    log_p = torch.randn(3, 5, generator=generator).log_softmax(dim=1)
    log_q = torch.randn(3, 5, generator=generator).log_softmax(dim=1)
    got = kl(log_p, log_q)
    expected = [
        sum(math.exp(a) * (a - b) for a, b in zip(pr, qr, strict=True))
        for pr, qr in zip(log_p.tolist(), log_q.tolist(), strict=True)
    ]
    assert got.shape == (3,)
    assert got.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_a_mixture_with_a_zero_weight_is_the_other_side_exactly(weight):
    """A weight of 0 has log −∞: the mixture is the other distribution, finite, not NaN."""
    a, b = [0.2, 0.8], [0.6, 0.4]
    got = log_mixture(torch.tensor(a).log(), torch.tensor(b).log(), weight)
    assert got.exp().tolist() == pytest.approx(a if weight == 1.0 else b, rel=1e-6)
