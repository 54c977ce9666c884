"""The sampled teacher (mta.losses.teacher_sampled): the importance-weighted estimate of every
divergence from a head and N draws is unbiased, value and gradient, checked by averaging many
seeded draws against the exact loss on a tiny vocabulary (and the check is shown to catch a
biased estimator); forward-type losses read it, reverse-type ones the rest rule, whose bias is
measured below the top-k tail rule's; with the head the whole vocabulary it is the dense loss;
the draws depend on the row's key, not on the batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mta.generation.sampling import keyed_uniforms
from mta.losses.contrastive import DistiLLM2Loss
from mta.losses.kd import build_base_loss
from mta.losses.teacher_sampled import SampledTeacher, draw_tail_samples, sampled_estimate
from mta.losses.teacher_topk import teacher_logits_from_top_k, top_k_log_probs

VOCAB, SAMPLES, DRAWS, TAU = 7, 4, 6000, 1.5
TEACHER = torch.tensor([2.5, 1.0, 0.3, -0.5, -1.5, -3.0, 0.8])
# A student that puts mass where the teacher has little (token 5): reverse KL's hard case.
STUDENT = torch.tensor([0.2, -0.4, 1.1, 0.0, -0.7, 1.6, -1.2])


def token_loss(name: str):
    """``(student [n, V], teacher, n) -> [n]``: the base loss's per-token value as the losses read
    a teacher (DistiLLM-2 as its chosen-row SKL or rejected-row SRKL term)."""
    if name.startswith("distillm2"):
        loss = DistiLLM2Loss(temperature=TAU)
        kind = 0 if name.endswith("chosen") else 1
        return lambda student, teacher: loss._token_loss(
            student, teacher, torch.full((student.shape[0],), kind, dtype=torch.long)
        )
    loss = build_base_loss(name, temperature=TAU)
    return lambda student, teacher: loss.token_loss(student, teacher, torch.zeros(student.shape[0], dtype=torch.long))


def importance_estimate(name: str):
    """``(student [n, V], SampledTeacher) -> [n]``: the importance-weighted estimate of the loss's
    terms over the draws, whichever estimate the loss itself uses."""
    terms = build_base_loss(name, temperature=TAU).terms
    return lambda student, teacher: sampled_estimate(terms, (student / TAU).log_softmax(dim=1), teacher)


def draws(head: int, rows: int = DRAWS, seed: int = 0) -> SampledTeacher:
    uniforms = keyed_uniforms(seed, "test", range(rows), [1] * rows, SAMPLES)
    stored = draw_tail_samples(TEACHER.expand(rows, VOCAB), uniforms, top_k=head, temperature=TAU)
    return SampledTeacher.from_samples(stored, VOCAB)


def exact(loss, teacher: torch.Tensor = TEACHER) -> tuple[float, torch.Tensor]:
    student = STUDENT.double().unsqueeze(0).requires_grad_(True)
    value = loss(student, teacher.double().unsqueeze(0)).sum()
    (grad,) = torch.autograd.grad(value, student)
    return value.item(), grad[0]


def per_draw(loss, teacher: SampledTeacher) -> tuple[torch.Tensor, torch.Tensor]:
    """Each draw's estimate and its gradient with respect to the student's logits, in fp64."""
    double = dataclasses.replace(teacher, log_probs=teacher.log_probs.double(), weights=teacher.weights.double())
    student = STUDENT.double().expand(teacher.ids.shape[0], VOCAB).clone().requires_grad_(True)
    values = loss(student, double)
    (grads,) = torch.autograd.grad(values.sum(), student)
    return values.detach(), grads


def unbiased(values: torch.Tensor, want: float | torch.Tensor, sigmas: float = 5.0) -> bool:
    """The mean of the draws within ``sigmas`` standard errors of ``want`` (every coordinate)."""
    error = values.std(dim=0) / values.shape[0] ** 0.5 + 2e-6  # + the fp32 rounding of the stored log p
    return bool(((values.mean(dim=0) - want).abs() <= sigmas * error).all())


DIVERGENCES = ["fkl", "rkl", "skl", "srkl", "jsd", "tvd"]
FORWARD = ["fkl", "skl", "distillm2_chosen"]  # the losses read the importance estimate
REVERSE = ["rkl", "srkl", "jsd", "tvd", "distillm2_rejected"]  # the losses read the rest rule


@pytest.mark.parametrize("head", [0, 2])
@pytest.mark.parametrize("name", DIVERGENCES)
def test_the_importance_estimate_of_every_divergence_is_unbiased(name, head):
    loss = token_loss(name)
    value, grad = exact(loss)
    values, grads = per_draw(importance_estimate(name), draws(head))
    assert unbiased(values, value), (name, values.mean().item(), value)
    assert unbiased(grads, grad), (name, grads.mean(dim=0), grad)
    # The planted violation: the draws' empirical distribution without the importance weight
    # P_T / p (what a plain "counts / N" cache would give) is caught by the same check.
    naive = draws(head)
    drawn = torch.arange(naive.ids.shape[1]) >= head  # the head's entries come first
    plain = torch.where(drawn, naive.weights * naive.log_probs.exp(), naive.weights)  # c / N · P_T
    if name in ("rkl", "srkl", "tvd"):
        biased, biased_grads = per_draw(importance_estimate(name), dataclasses.replace(naive, weights=plain))
        assert not (unbiased(biased, value) and unbiased(biased_grads, grad)), name


@pytest.mark.parametrize("name", FORWARD)
def test_forward_type_losses_read_the_unbiased_estimate(name):
    loss = token_loss(name)
    value, grad = exact(loss)
    values, grads = per_draw(loss, draws(2))
    assert unbiased(values, value) and unbiased(grads, grad), (name, values.mean().item(), value)


@pytest.mark.parametrize("name", REVERSE)
def test_reverse_type_losses_read_the_rest_rule_and_its_bias_is_below_the_tail_rules(name):
    """The rest rule is biased (measured here); with the draws kept it is closer than the top-k
    tail rule of the same head, which is what the losses read from a top-k cache."""
    loss = token_loss(name)
    value, _ = exact(loss)
    teacher = draws(2)
    values, _ = per_draw(loss, teacher)
    # A second path: the divergence on the rest rule's log p̃, built by hand from the entries.
    fill = teacher.rest_log_mean if name in ("rkl", "srkl", "distillm2_rejected") else teacher.rest
    by_hand = fill.unsqueeze(1).repeat(1, VOCAB)
    for j in range(teacher.ids.shape[1]):
        kept = teacher.weights[:, j] > 0
        by_hand[kept, teacher.ids[kept, j]] = teacher.log_probs[kept, j]
    divergence = build_base_loss("srkl" if name == "distillm2_rejected" else name, temperature=TAU).divergence
    expected = divergence(by_hand, (STUDENT / TAU).log_softmax(dim=0).expand(teacher.ids.shape[0], VOCAB))
    torch.testing.assert_close(values.float(), expected.float(), rtol=1e-5, atol=1e-6)
    ids, log_probs, tail = top_k_log_probs(TEACHER.unsqueeze(0), 2, temperature=TAU)
    tail_rule, _ = exact(loss, teacher_logits_from_top_k(ids, log_probs, tail, VOCAB, TAU)[0])
    bias = abs(values.mean().item() - value)
    assert bias < abs(tail_rule - value), (name, bias, abs(tail_rule - value))


def test_with_the_whole_vocabulary_in_the_head_it_is_the_dense_loss():
    rows, width = 2, 5
    teacher = torch.randn(rows, width, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    student = torch.randn(rows, width, VOCAB, generator=torch.Generator().manual_seed(4))
    labels = torch.tensor([[1, -100, 2, 3, -100], [-100, 0, 4, -100, 6]])
    uniforms = keyed_uniforms(0, "test", [0], [rows * width], SAMPLES)
    stored = draw_tail_samples(teacher.view(-1, VOCAB), uniforms, top_k=VOCAB, temperature=TAU)
    sampled = SampledTeacher.from_samples(stored, VOCAB)
    sampled = SampledTeacher(
        *(t.view(rows, width, -1) for t in (sampled.ids, sampled.log_probs, sampled.weights)),
        VOCAB,
        sampled.rest.view(rows, width),
        sampled.rest_log_mean.view(rows, width),
    )
    for name in ("fkl", "srkl", "jsd", "tvd"):
        loss = build_base_loss(name, temperature=TAU, chunk_size=3)
        dense_logits, cached_logits = (student.clone().requires_grad_(True) for _ in range(2))
        dense, cached = loss(dense_logits, teacher, labels), loss(cached_logits, sampled, labels)
        torch.testing.assert_close(cached, dense, rtol=1e-5, atol=1e-6)
        cached.backward(), dense.backward()
        torch.testing.assert_close(cached_logits.grad, dense_logits.grad, rtol=1e-5, atol=1e-6)


def test_a_rows_draws_depend_on_its_key_not_on_the_batch():
    alone = keyed_uniforms(7, "teacher-cache", [5], [3], SAMPLES)
    batched = keyed_uniforms(7, "teacher-cache", [2, 5], [4, 3], SAMPLES)
    torch.testing.assert_close(batched[4:], alone, rtol=0, atol=0)
    assert not torch.equal(keyed_uniforms(8, "teacher-cache", [5], [3], SAMPLES), alone)
    # The same uniforms draw the same tokens from the same logits, whichever positions come first.
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    first = draw_tail_samples(logits, alone, top_k=1)
    both = draw_tail_samples(torch.cat([logits.flip(0), logits]), torch.cat([alone.flip(0), alone]), top_k=1)
    tail_of_second = both.distinct[:3].sum()
    torch.testing.assert_close(both.ids[tail_of_second:], first.ids, rtol=0, atol=0)
    torch.testing.assert_close(both.counts[tail_of_second:], first.counts, rtol=0, atol=0)
    position = torch.repeat_interleave(torch.arange(3), first.distinct)
    assert int(first.counts.sum()) == 3 * SAMPLES and (first.ids != first.head_ids[position, 0]).all()
