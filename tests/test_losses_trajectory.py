"""MTA's span losses against plain loop-based references (docs/method.md §2–4).

The references below loop over sequences, spans, pairs and tokens with scalar maths and share
no code with ``mta.losses``; every case mixes padding, sequences with 0, 1 and several spans,
a single-token sequence and different hidden sizes.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mta.errors import MtaError
from mta.losses import (
    SpanBatch,
    TrajectoryAlignmentLoss,
    dynamic_structural_alignment,
    hidden_representation_alignment,
    pool_spans,
    span_token_mask,
    span_union_mask,
    token_importance,
    uniform_importance,
)
from mta.losses.importance import IMPORTANCE

# ---------------------------------------------------------------- random batches


def make_mask(lengths: list[int], seq_len: int, left_pad: bool = False) -> torch.Tensor:
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    for b, n in enumerate(lengths):
        if left_pad:
            mask[b, seq_len - n :] = 1
        else:
            mask[b, :n] = 1
    return mask


def random_ranges(lengths: list[int], counts: list[int], generator: torch.Generator):
    """Per sequence a list of (start, end) inside the real tokens (right padding)."""
    out = []
    for n, count in zip(lengths, counts, strict=True):
        ranges = []
        for _ in range(count):
            start = int(torch.randint(0, n, (1,), generator=generator))
            end = int(torch.randint(start + 1, n + 1, (1,), generator=generator))
            ranges.append((start, end))
        out.append(ranges)
    return out


def to_span_batch(student_ranges, teacher_ranges) -> SpanBatch:
    num = max(1, max(len(r) for r in student_ranges))
    batch = len(student_ranges)
    tensors = [torch.zeros(batch, num, dtype=torch.long) for _ in range(4)]
    mask = torch.zeros(batch, num, dtype=torch.bool)
    for b, (s_list, t_list) in enumerate(zip(student_ranges, teacher_ranges, strict=True)):
        for k, ((ss, se), (ts, te)) in enumerate(zip(s_list, t_list, strict=True)):
            tensors[0][b, k], tensors[1][b, k], tensors[2][b, k], tensors[3][b, k] = ss, se, ts, te
            mask[b, k] = True
    return SpanBatch(*tensors, mask)


# ---------------------------------------------------------------- loop references


def ref_importance(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """docs/method.md §2 for one sequence at a time, with python loops over query and key tokens."""
    batch, seq, dim = hidden.shape
    out = torch.zeros(batch, seq, dtype=torch.float64)
    for b in range(batch):
        real = [t for t in range(seq) if mask[b, t]]
        if len(real) == 1:
            out[b, real[0]] = 1.0
            continue
        h = hidden[b].double()
        scaled = {t: h[t] / (h[t].std() + 1e-5) for t in real}
        for s in real:
            logits = {t: float(scaled[s] @ scaled[t]) / math.sqrt(dim) for t in real if t != s}
            top = max(logits.values())
            norm = sum(math.exp(v - top) for v in logits.values())
            for t, v in logits.items():
                out[b, t] += math.exp(v - top) / norm / len(real)
    return out


def ref_pool(hidden, weights, ranges):
    """Span vectors and masses, looping over sequences, spans and tokens."""
    pooled, masses = [], []
    for b, spans in enumerate(ranges):
        row_vectors, row_mass = [], []
        for start, end in spans:
            total = torch.zeros(hidden.shape[-1], dtype=torch.float64)
            mass = 0.0
            for t in range(start, end):
                total = total + weights[b, t].double() * hidden[b, t].double()
                mass += float(weights[b, t])
            row_vectors.append(total / max(mass, 1e-8))
            row_mass.append(mass)
        pooled.append(row_vectors)
        masses.append(row_mass)
    return pooled, masses


def ref_cos(a, b):
    return (a @ b) / (a.norm() * b.norm()).clamp(min=1e-12)


def ref_dsa(student_vectors, teacher_vectors, masses):
    values = []
    for s_row, t_row, m_row in zip(student_vectors, teacher_vectors, masses, strict=True):
        if len(s_row) < 2:
            continue
        total_mass = sum(m_row)
        salience = [m / total_mass for m in m_row]
        numerator, denominator = 0.0, 0.0
        for i in range(len(s_row)):
            for j in range(len(s_row)):
                if i == j:
                    continue
                w = salience[i] * salience[j]
                gap = ref_cos(s_row[i], s_row[j]) - ref_cos(t_row[i], t_row[j])
                numerator = numerator + w * gap**2
                denominator += w
        values.append(numerator / denominator)
    return sum(values) / len(values) if values else torch.tensor(0.0, dtype=torch.float64)


def ref_hra(student_items, teacher_items, weights):
    """Lists per sequence of (student vector, teacher vector, weight)."""
    values = []
    for s_row, t_row, w_row in zip(student_items, teacher_items, weights, strict=True):
        if not s_row:
            continue
        numerator = sum(w * (1 - ref_cos(s, t)) for s, t, w in zip(s_row, t_row, w_row, strict=True))
        values.append(numerator / sum(w_row))
    return sum(values) / len(values) if values else torch.tensor(0.0, dtype=torch.float64)


# ---------------------------------------------------------------- span masks and importance


def test_span_token_mask_and_union_match_loops():
    start = torch.tensor([[0, 2, 5, 1], [1, 0, 0, 3], [0, 0, 0, 0]])
    end = torch.tensor([[3, 4, 6, 2], [7, 0, 0, 5], [0, 0, 0, 0]])
    real = torch.tensor([[True, True, True, False], [True, False, False, False], [False] * 4])
    got = span_token_mask(start, end, 7, real)
    union = span_union_mask(start, end, 7, real)
    assert got.shape == (3, 4, 7) and got.dtype == torch.bool and union.shape == (3, 7)
    for b in range(3):
        for t in range(7):
            inside = [bool(real[b, k]) and int(start[b, k]) <= t < int(end[b, k]) for k in range(4)]
            for k in range(4):
                assert bool(got[b, k, t]) == inside[k]
            assert bool(union[b, t]) == any(inside)
    # Without span_mask only the ranges count; padding spans [0, 0) are empty anyway.
    assert bool(span_token_mask(start, end, 7)[0, 3, 1])
    assert span_union_mask(start, end, 7)[0].tolist() == [True] * 4 + [False, True, False]


@pytest.mark.parametrize("left_pad", [False, True])
def test_token_importance_matches_reference(left_pad):
    generator = torch.Generator().manual_seed(0)
    lengths = [6, 1, 4, 0]
    hidden = torch.randn(4, 6, 5, generator=generator) * 3
    mask = make_mask(lengths, 6, left_pad)
    got = token_importance(hidden, mask)
    torch.testing.assert_close(got.double(), ref_importance(hidden, mask), atol=1e-6, rtol=1e-5)
    sums = got.sum(dim=-1)
    torch.testing.assert_close(sums, torch.tensor([1.0, 1.0, 1.0, 0.0]))


def test_token_importance_of_zero_variance_tokens_is_finite_and_matches_reference():
    """A real token with std 0 (an all-zero state, like a model's all-zero EOS embedding row)
    scales to 0 through the ε of docs/method.md §2 instead of 0/0 poisoning its sequence."""
    generator = torch.Generator().manual_seed(2)
    lengths = [5, 2, 4]
    hidden = torch.randn(3, 5, 6, generator=generator) * 3
    hidden[0, 4] = 0.0  # the last real token (an EOS)
    hidden[1, 0] = 0.0  # one of two real tokens
    hidden[2, 1] = 0.0
    hidden[2, 2] = 0.0  # two of them in one sequence
    mask = make_mask(lengths, 5)
    got = token_importance(hidden, mask)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref_importance(hidden, mask), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.sum(dim=-1), torch.ones(3))


def test_token_importance_ignores_padding_content_and_is_detached():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, 8, generator=generator, requires_grad=True)
    mask = make_mask([3, 5], 5)
    changed = hidden.detach().clone()
    changed[0, 3] = 1e4  # padding of the first sequence, even non-finite, changes nothing
    changed[0, 4] = float("nan")
    first, second = token_importance(hidden, mask), token_importance(changed, mask)
    torch.testing.assert_close(first[0], second[0])
    assert not first.requires_grad and first.dtype == torch.float32
    half = token_importance(hidden.detach().bfloat16(), mask)
    assert half.dtype == torch.float32 and torch.isfinite(half).all()


def test_uniform_importance():
    mask = make_mask([4, 1, 0], 4)
    got = uniform_importance(torch.zeros(3, 4, 2), mask)
    expected = torch.tensor([[0.25] * 4, [1.0, 0, 0, 0], [0.0] * 4])
    torch.testing.assert_close(got, expected)


# ---------------------------------------------------------------- pooling, DSA, HRA


def test_pool_spans_matches_reference():
    generator = torch.Generator().manual_seed(2)
    lengths, counts = [7, 1, 5], [3, 1, 0]
    hidden = torch.randn(3, 7, 4, generator=generator, requires_grad=True)
    weights = token_importance(hidden, make_mask(lengths, 7))
    ranges = random_ranges(lengths, counts, generator)
    spans = to_span_batch(ranges, ranges)
    pooled, mass = pool_spans(hidden, weights, spans.student_token_mask(7))
    assert pooled.shape == (3, 3, 4) and mass.shape == (3, 3)
    ref_vectors, ref_masses = ref_pool(hidden.detach(), weights, ranges)
    for b, row in enumerate(ranges):
        for k in range(len(row)):
            torch.testing.assert_close(pooled[b, k].double(), ref_vectors[b][k], atol=1e-6, rtol=1e-5)
            assert mass[b, k].item() == pytest.approx(ref_masses[b][k], rel=1e-5)
        assert torch.all(pooled[b, len(row) :] == 0) and torch.all(mass[b, len(row) :] == 0)
    pooled.sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


def _dsa_case(seed: int, counts: list[int]):
    generator = torch.Generator().manual_seed(seed)
    lengths = [8, 1, 6, 5, 3][: len(counts)]
    batch = len(counts)
    student_hidden = torch.randn(batch, 8, 6, generator=generator, requires_grad=True)
    teacher_hidden = torch.randn(batch, 8, 10, generator=generator, requires_grad=True)
    mask = make_mask(lengths, 8)
    ranges = random_ranges(lengths, counts, generator)
    spans = to_span_batch(ranges, ranges)
    return student_hidden, teacher_hidden, mask, ranges, spans


def test_dsa_matches_reference_with_grads():
    student_hidden, teacher_hidden, mask, ranges, spans = _dsa_case(3, [4, 1, 0, 3, 2])
    sw, tw = token_importance(student_hidden, mask), token_importance(teacher_hidden, mask)
    token_mask = spans.student_token_mask(8)
    student_spans, _ = pool_spans(student_hidden, sw, token_mask)
    teacher_spans, salience = pool_spans(teacher_hidden, tw, token_mask)
    got = dynamic_structural_alignment(student_spans, teacher_spans, salience, spans.mask)

    leaf = student_hidden.detach().double().requires_grad_()
    ref_s, _ = ref_pool(leaf, sw, ranges)
    ref_t, ref_masses = ref_pool(teacher_hidden.detach(), tw, ranges)
    expected = ref_dsa(ref_s, ref_t, ref_masses)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)

    got.backward()
    expected.backward()
    torch.testing.assert_close(student_hidden.grad.double(), leaf.grad, atol=1e-6, rtol=1e-4)
    assert teacher_hidden.grad is None


def test_dsa_is_zero_with_grad_when_no_sequence_has_two_spans():
    student_hidden, teacher_hidden, mask, ranges, spans = _dsa_case(4, [1, 1, 0])
    weights = token_importance(student_hidden, mask)
    token_mask = spans.student_token_mask(8)
    student_spans, _ = pool_spans(student_hidden, weights, token_mask)
    teacher_spans, salience = pool_spans(teacher_hidden.detach(), weights, token_mask)
    loss = dynamic_structural_alignment(student_spans, teacher_spans, salience, spans.mask)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.all(student_hidden.grad == 0)


def test_dsa_is_zero_for_identical_geometry_and_scale_free():
    generator = torch.Generator().manual_seed(5)
    spans = torch.randn(2, 4, 6, generator=generator)
    salience = torch.rand(2, 4, generator=generator)
    mask = torch.tensor([[True] * 4, [True, True, True, False]])
    rotation, _ = torch.linalg.qr(torch.randn(6, 6, generator=generator))
    # Cosine geometry is invariant under rotation and positive scaling of each span.
    same = dynamic_structural_alignment(spans, 3.0 * spans @ rotation, salience, mask)
    assert same.item() == pytest.approx(0.0, abs=1e-10)
    other = torch.randn(2, 4, 3, generator=generator)
    different = dynamic_structural_alignment(spans, other, salience, mask)
    # Salience is normalised per sequence: its overall scale cannot change the loss.
    rescaled = dynamic_structural_alignment(spans, other, salience * 7.0, mask)
    assert different.item() > 0.01
    assert rescaled.item() == pytest.approx(different.item(), rel=1e-6)


def test_hra_matches_reference():
    generator = torch.Generator().manual_seed(6)
    student = torch.randn(3, 5, 7, generator=generator, requires_grad=True)
    teacher = torch.randn(3, 5, 7, generator=generator, requires_grad=True)
    weights = torch.rand(3, 5, generator=generator)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [0, 0, 1, 0, 0]], dtype=torch.bool)
    got = hidden_representation_alignment(student, teacher, weights, mask)
    leaf = student.detach().double().requires_grad_()
    rows = [[t for t in range(5) if mask[b, t]] for b in range(3)]
    expected = ref_hra(
        [[leaf[b, t] for t in row] for b, row in enumerate(rows)],
        [[teacher[b, t].detach().double() for t in row] for b, row in enumerate(rows)],
        [[float(weights[b, t]) for t in row] for b, row in enumerate(rows)],
    )
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    got.backward()
    expected.backward()
    torch.testing.assert_close(student.grad.double(), leaf.grad, atol=1e-7, rtol=1e-5)
    assert teacher.grad is None
    empty = hidden_representation_alignment(student, teacher, weights, torch.zeros_like(mask))
    assert empty.item() == 0.0 and empty.requires_grad


# ---------------------------------------------------------------- the module


PAIRS = [
    SimpleNamespace(student=1, teacher=2, granularity="word"),
    SimpleNamespace(student=2, teacher=3, granularity="phrase"),
    SimpleNamespace(student=3, teacher=3, granularity="phrase"),
]


def ref_alignment(loss_module, student_states, teacher_states, s_mask, t_mask, ranges, same_tokenizer):
    """The module's two terms, one pair, one sequence, one span and one token at a time."""
    dsa_values, hra_values = [], []
    for index, pair in enumerate(PAIRS):
        s_ranges, t_ranges = ranges[pair.granularity]
        s_hidden = student_states[pair.student]
        t_hidden = teacher_states[pair.teacher].detach()
        s_weights = ref_importance(s_hidden.detach(), s_mask)
        t_weights = ref_importance(t_hidden, t_mask)
        s_vectors, _ = ref_pool(s_hidden, s_weights, s_ranges)
        t_vectors, masses = ref_pool(t_hidden, t_weights, t_ranges)
        dsa_values.append(ref_dsa(s_vectors, t_vectors, masses))
        projector = loss_module.projectors[index]
        weight, bias = projector.weight.double(), projector.bias.double()
        if same_tokenizer:
            s_items, t_items, w_items = [], [], []
            for b, spans in enumerate(t_ranges):
                tokens = sorted({t for start, end in spans for t in range(start, end)})
                s_items.append([weight @ s_hidden[b, t].double() + bias for t in tokens])
                t_items.append([t_hidden[b, t].double() for t in tokens])
                w_items.append([float(t_weights[b, t]) for t in tokens])
        else:
            s_items = [[weight @ v + bias for v in row] for row in s_vectors]
            t_items = t_vectors
            w_items = masses
        hra_values.append(ref_hra(s_items, t_items, w_items))
    return sum(dsa_values) / len(PAIRS), sum(hra_values) / len(PAIRS)


@pytest.mark.parametrize("same_tokenizer", [True, False])
def test_trajectory_alignment_matches_reference(same_tokenizer):
    generator = torch.Generator().manual_seed(7)
    s_lengths = [9, 1, 6, 4]
    t_lengths = s_lengths if same_tokenizer else [7, 1, 7, 3]
    s_len, t_len = 9, (9 if same_tokenizer else 7)
    counts = {"word": [4, 1, 0, 2], "phrase": [2, 1, 3, 1]}
    ranges = {}
    for granularity, count in counts.items():
        s_ranges = random_ranges(s_lengths, count, generator)
        t_ranges = s_ranges if same_tokenizer else random_ranges(t_lengths, count, generator)
        ranges[granularity] = (s_ranges, t_ranges)
    spans = {g: to_span_batch(*r) for g, r in ranges.items()}
    s_mask, t_mask = make_mask(s_lengths, s_len), make_mask(t_lengths, t_len)
    student_states = tuple(torch.randn(4, s_len, 6, generator=generator, requires_grad=True) for _ in range(4))
    teacher_states = tuple(torch.randn(4, t_len, 10, generator=generator, requires_grad=True) for _ in range(5))

    torch.manual_seed(0)
    loss = TrajectoryAlignmentLoss(PAIRS, 6, 10, same_tokenizer=same_tokenizer)
    got = loss(student_states, teacher_states, s_mask, t_mask, spans)

    leaves = tuple(h.detach().double().requires_grad_() for h in student_states)
    ref_dsa_value, ref_hra_value = ref_alignment(loss, leaves, teacher_states, s_mask, t_mask, ranges, same_tokenizer)
    assert got["dsa"].item() == pytest.approx(ref_dsa_value.item(), rel=1e-5)
    assert got["hra"].item() == pytest.approx(ref_hra_value.item(), rel=1e-5)

    (got["dsa"] + got["hra"]).backward()
    (ref_dsa_value + ref_hra_value).backward()
    for layer in (1, 2, 3):
        torch.testing.assert_close(student_states[layer].grad.double(), leaves[layer].grad, atol=1e-6, rtol=1e-4)
    assert student_states[0].grad is None
    assert all(h.grad is None for h in teacher_states)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in loss.projectors.parameters())


def test_trajectory_alignment_accepts_only_the_needed_layers_and_bf16():
    generator = torch.Generator().manual_seed(8)
    lengths = [5, 3]
    ranges = random_ranges(lengths, [3, 2], generator)
    spans = {"word": to_span_batch(ranges, ranges), "phrase": to_span_batch(ranges, ranges)}
    mask = make_mask(lengths, 5)
    loss = TrajectoryAlignmentLoss(PAIRS, 4, 8, same_tokenizer=True, importance="uniform")
    assert loss.student_layers == [1, 2, 3] and loss.teacher_layers == [2, 3]
    student = {i: torch.randn(2, 5, 4, generator=generator).bfloat16() for i in loss.student_layers}
    teacher = {i: torch.randn(2, 5, 8, generator=generator).bfloat16() for i in loss.teacher_layers}
    out = loss(student, teacher, mask, mask, spans)
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in out.values())
    with pytest.raises(MtaError, match="layer 3 is not among the teacher"):
        loss(student, {2: teacher[2]}, mask, mask, spans)
    with pytest.raises(MtaError, match="no 'word' spans"):
        loss(student, teacher, mask, mask, {"phrase": spans["phrase"]})
    with pytest.raises(MtaError, match="granularity 'clause'"):
        TrajectoryAlignmentLoss(
            [SimpleNamespace(student=1, teacher=1, granularity="clause")], 4, 8, same_tokenizer=True
        )


def test_importance_is_computed_once_per_model_and_layer(monkeypatch):
    generator = torch.Generator().manual_seed(9)
    lengths = [6, 4]
    ranges = random_ranges(lengths, [3, 2], generator)
    spans = {"word": to_span_batch(ranges, ranges), "phrase": to_span_batch(ranges, ranges)}
    mask = make_mask(lengths, 6)
    calls = []

    def counting(hidden, attention_mask):
        calls.append(hidden.shape)
        return token_importance(hidden, attention_mask)

    monkeypatch.setitem(IMPORTANCE, "attention", counting)
    # Pairs 2 and 3 share teacher layer 3: it must be weighed once, not twice.
    loss = TrajectoryAlignmentLoss(PAIRS, 4, 8, same_tokenizer=True)
    student = tuple(torch.randn(2, 6, 4, generator=generator) for _ in range(4))
    teacher = tuple(torch.randn(2, 6, 8, generator=generator) for _ in range(4))
    loss(student, teacher, mask, mask, spans)
    assert len(calls) == len(loss.student_layers) + len(loss.teacher_layers) == 5


@pytest.mark.parametrize("same_tokenizer", [True, False])
@pytest.mark.parametrize("terms", [("dsa",), ("hra",)])
def test_one_term_alone_equals_that_term_of_both_and_builds_only_what_it_needs(terms, same_tokenizer, monkeypatch):
    generator = torch.Generator().manual_seed(10)
    lengths = [6, 4, 2]
    ranges = random_ranges(lengths, [3, 2, 1], generator)
    spans = {"word": to_span_batch(ranges, ranges), "phrase": to_span_batch(ranges, ranges)}
    mask = make_mask(lengths, 6)
    student = tuple(torch.randn(3, 6, 4, generator=generator) for _ in range(4))
    teacher = tuple(torch.randn(3, 6, 8, generator=generator) for _ in range(4))
    torch.manual_seed(0)
    both = TrajectoryAlignmentLoss(PAIRS, 4, 8, same_tokenizer=same_tokenizer)
    expected = both(student, teacher, mask, mask, spans)

    calls = []

    def counting(hidden, attention_mask):
        calls.append(hidden.shape[-1])
        return token_importance(hidden, attention_mask)

    monkeypatch.setitem(IMPORTANCE, "attention", counting)
    torch.manual_seed(0)
    alone = TrajectoryAlignmentLoss(PAIRS, 4, 8, same_tokenizer=same_tokenizer, terms=terms)
    got = alone(student, teacher, mask, mask, spans)
    assert set(got) == set(terms)
    for term in terms:
        assert got[term].item() == pytest.approx(expected[term].item(), rel=1e-6)
    # Without HRA no projector is built; token-level HRA alone pools nothing, so the student's
    # importance (width 4) is never computed.
    assert (alone.projectors is None) == ("hra" not in terms)
    assert (4 in calls) == (terms == ("dsa",) or not same_tokenizer)
    with pytest.raises(MtaError, match="subset of dsa, hra"):
        TrajectoryAlignmentLoss(PAIRS, 4, 8, same_tokenizer=True, terms=("kd",))
