"""The cross-vocabulary base losses (mta.losses.cross_tokenizer) against plain loop references.

The references loop over rows, units and tokens in float64 with scalar maths (Python sorting,
products of conditional probabilities, dict lookups for the shared vocabulary) and share no code
with ``mta.losses``. The units come from ``boundary_spans`` on hand-tokenised strings: a unit
with three teacher tokens and one student token, a word the two sides never agree inside, right
padding, prompt tokens (-100) and padding spans.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mta.data.token_ranges import boundary_spans
from mta.errors import MtaError
from mta.losses.cross_tokenizer import (
    SharedVocabularyHybrid,
    UniversalLogitDistillation,
    aligned_units,
)
from mta.losses.kd import ForwardKL, SkewReverseKL
from mta.losses.span_masks import SpanBatch

V_S, V_T = 7, 11
SHARED = {0: 3, 2: 1, 5: 7, 6: 0}  # student id -> teacher id


def tokenised(text: str, pieces: list[str]) -> np.ndarray:
    """Character offsets of ``pieces``, which concatenate to ``text``."""
    assert "".join(pieces) == text
    ends = np.cumsum([len(piece) for piece in pieces])
    return np.stack([ends - [len(piece) for piece in pieces], ends], axis=1)


# Row 0: "unbelievable" is three teacher tokens and one student token; "cats" one and two.
# Row 1: the two sides never agree inside either word ("abcd", "efgh": 2 vs 2 tokens each).
ROWS = [
    (
        "Q: unbelievable cats sat",
        ["Q", ":", " un", "believ", "able", " cats", " sat"],
        ["Q", ":", " unbelievable", " ca", "ts", " sat"],
    ),
    ("Q abcd efgh", ["Q", " ab", "cd", " ef", "gh"], ["Q", " a", "bcd", " e", "fgh"]),
]
PROMPT = [(2, 2), (1, 1)]  # (teacher, student) prompt tokens of each row: "Q:" / "Q"


def hand_batch():
    """Spans, labels and ids of ROWS; row 1 is shorter on both sides (right padding)."""
    spans, lengths = [], []
    for text, teacher, student in ROWS:
        _, t_ranges, s_ranges = boundary_spans(text, tokenised(text, teacher), tokenised(text, student))
        spans.append((s_ranges, t_ranges))
        lengths.append((len(teacher), len(student)))
    width_t, width_s = max(t for t, _ in lengths), max(s for _, s in lengths)
    units = max(len(s) for s, _ in spans) + 1  # one more: a padding span with garbage ranges
    fields = [torch.full((len(ROWS), units), 2, dtype=torch.long) for _ in range(4)]
    mask = torch.zeros(len(ROWS), units, dtype=torch.bool)
    for b, (s_ranges, t_ranges) in enumerate(spans):
        for k in range(len(s_ranges)):
            fields[0][b, k], fields[1][b, k] = (int(v) for v in s_ranges[k])
            fields[2][b, k], fields[3][b, k] = (int(v) for v in t_ranges[k])
            mask[b, k] = True
    g = torch.Generator().manual_seed(3)
    s_ids = torch.randint(0, V_S, (len(ROWS), width_s), generator=g)
    t_ids = torch.randint(0, V_T, (len(ROWS), width_t), generator=g)
    s_labels, t_labels = s_ids.clone(), t_ids.clone()
    for b, ((t_len, s_len), (t_prompt, s_prompt)) in enumerate(zip(lengths, PROMPT, strict=True)):
        s_labels[b, :s_prompt] = -100
        s_labels[b, s_len:] = -100
        t_labels[b, :t_prompt] = -100
        t_labels[b, t_len:] = -100
    return SpanBatch(*fields, mask), s_ids, t_ids, s_labels, t_labels, (width_s, width_t)


def test_boundary_spans_give_the_hand_aligned_units():
    spans, _, _, s_labels, t_labels, _ = hand_batch()
    units = aligned_units(spans, s_labels, t_labels)
    got = list(
        zip(
            units.row.tolist(),
            zip(units.student_first.tolist(), units.student_end.tolist(), strict=True),
            zip(units.teacher_first.tolist(), units.teacher_end.tolist(), strict=True),
            strict=True,
        )
    )
    # "Q" and ":" are prompt units (and "Q" has no predicting position): left out.
    assert got == [
        (0, (2, 3), (2, 5)),  # unbelievable: 1 student token, 3 teacher tokens
        (0, (3, 5), (5, 6)),  # cats: 2 vs 1
        (0, (5, 6), (6, 7)),  # sat
        (1, (1, 3), (1, 3)),  # abcd: never agree inside
        (1, (3, 5), (3, 5)),  # efgh
    ]


# ---------------------------------------------------------------- plain references


def softmax(row: list[float], tau: float) -> list[float]:
    top = max(row)
    exps = [math.exp((v - top) / tau) for v in row]
    total = sum(exps)
    return [e / total for e in exps]


def merged(logits, ids, first, end, tau):
    """A side's unit vector: its distribution at the first token times the later tokens' probabilities."""
    scale = 1.0
    for j in range(first + 1, end):
        scale *= softmax(logits[j - 1], tau)[ids[j]]
    return [p * scale for p in softmax(logits[first - 1], tau)]


def plain_sorted_l1(a, b):
    a, b = sorted(a, reverse=True), sorted(b, reverse=True)
    width = max(len(a), len(b))
    a, b = a + [0.0] * (width - len(a)), b + [0.0] * (width - len(b))
    return sum(abs(x - y) for x, y in zip(a, b, strict=True))


def plain_ce(s_logits, s_labels):
    total, count = 0.0, 0
    for b in range(len(s_labels)):
        for t in range(1, len(s_labels[b])):
            if s_labels[b][t] != -100:
                total -= math.log(softmax(s_logits[b][t - 1], 1.0)[s_labels[b][t]])
                count += 1
    return total / max(count, 1)


def plain_units(spans, s_labels, t_labels):
    out = []
    for b in range(len(s_labels)):
        for k in range(spans.mask.shape[1]):
            if not spans.mask[b, k]:
                continue
            sf, se = int(spans.student_start[b, k]), int(spans.student_end[b, k])
            tf, te = int(spans.teacher_start[b, k]), int(spans.teacher_end[b, k])
            if sf >= 1 and tf >= 1 and s_labels[b][sf] != -100 and t_labels[b][tf] != -100:
                out.append((b, sf, se, tf, te))
    return out


def plain_loss(
    s_logits,
    t_logits,
    s_ids,
    t_ids,
    s_labels,
    t_labels,
    spans,
    *,
    kind,
    tau,
    ce_w,
    uld_w,
    kl_w=1.0,
    divergence="fkl",
    alpha=0.1,
    shared=SHARED,
):
    per_unit = []
    for b, sf, se, tf, te in plain_units(spans, s_labels, t_labels):
        ms = merged(s_logits[b], s_ids[b], sf, se, tau)
        mt = merged(t_logits[b], t_ids[b], tf, te, tau)
        if kind == "uld":
            per_unit.append(uld_w * plain_sorted_l1(ms, mt))
            continue
        q = softmax([s_logits[b][sf - 1][i] for i in shared], tau)
        p = softmax([t_logits[b][tf - 1][j] for j in shared.values()], tau)
        if divergence == "fkl":
            d = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
        else:
            d = sum(qi * math.log(qi / (alpha * qi + (1 - alpha) * pi)) for pi, qi in zip(p, q, strict=True))
        rest_s = [ms[i] for i in range(len(ms)) if i not in shared]
        rest_t = [mt[j] for j in range(len(mt)) if j not in set(shared.values())]
        per_unit.append(kl_w * d + uld_w * plain_sorted_l1(rest_s, rest_t))
    return sum(per_unit) / max(len(per_unit), 1) + ce_w * plain_ce(s_logits, s_labels)


def shared_tensors(shared=SHARED):
    return torch.tensor(list(shared)), torch.tensor(list(shared.values()))


def value_and_grad(loss_fn, s_logits, t_logits, s_labels, t_labels, spans):
    leaf = s_logits.clone().requires_grad_(True)
    loss = loss_fn(leaf, t_logits, s_labels, t_labels, spans)
    loss.backward()
    return loss.item(), leaf.grad


def plain_value_and_grad(s_logits, t_logits, s_ids, t_ids, s_labels, t_labels, spans, **options):
    """The reference's value, and its gradient by central differences in float64."""
    s64, t64 = s_logits.double().tolist(), t_logits.double().tolist()
    lists = [x.tolist() for x in (s_ids, t_ids, s_labels, t_labels)]
    value = plain_loss(s64, t64, *lists, spans, **options)
    grad = torch.zeros_like(s_logits, dtype=torch.float64)
    eps = 1e-5
    for index in np.ndindex(*s_logits.shape):
        b, t, v = index
        keep = s64[b][t][v]
        s64[b][t][v] = keep + eps
        up = plain_loss(s64, t64, *lists, spans, **options)
        s64[b][t][v] = keep - eps
        down = plain_loss(s64, t64, *lists, spans, **options)
        s64[b][t][v] = keep
        grad[index] = (up - down) / (2 * eps)
    return value, grad


def logits_for(widths, seed=0):
    g = torch.Generator().manual_seed(seed)
    width_s, width_t = widths
    return torch.randn(2, width_s, V_S, generator=g) * 2, torch.randn(2, width_t, V_T, generator=g) * 2


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_uld_on_aligned_units_matches_the_plain_reference_in_value_and_gradient(tau):
    spans, s_ids, t_ids, s_labels, t_labels, widths = hand_batch()
    s_logits, t_logits = logits_for(widths)
    # Teacher-forced: the labels are the ids on the response.
    loss_fn = UniversalLogitDistillation(uld_weight=1.5, ce_weight=0.7, temperature=tau, chunk_size=2)
    got, grad = value_and_grad(loss_fn, s_logits, t_logits, s_labels, t_labels, spans)
    want, want_grad = plain_value_and_grad(
        s_logits, t_logits, s_ids, t_ids, s_labels, t_labels, spans, kind="uld", tau=tau, ce_w=0.7, uld_w=1.5
    )
    assert got == pytest.approx(want, rel=1e-5)
    torch.testing.assert_close(grad.double(), want_grad, atol=2e-5, rtol=1e-3)
    # The gradient reaches a multi-token unit's later positions (student "cats": " ca" predicted at 2, "ts" at 3).
    assert grad[0, 3].abs().sum() > 0


@pytest.mark.parametrize("divergence", ["fkl", "srkl"])
def test_the_hybrid_with_a_hand_built_overlap_matches_the_plain_reference(divergence):
    spans, s_ids, t_ids, s_labels, t_labels, widths = hand_batch()
    s_logits, t_logits = logits_for(widths, seed=1)
    loss_fn = SharedVocabularyHybrid(
        shared_tensors(),
        divergence=divergence,
        skew_alpha=0.2,
        kl_weight=0.8,
        uld_weight=1.3,
        ce_weight=0.5,
        temperature=1.5,
        chunk_size=3,
    )
    got, grad = value_and_grad(loss_fn, s_logits, t_logits, s_labels, t_labels, spans)
    want, want_grad = plain_value_and_grad(
        s_logits,
        t_logits,
        s_ids,
        t_ids,
        s_labels,
        t_labels,
        spans,
        kind="gold",
        tau=1.5,
        ce_w=0.5,
        uld_w=1.3,
        kl_w=0.8,
        divergence=divergence,
        alpha=0.2,
    )
    assert got == pytest.approx(want, rel=1e-5)
    torch.testing.assert_close(grad.double(), want_grad, atol=2e-5, rtol=1e-3)


def test_prompt_padding_and_padding_spans_never_count():
    spans, s_ids, t_ids, s_labels, t_labels, widths = hand_batch()
    s_logits, t_logits = logits_for(widths, seed=2)
    loss_fn = SharedVocabularyHybrid(shared_tensors(), ce_weight=1.0)
    base, grad = value_and_grad(loss_fn, s_logits, t_logits, s_labels, t_labels, spans)
    # Row 1 is padded on both sides past position 4 (student) and 4 (teacher); position 0 predicts
    # the prompt's second token; nothing there is read.
    s_moved, t_moved = s_logits.clone(), t_logits.clone()
    s_moved[1, 5:] = 50.0
    t_moved[1, 5:] = -50.0
    s_moved[1, 0] = 0.0  # predicts student token 1, the first of "abcd": read
    moved, _ = value_and_grad(loss_fn, s_moved, t_moved, s_labels, t_labels, spans)
    assert moved != pytest.approx(base)
    s_moved[1, 0] = s_logits[1, 0]
    moved, _ = value_and_grad(loss_fn, s_moved, t_moved, s_labels, t_labels, spans)
    assert moved == pytest.approx(base, rel=1e-6)
    assert grad[1, 5:].abs().sum() == 0
    # A prompt unit made a response unit would count: the mask is what keeps it out.
    assert len(aligned_units(spans, s_ids, t_ids)) > len(aligned_units(spans, s_labels, t_labels))


def test_with_one_tokenizer_the_hybrid_is_the_plain_kl():
    g = torch.Generator().manual_seed(4)
    batch, seq, vocab = 2, 6, 9
    s_logits, t_logits = torch.randn(batch, seq, vocab, generator=g), torch.randn(batch, seq, vocab, generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :2] = -100
    labels[1, 4:] = -100  # padding
    # One tokenizer: every token is its own unit on both sides.
    starts = torch.arange(seq).expand(batch, seq)
    spans = SpanBatch(starts, starts + 1, starts, starts + 1, torch.ones(batch, seq, dtype=torch.bool))
    everything = (torch.arange(vocab), torch.arange(vocab))
    for divergence, plain in (
        ("fkl", ForwardKL(temperature=2.0)),
        ("srkl", SkewReverseKL(temperature=2.0, skew_alpha=0.3)),
    ):
        hybrid = SharedVocabularyHybrid(
            everything,
            divergence=divergence,
            skew_alpha=0.3,
            ce_weight=0.0,
            kl_weight=1.0,
            uld_weight=1.5,
            temperature=2.0,
        )
        got, grad = value_and_grad(hybrid, s_logits, t_logits, labels, labels, spans)
        leaf = s_logits.clone().requires_grad_(True)
        want = plain(leaf[:, :-1], t_logits[:, :-1], labels[:, 1:])
        want.backward()
        assert got == pytest.approx(want.item(), rel=1e-6)
        torch.testing.assert_close(grad, leaf.grad)


def test_chunk_size_changes_nothing_and_a_batch_without_units_is_a_zero_with_a_gradient():
    spans, _, _, s_labels, t_labels, widths = hand_batch()
    s_logits, t_logits = logits_for(widths, seed=5)
    one = UniversalLogitDistillation(chunk_size=1)
    many = UniversalLogitDistillation(chunk_size=64)
    a, grad_a = value_and_grad(one, s_logits, t_logits, s_labels, t_labels, spans)
    b, grad_b = value_and_grad(many, s_logits, t_logits, s_labels, t_labels, spans)
    assert a == pytest.approx(b, rel=1e-6)
    torch.testing.assert_close(grad_a, grad_b)
    none = SpanBatch(
        *(x[:, :0] for x in (spans.student_start, spans.student_end, spans.teacher_start, spans.teacher_end)),
        spans.mask[:, :0],
    )
    value, grad = value_and_grad(
        UniversalLogitDistillation(ce_weight=0.0), s_logits, t_logits, s_labels, t_labels, none
    )
    assert value == 0.0 and grad.abs().sum() == 0


def test_the_hybrid_refuses_tokenizers_that_share_nothing():
    with pytest.raises(MtaError, match="share none.*loss.base=uld"):
        SharedVocabularyHybrid((torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_give_the_fp32_value_and_a_gradient_in_their_dtype(dtype):
    spans, _, _, s_labels, t_labels, widths = hand_batch()
    s_logits, t_logits = logits_for(widths, seed=6)
    loss_fn = SharedVocabularyHybrid(shared_tensors())
    want, _ = value_and_grad(loss_fn, s_logits.to(dtype).float(), t_logits.to(dtype).float(), s_labels, t_labels, spans)
    got, grad = value_and_grad(loss_fn, s_logits.to(dtype), t_logits.to(dtype), s_labels, t_labels, spans)
    assert got == pytest.approx(want, rel=1e-5)  # the maths is fp32 on the same (rounded) logits
    assert grad.dtype == dtype and torch.isfinite(grad.float()).all() and grad.float().abs().sum() > 0
