"""Each loss given the global batch's count (``num_items_in_batch``, ``num_pairs``,
``num_sequences``, ``num_positions``): micro batches of unequal size and length add up, in value
and gradient, to the loss of the whole batch (docs/method.md §5, "Reduction"); without the
count each micro batch is its own mean, which does not add up (the tests tell the two apart).
"""

from __future__ import annotations

import pytest
import torch

from mta.errors import MtaError
from mta.losses.contrastive import DistiLLM2Loss
from mta.losses.dsa import dynamic_structural_alignment
from mta.losses.fdd import FeatureDynamicsLoss
from mta.losses.hra import hidden_representation_alignment
from mta.losses.kd import BASE_LOSSES, build_base_loss
from mta.losses.span_masks import SpanBatch
from mta.losses.sra import SpanRepresentationLoss

GROUPS = ([0], [1, 2, 3], [4, 5])
ROWS, SEQ, VOCAB = 6, 9, 13


def split_and_whole(loss_of, leaves, count):
    """``loss_of(rows, count)`` on all rows with no count, and summed over ``GROUPS`` with the
    global ``count`` (and without): values and gradients of ``leaves``."""

    def run(groups, divisor):
        for leaf in leaves:
            leaf.grad = None
        value = sum(loss_of(torch.tensor(rows), divisor) for rows in groups)
        if divisor is None and len(groups) > 1:
            value = value / len(groups)  # the micro batches' own means, averaged (0.2.0)
        value.backward()
        return value.detach(), [leaf.grad.clone() for leaf in leaves]

    return run([list(range(ROWS))], None), run(GROUPS, count), run(GROUPS, None)


def assert_adds_up(loss_of, leaves, count):
    (whole, whole_grads), (split, split_grads), (means, mean_grads) = split_and_whole(loss_of, leaves, count)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-7)
    for got, want in zip(split_grads, whole_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    # Without the global count the split is another loss (what the assertions above tell apart).
    assert (means - whole).abs() > 1e-3 * whole.abs()


def labels_of(lengths, prompt=2):
    """Right-padded labels: ``-100`` on the prompt and after each row's response."""
    labels = torch.full((ROWS, SEQ), -100)
    for row, length in enumerate(lengths):
        labels[row, prompt : prompt + length] = torch.arange(length) % VOCAB
    return labels


LENGTHS = [1, 7, 3, 6, 2, 5]  # unequal response lengths


@pytest.mark.parametrize("name", [name for name in BASE_LOSSES if name != "distillm2"])
def test_each_base_loss_adds_up_over_micro_batches_with_the_global_token_count(name):
    g = torch.Generator().manual_seed(0)
    student = (torch.randn(ROWS, SEQ, VOCAB, generator=g) * 3).requires_grad_(True)
    teacher = torch.randn(ROWS, SEQ, VOCAB + 2, generator=g) * 3
    labels = labels_of(LENGTHS)
    loss = build_base_loss(name, temperature=2.0, chunk_size=4)
    tokens = float((labels != -100).sum())

    def loss_of(rows, count):
        return loss(student[rows], teacher[rows], labels[rows], num_items_in_batch=count)

    assert_adds_up(loss_of, [student], tokens)


def test_num_items_in_batch_may_be_a_tensor_and_must_be_positive():
    student, labels = torch.randn(2, 3, VOCAB), torch.tensor([[1, 2, -100], [3, -100, -100]])
    loss = build_base_loss("ce")
    assert loss(student, None, labels, num_items_in_batch=torch.tensor(6)) == pytest.approx(
        loss(student, None, labels).item() * 3 / 6
    )
    for bad in (0, -1.0, torch.tensor(0)):
        with pytest.raises(MtaError, match="num_items_in_batch must be a positive number"):
            loss(student, None, labels, num_items_in_batch=bad)


def test_distillm2_adds_up_over_micro_batches_of_whole_pairs_with_the_global_pair_count():
    g = torch.Generator().manual_seed(1)
    student = (torch.randn(ROWS, SEQ, VOCAB, generator=g) * 3).requires_grad_(True)
    teacher = torch.randn(ROWS, SEQ, VOCAB, generator=g) * 3
    labels = labels_of(LENGTHS)
    chosen = torch.tensor([True, False] * 3)
    loss = DistiLLM2Loss(beta=0.7, chunk_size=4)
    pair_groups = ([0, 1], [2, 3, 4, 5])

    def loss_of(rows, count):
        return loss(student[rows], teacher[rows], labels[rows], chosen[rows], num_pairs=count)

    whole = loss_of(torch.arange(ROWS), None)
    (whole_grad,) = torch.autograd.grad(whole, student)
    split = sum(loss_of(torch.tensor(rows), 3.0) for rows in pair_groups)
    (split_grad,) = torch.autograd.grad(split, student)
    torch.testing.assert_close(split, whole)
    torch.testing.assert_close(split_grad, whole_grad)
    means = sum(loss_of(torch.tensor(rows), None) for rows in pair_groups) / 2
    assert (means - whole).abs() > 1e-3 * whole.abs()


def span_case(seed: int, spans: int = 4, dim: int = 5, seq: int = SEQ):
    """Random states and spans, every row with at least two spans (so every row contributes)."""
    g = torch.Generator().manual_seed(seed)
    count = torch.tensor([2, 4, 3, 2, 4, 3])
    mask = torch.arange(spans).unsqueeze(0) < count.unsqueeze(1)
    student = torch.randn(ROWS, spans, dim, generator=g).requires_grad_(True)
    teacher = torch.randn(ROWS, spans, dim + 2, generator=g)
    salience = torch.rand(ROWS, spans, generator=g) + 0.1
    return student, teacher, salience, mask


def test_dsa_adds_up_over_micro_batches_with_the_global_sequence_count():
    student, teacher, salience, mask = span_case(2)

    def loss_of(rows, count):
        return dynamic_structural_alignment(
            student[rows], teacher[rows], salience[rows], mask[rows], num_sequences=count
        )

    assert_adds_up(loss_of, [student], float(ROWS))


def test_hra_adds_up_over_micro_batches_with_the_global_sequence_count():
    student, teacher, salience, mask = span_case(3)
    projected = (student @ torch.randn(5, 7, generator=torch.Generator().manual_seed(9))).detach()
    projected.requires_grad_(True)

    def loss_of(rows, count):
        return hidden_representation_alignment(
            projected[rows], teacher[rows], salience[rows], mask[rows], num_sequences=count
        )

    assert_adds_up(loss_of, [projected], float(ROWS))


def test_a_global_count_needs_the_per_sequence_reduction():
    student, teacher, salience, mask = span_case(4)
    with pytest.raises(ValueError, match="needs reduction='sequence'"):
        dynamic_structural_alignment(student, teacher, salience, mask, reduction="batch", num_sequences=6)
    with pytest.raises(ValueError, match="must be positive"):
        hidden_representation_alignment(student, student.detach(), salience, mask, num_sequences=0)


def test_sra_adds_up_over_micro_batches_with_the_global_sequence_count():
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    loss = SpanRepresentationLoss(2, 4, 6, logit_weight=0.0)
    seq = 8
    starts = torch.tensor([[0, 2, 5], [0, 3, 6], [1, 4, 6], [0, 2, 4], [0, 5, 7], [0, 1, 2]])
    ends = torch.tensor([[2, 5, 8], [3, 6, 8], [4, 6, 7], [2, 4, 6], [5, 7, 8], [1, 2, 3]])
    spans = SpanBatch(starts, ends, starts, ends, torch.ones(ROWS, 3, dtype=torch.bool))
    student = [torch.randn(ROWS, seq, 4, generator=g).requires_grad_(True) for _ in range(2)]
    teacher = [torch.randn(ROWS, seq, 6, generator=g) for _ in range(2)]
    weights = torch.rand(ROWS, seq, generator=g) + 0.1
    scope = torch.ones(ROWS, 3, dtype=torch.bool)

    def loss_of(rows, count):
        rows_spans = SpanBatch(*(t[rows] for t in (starts, ends, starts, ends, spans.mask)))
        return loss(
            [s[rows] for s in student],
            [t[rows] for t in teacher],
            weights[rows],
            weights[rows],
            rows_spans,
            scope[rows],
            num_sequences=count,
        )["sra"]

    assert_adds_up(loss_of, student, float(ROWS))


def test_fdd_adds_up_over_micro_batches_with_the_global_position_count():
    g = torch.Generator().manual_seed(6)
    student = [torch.randn(ROWS, SEQ, 4, generator=g).requires_grad_(True) for _ in range(3)]
    teacher = [torch.randn(ROWS, SEQ, 5, generator=g) for _ in range(3)]
    student_head = torch.randn(4, VOCAB, generator=g)
    teacher_head = torch.randn(5, VOCAB, generator=g)
    mask = labels_of(LENGTHS) != -100
    loss = FeatureDynamicsLoss(temperature=2.0, chunk_size=4)

    def loss_of(rows, count):
        return loss(
            [s[rows] for s in student],
            [t[rows] for t in teacher],
            lambda h: h @ student_head,
            lambda h: h @ teacher_head,
            mask[rows],
            num_positions=count,
        )["fdd"]

    assert_adds_up(loss_of, student, float(mask.sum()))
