"""The teacher's top k and the tail rule (mta.losses.teacher_topk): at k = V the rebuilt teacher
is the teacher for every base loss, in value and gradient; below it, every base loss on the
rebuilt teacher equals the same loss on a distribution built by plain loops from the full logits
(top k kept, the rest of the mass spread evenly), and forward / reverse KL equal their formulas."""

from __future__ import annotations

import math

import pytest
import torch

from mta.losses.kd import BASE_LOSSES, build_base_loss
from mta.losses.teacher_topk import LOG_FLOOR, dense_log_probs, teacher_logits_from_top_k, top_k_log_probs

VOCAB = 11
TEACHER_LOSSES = [name for name in BASE_LOSSES if name != "ce"]


def plain_tail_rule(logits: list[float], k: int, temperature: float) -> list[float]:
    """p̃ of one position by hand: softmax at τ, the k largest kept, the rest of the mass evenly."""
    scaled = [value / temperature for value in logits]
    top = max(scaled)
    weights = [math.exp(value - top) for value in scaled]
    total = sum(weights)
    p = [weight / total for weight in weights]
    kept = sorted(range(len(p)), key=lambda j: -p[j])[:k]
    rest = 1.0 - sum(p[j] for j in kept)
    others = len(p) - k
    return [p[j] if j in kept else rest / others for j in range(len(p))]


def batch(seed: int = 0, rows: int = 3, seq: int = 6):
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, seq, VOCAB, generator=generator) * 2
    teacher = torch.randn(rows, seq, VOCAB, generator=generator) * 3
    labels = torch.randint(0, VOCAB, (rows, seq), generator=generator)
    labels[0, :2] = -100
    labels[2, -1] = -100
    chosen = torch.tensor([True, False, True])
    return student, teacher, labels, chosen


def loss_of(name: str, student: torch.Tensor, teacher: torch.Tensor, labels, chosen, temperature: float):
    loss = build_base_loss(name, temperature=temperature, vocab_size=VOCAB, chunk_size=4)
    extra = {"chosen": chosen} if name == "distillm2" else {}
    return loss(student, teacher, labels, **extra)


def rebuilt(teacher: torch.Tensor, k: int, temperature: float) -> torch.Tensor:
    flat = teacher.reshape(-1, VOCAB)
    ids, log_probs, tail = top_k_log_probs(flat, k, temperature=temperature)
    return teacher_logits_from_top_k(ids, log_probs, tail, VOCAB, temperature).reshape(teacher.shape)


@pytest.mark.parametrize("name", TEACHER_LOSSES)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_at_full_k_every_base_loss_equals_the_online_teacher_in_value_and_gradient(name, temperature):
    student, teacher, labels, chosen = batch()
    online = student.clone().requires_grad_(True)
    cached = student.clone().requires_grad_(True)
    value = loss_of(name, online, teacher, labels, chosen, temperature)
    value_cached = loss_of(name, cached, rebuilt(teacher, VOCAB, temperature), labels, chosen, temperature)
    value.backward()
    value_cached.backward()
    torch.testing.assert_close(value_cached, value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cached.grad, online.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_the_rebuilt_distribution_is_the_tail_rule_by_hand(k, temperature):
    _, teacher, _, _ = batch(seed=1)
    flat = teacher.reshape(-1, VOCAB)
    ids, log_probs, tail = top_k_log_probs(flat, k, temperature=temperature)
    dense = dense_log_probs(ids, log_probs, tail, VOCAB)
    expected = torch.tensor([plain_tail_rule(row, k, temperature) for row in flat.tolist()])
    torch.testing.assert_close(dense.exp(), expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dense.exp().sum(-1), torch.ones(len(flat)), rtol=1e-5, atol=1e-6)
    assert all(len(set(row)) == k for row in ids.tolist())  # k distinct tokens, most probable first
    assert (log_probs[:, :-1] >= log_probs[:, 1:]).all()


@pytest.mark.parametrize("name", TEACHER_LOSSES)
@pytest.mark.parametrize("k", [2, 5])
def test_below_full_k_every_base_loss_reads_the_tail_rule(name, k):
    temperature = 1.5
    student, teacher, labels, chosen = batch(seed=2)
    plain = torch.tensor([plain_tail_rule(row, k, temperature) for row in teacher.reshape(-1, VOCAB).tolist()])
    by_hand = (plain.log() * temperature).reshape(teacher.shape)
    expected = loss_of(name, student, by_hand, labels, chosen, temperature)
    got = loss_of(name, student, rebuilt(teacher, k, temperature), labels, chosen, temperature)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, loss_of(name, student, teacher, labels, chosen, temperature), atol=1e-4)


def test_forward_and_reverse_kl_on_the_top_k_are_their_formulas():
    k, temperature = 3, 1.0
    student, teacher, labels, chosen = batch(seed=3)
    got = {}
    for name in ("fkl", "rkl"):
        got[name] = loss_of(name, student, rebuilt(teacher, k, temperature), labels, chosen, temperature).item()
    sums, count = {"fkl": 0.0, "rkl": 0.0}, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if labels[b, t] == -100:
                continue
            p = plain_tail_rule(teacher[b, t].tolist(), k, temperature)
            q = plain_tail_rule(student[b, t].tolist(), VOCAB, temperature)  # the student's own softmax
            sums["fkl"] += sum(pj * math.log(pj / qj) for pj, qj in zip(p, q, strict=True))
            sums["rkl"] += sum(qj * math.log(qj / pj) for pj, qj in zip(p, q, strict=True))
            count += 1
    for name in ("fkl", "rkl"):
        assert got[name] == pytest.approx(sums[name] / count, rel=1e-5)


def test_an_empty_tail_and_a_vanishing_probability_stay_finite():
    logits = torch.tensor([[0.0, -1.0e5, 3.0, 1.0]])
    ids, log_probs, tail = top_k_log_probs(logits, 4)
    assert tail.item() == LOG_FLOOR and log_probs.min().item() == LOG_FLOOR
    student = torch.zeros(1, 1, 4, requires_grad=True)
    teacher = teacher_logits_from_top_k(ids, log_probs, tail, 4).reshape(1, 1, 4)
    for name in ("fkl", "rkl", "jsd"):
        value = build_base_loss(name, vocab_size=4)(student, teacher, torch.tensor([[2]]))
        value.backward()
        assert torch.isfinite(value) and torch.isfinite(student.grad).all()
