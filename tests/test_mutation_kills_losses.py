"""Edge cases of ``mta.losses`` that mutation testing (bench/mutation.py) found unchecked.

Boundary parameters of the base losses, batches with a single contributing sequence or token,
spans outside the sequence, the factory defaults (device, dtype) and the messages of refused
input. Every expected value comes from python floats and loops (docs/method.md §2–5), not from
the code under test; the default-device checks compare the code with itself under another
default, since what they pin is that the result does not depend on it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fixtures.losses import kl, softmax
from mta.errors import MtaError
from mta.losses import (
    SpanBatch,
    TrajectoryAlignmentLoss,
    build_base_loss,
    dynamic_structural_alignment,
    hidden_representation_alignment,
    pool_spans,
    span_token_mask,
    span_union_mask,
    token_importance,
    uniform_importance,
)
from mta.losses.kd import (
    ForwardKL,
    JensenShannon,
    ReverseKL,
    SkewForwardKL,
    SkewReverseKL,
    TotalVariation,
)

# ---------------------------------------------------------------- python-float references


def mix(weight: float, a: list[float], b: list[float]) -> list[float]:
    return [weight * x + (1 - weight) * y for x, y in zip(a, b, strict=True)]


def ref_divergence(name: str, s_row, t_row, *, tau=1.0, alpha=0.1, beta=0.5) -> float:
    q, p = softmax(s_row, tau), softmax(t_row, tau)
    if name == "fkl":
        return kl(p, q)
    if name == "rkl":
        return kl(q, p)
    if name == "skl":
        return kl(p, mix(alpha, p, q))
    if name == "srkl":
        return kl(q, mix(alpha, q, p))
    if name == "jsd":
        m = mix(beta, p, q)
        return beta * kl(p, m) + (1 - beta) * kl(q, m)
    if name == "tvd":
        return 0.5 * sum(abs(x - y) for x, y in zip(p, q, strict=True))
    raise AssertionError(name)


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / max(math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)), 1e-8)


def ref_dsa(student, teacher, salience, mask) -> float:
    """Per sequence Σ_{i≠j} w_i w_j (cos S_ij − cos T_ij)² / Σ_{i≠j} w_i w_j over its real spans,
    w normalised per sequence; the mean over sequences with ≥ 2 spans and positive weight."""
    values = []
    for b in range(len(mask)):
        real = [k for k in range(len(mask[b])) if mask[b][k]]
        total = sum(salience[b][k] for k in real)
        w = {k: salience[b][k] / total for k in real} if total > 0 else {k: 0.0 for k in real}
        num = den = 0.0
        for i in real:
            for j in real:
                if i != j:
                    gap = cosine(student[b][i], student[b][j]) - cosine(teacher[b][i], teacher[b][j])
                    num += w[i] * w[j] * gap * gap
                    den += w[i] * w[j]
        if len(real) >= 2 and den > 0:
            values.append(num / den)
    return sum(values) / len(values) if values else 0.0


def ref_hra(student, teacher, weights, mask) -> float:
    values = []
    for b in range(len(mask)):
        items = [k for k in range(len(mask[b])) if mask[b][k]]
        den = sum(weights[b][k] for k in items)
        if items and den > 0:
            values.append(sum(weights[b][k] * (1 - cosine(student[b][k], teacher[b][k])) for k in items) / den)
    return sum(values) / len(values) if values else 0.0


def ref_covers(start, end, mask, seq_len) -> list[list[list[bool]]]:
    """[batch][span][token]: a real span covers the tokens t with start <= t < end."""
    return [
        [[bool(mask[b][k]) and start[b][k] <= t < end[b][k] for t in range(seq_len)] for k in range(len(start[b]))]
        for b in range(len(start))
    ]


def rows(tensor: torch.Tensor) -> list:
    return tensor.double().tolist()


# ---------------------------------------------------------------- base losses


DISTRIBUTION_LOSSES = {
    "fkl": ForwardKL,
    "rkl": ReverseKL,
    "skl": SkewForwardKL,
    "srkl": SkewReverseKL,
    "jsd": JensenShannon,
    "tvd": TotalVariation,
}


@pytest.mark.parametrize("name", sorted(DISTRIBUTION_LOSSES))
def test_token_loss_gives_one_value_per_row_and_the_classes_default_to_the_papers_settings(name):
    """``token_loss`` maps [n, vocab] to [n] (the chunked reduction is not its business), and a
    loss built without options uses τ = 1, α = 0.1, β = 0.5."""
    generator = torch.Generator().manual_seed(11)
    student, teacher = torch.randn(4, 9, generator=generator) * 2, torch.randn(4, 9, generator=generator) * 2
    loss = DISTRIBUTION_LOSSES[name]()
    got = loss.token_loss(student, teacher, torch.zeros(4, dtype=torch.long))
    assert got.shape == (4,)
    for row in range(4):
        expected = ref_divergence(name, student[row].tolist(), teacher[row].tolist())
        assert got[row].item() == pytest.approx(expected, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize(
    ("name", "weight", "equals"),
    [
        ("skl", 0.0, "fkl"),
        ("skl", 1.0, "zero"),
        ("srkl", 0.0, "rkl"),
        ("srkl", 1.0, "zero"),
        ("jsd", 0.0, "fkl"),  # TRL's meaning of β at the ends (docs/method.md §5)
        ("jsd", 1.0, "rkl"),
    ],
)
def test_mixture_weights_at_the_ends_of_the_unit_interval(name, weight, equals):
    """α or β of 0 and 1 are valid: one side of the mixture has weight 0 (its log is −∞) and the
    divergence is the plain KL or 0, finite; jsd's ends are the forward and the reverse KL."""
    generator = torch.Generator().manual_seed(12)
    student = torch.randn(2, 3, 8, generator=generator)
    teacher = torch.randn(2, 3, 8, generator=generator)
    labels = torch.zeros(2, 3, dtype=torch.long)
    option = {"skew_alpha": weight} if name != "jsd" else {"jsd_beta": weight}
    got = build_base_loss(name, **option)(student, teacher, labels).item()
    values = [
        0.0 if equals == "zero" else ref_divergence(equals, student[b, t].tolist(), teacher[b, t].tolist())
        for b in range(2)
        for t in range(3)
    ]
    assert math.isfinite(got)
    assert got == pytest.approx(sum(values) / len(values), abs=1e-6)


@pytest.mark.parametrize("option", ["skew_alpha", "jsd_beta"])
def test_mixture_weights_outside_the_unit_interval_are_refused_by_name(option):
    name = "skl" if option == "skew_alpha" else "jsd"
    for bad in (-0.01, 1.01):
        with pytest.raises(MtaError, match=rf"^{option} must lie in \[0, 1\], got {bad}$"):
            build_base_loss(name, **{option: bad})


def test_temperature_and_chunk_size_limits_are_refused_with_the_value():
    with pytest.raises(MtaError, match=r"^temperature must be positive, got 0$"):
        build_base_loss("fkl", temperature=0)
    build_base_loss("fkl", temperature=1e-3)
    with pytest.raises(MtaError, match=r"^chunk_size must be at least 1, got 0$"):
        build_base_loss("ce", chunk_size=0)
    with pytest.raises(
        MtaError,
        match=r"^unknown base loss 'kl'; choose one of ce, fkl, rkl, skl, srkl, jsd, tvd, distillm2, uld, gold$",
    ):
        build_base_loss("kl")


def test_missing_teacher_and_mismatched_positions_are_named():
    student = torch.zeros(2, 5, 7)
    with pytest.raises(MtaError, match=r"^ReverseKL compares with a teacher; teacher_logits is None$"):
        ReverseKL()(student, None, torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(MtaError, match=r"^teacher logits \(2, 4, 7\) and student logits \(2, 5, 7\) do not cover"):
        ForwardKL()(student, torch.zeros(2, 4, 7), torch.zeros(2, 5, dtype=torch.long))


def test_a_batch_with_one_response_token_has_that_tokens_loss_and_gradient():
    """The mean over one token is that token's value; d KL(p‖q)/d student = q − p (τ = 1)."""
    generator = torch.Generator().manual_seed(13)
    student = torch.randn(2, 3, 6, generator=generator, requires_grad=True)
    teacher = torch.randn(2, 3, 6, generator=generator)
    labels = torch.full((2, 3), -100)
    labels[1, 2] = 4
    loss = build_base_loss("fkl", chunk_size=2)(student, teacher, labels)
    q, p = softmax(student[1, 2].tolist()), softmax(teacher[1, 2].tolist())
    assert loss.item() == pytest.approx(kl(p, q), rel=1e-5)
    loss.backward()
    expected = torch.zeros(2, 3, 6, dtype=torch.float64)
    expected[1, 2] = torch.tensor(q, dtype=torch.float64) - torch.tensor(p, dtype=torch.float64)
    torch.testing.assert_close(student.grad.double(), expected, atol=1e-6, rtol=1e-5)


def test_no_gradient_reaches_a_teacher_that_asks_for_one():
    """The teacher is a constant of the loss, also when its logits require grad and the
    student's do not (backward is still called, and must answer None for every input)."""
    generator = torch.Generator().manual_seed(14)
    student = torch.randn(1, 4, 5, generator=generator)
    teacher = torch.randn(1, 4, 5, generator=generator, requires_grad=True)
    labels = torch.tensor([[1, 2, -100, 3]])
    build_base_loss("jsd")(student, teacher, labels).backward()
    assert teacher.grad is None
    student.requires_grad_()
    build_base_loss("jsd")(student, teacher, labels).backward()
    assert teacher.grad is None and student.grad is not None


# ---------------------------------------------------------------- the default device and dtype


def _spans_case():
    generator = torch.Generator().manual_seed(15)
    start = torch.tensor([[0, 2, 5, 1], [1, 0, 0, 3]])
    end = torch.tensor([[3, 4, 6, 2], [6, 2, 0, 5]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    hidden_s = torch.randn(2, 6, 4, generator=generator, requires_grad=True)
    hidden_t = torch.randn(2, 6, 5, generator=generator)
    attention = torch.tensor([[1] * 6, [1] * 5 + [0]])
    # The losses' inputs are all made here, under the usual defaults.
    to_vocab_s, to_vocab_t, bias = torch.ones(4, 7), torch.ones(5, 7), torch.arange(7.0)
    labels = torch.tensor([[1, 2, -100, 3, 4, 5], [-100, 6, 0, 1, 2, -100]])
    return start, end, mask, hidden_s, hidden_t, attention, (to_vocab_s, to_vocab_t, bias, labels)


def _everything(start, end, mask, hidden_s, hidden_t, attention, kd_inputs) -> dict[str, torch.Tensor]:
    out = {
        "token_mask": span_token_mask(start, end, 6, mask),
        "union": span_union_mask(start, end, 6, mask),
        "importance": token_importance(hidden_t, attention),
        "uniform": uniform_importance(hidden_t, attention),
    }
    spans_s, _ = pool_spans(hidden_s, out["importance"], out["token_mask"].float())
    spans_t, salience = pool_spans(hidden_t, out["importance"], out["token_mask"].float())
    out["dsa"] = dynamic_structural_alignment(spans_s, spans_t, salience, mask)
    out["hra"] = hidden_representation_alignment(spans_s[..., :4], spans_t[..., :4], salience, mask)
    (out["dsa_grad"],) = torch.autograd.grad(out["dsa"], hidden_s)
    to_vocab_s, to_vocab_t, bias, labels = kd_inputs
    logits = hidden_s @ to_vocab_s + bias
    out["fkl"] = build_base_loss("fkl", chunk_size=3)(logits, hidden_t @ to_vocab_t, labels)
    (out["fkl_grad"],) = torch.autograd.grad(out["fkl"], hidden_s)
    return out


@pytest.mark.parametrize("default", ["meta device", "float64"])
def test_results_follow_the_inputs_not_the_default_device_or_dtype(default):
    """Every tensor the losses create goes on the inputs' device, and the documented fp32 stays
    fp32: under another default (a CUDA run, a caller's set_default_dtype) nothing changes."""
    case = _spans_case()
    expected = _everything(*case)
    if default == "meta device":
        with torch.device("meta"):
            got = _everything(*case)
    else:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            got = _everything(*case)
        finally:
            torch.set_default_dtype(previous)
    for name, tensor in expected.items():
        assert got[name].device == tensor.device and got[name].dtype == tensor.dtype, name
        torch.testing.assert_close(got[name], tensor, msg=name)
    assert expected["fkl"].dtype == expected["dsa"].dtype == expected["importance"].dtype == torch.float32


# ---------------------------------------------------------------- DSA and HRA batches


def test_dsa_normalises_each_sequence_on_its_own_and_averages_only_contributors():
    """One sequence with salience ~1e-7 beside one with ~1 (each is normalised by its own sum),
    one with two spans but no salience and one with a single span: neither of those two counts."""
    generator = torch.Generator().manual_seed(16)
    student = torch.randn(4, 3, 4, generator=generator)
    teacher = torch.randn(4, 3, 6, generator=generator)
    salience = torch.rand(4, 3, generator=generator) + 0.5
    salience[0] *= 1e-7
    salience[2] = 0.0
    mask = torch.tensor([[True, True, True], [True, True, False], [True, True, False], [True, False, False]])
    got = dynamic_structural_alignment(student, teacher, salience, mask).item()
    assert got == pytest.approx(ref_dsa(rows(student), rows(teacher), rows(salience), mask.tolist()), rel=1e-5)
    # Alone, the small-salience sequence is the whole mean (not half of it).
    alone = dynamic_structural_alignment(student, teacher, salience * torch.tensor([[1.0], [0], [0], [0]]), mask)
    expected_alone = ref_dsa(rows(student[:1]), rows(teacher[:1]), rows(salience[:1]), mask[:1].tolist())
    assert expected_alone > 1e-3 and alone.item() == pytest.approx(expected_alone, rel=1e-5)


def test_hra_averages_only_sequences_with_weight():
    generator = torch.Generator().manual_seed(17)
    student = torch.randn(3, 4, 5, generator=generator)
    teacher = torch.randn(3, 4, 5, generator=generator)
    weights = torch.rand(3, 4, generator=generator) + 0.1
    weights[1] = 0.0  # items, but no weight: no contribution
    mask = torch.tensor([[True, True, False, True], [True, True, True, True], [False] * 4])
    got = hidden_representation_alignment(student, teacher, weights, mask).item()
    expected = ref_hra(rows(student), rows(teacher), rows(weights), mask.tolist())
    assert got == pytest.approx(expected, rel=1e-5)
    assert expected == pytest.approx(
        ref_hra(rows(student[:1]), rows(teacher[:1]), rows(weights[:1]), [mask[0].tolist()])
    )


# ---------------------------------------------------------------- span masks and SpanBatch


def test_masks_of_ranges_outside_the_sequence_empty_ranges_and_padding_spans():
    """Ranges may start before 0 or end past seq_len (they cover what lies inside), a real
    span may be empty, and a padding span covers nothing whatever its range."""
    seq_len = 5
    start = torch.tensor([[-2, 3, 0, 1, 7], [0, 4, 2, 0, -4]])
    end = torch.tensor([[1, 9, 0, 4, 9], [0, 7, 3, 5, -1]])  # [7, 9) and [-4, -1) lie wholly outside
    mask = torch.tensor([[True, True, True, False, True], [True, True, False, False, True]])
    covers = ref_covers(start.tolist(), end.tolist(), mask.tolist(), seq_len)
    assert span_token_mask(start, end, seq_len, mask).tolist() == covers
    union = [[any(span[t] for span in row) for t in range(seq_len)] for row in covers]
    assert span_union_mask(start, end, seq_len, mask).tolist() == union


def test_span_batch_masks_ignore_the_ranges_of_padding_spans_and_move_whole():
    batch = SpanBatch(
        student_start=torch.tensor([[0, 2, 1]]),
        student_end=torch.tensor([[2, 4, 3]]),
        teacher_start=torch.tensor([[1, 3, 0]]),
        teacher_end=torch.tensor([[3, 6, 5]]),
        mask=torch.tensor([[True, True, False]]),  # the third span is padding with a real-looking range
    )
    assert batch.num_spans == 3
    assert batch.student_token_mask(5).tolist() == ref_covers([[0, 2, 1]], [[2, 4, 3]], [[1, 1, 0]], 5)
    teacher = ref_covers([[1, 3, 0]], [[3, 6, 5]], [[1, 1, 0]], 6)
    assert batch.teacher_token_mask(6).tolist() == teacher
    assert batch.teacher_token_union(6).tolist() == [[any(span[t] for span in teacher[0]) for t in range(6)]]
    moved = batch.to("meta")
    tensors = (moved.student_start, moved.student_end, moved.teacher_start, moved.teacher_end, moved.mask)
    assert all(t.device.type == "meta" for t in tensors)
    assert [t.shape for t in tensors] == [(1, 3)] * 5 and moved.mask.dtype == torch.bool


# ---------------------------------------------------------------- TrajectoryAlignmentLoss refusals


def _pairs(*triples):
    return [SimpleNamespace(student=s, teacher=t, granularity=g) for s, t, g in triples]


def _batch(seq_s: int, seq_t: int):
    spans = {
        "word": SpanBatch(
            torch.tensor([[0, 1]]),
            torch.tensor([[1, 2]]),
            torch.tensor([[0, 1]]),
            torch.tensor([[1, 2]]),
            torch.tensor([[True, True]]),
        )
    }
    return torch.ones(1, seq_s, dtype=torch.long), torch.ones(1, seq_t, dtype=torch.long), spans


def test_trajectory_refusals_name_the_problem():
    with pytest.raises(
        MtaError, match=r"^the alignment loss needs at least one \(student, teacher, granularity\) layer pair$"
    ):
        TrajectoryAlignmentLoss([], 4, 6, same_tokenizer=True)
    with pytest.raises(MtaError, match=r"^importance 'mean' is not one of attention, uniform$"):
        TrajectoryAlignmentLoss(_pairs((1, 1, "word")), 4, 6, same_tokenizer=True, importance="mean")
    loss = TrajectoryAlignmentLoss(_pairs((1, 1, "word")), 4, 6, same_tokenizer=True)
    student_mask, teacher_mask, spans = _batch(3, 4)
    with pytest.raises(
        MtaError,
        match=(
            r"^same_tokenizer is set but the student sees 3 tokens and the teacher 4; "
            r"the batches must be built from the same ids$"
        ),
    ):
        loss([torch.zeros(1, 3, 4)] * 3, [torch.zeros(1, 4, 6)] * 3, student_mask, teacher_mask, spans)


@pytest.mark.parametrize(("terms", "same_tokenizer"), [(("dsa", "hra"), False), (("hra",), True)])
def test_a_missing_layer_names_the_side_and_the_layers_there_are(terms, same_tokenizer):
    """Hidden states as the HF tuple (listed as 0..N-1) or as {layer: tensor} (listed sorted);
    with token-level HRA alone the student's layer is first read in the pair loop."""
    student_mask, teacher_mask, spans = _batch(3, 3)
    student = [torch.randn(1, 3, 4) for _ in range(3)]
    teacher = {0: torch.randn(1, 3, 6), 2: torch.randn(1, 3, 6)}
    loss = TrajectoryAlignmentLoss(_pairs((5, 2, "word")), 4, 6, same_tokenizer=same_tokenizer, terms=terms)
    with pytest.raises(
        MtaError,
        match=(
            r"^aligned layer 5 is not among the student's hidden states \(0\.\.2\); "
            r"fix loss.layers in the recipe$"
        ),
    ):
        loss(student, teacher, student_mask, teacher_mask, spans)
    loss = TrajectoryAlignmentLoss(_pairs((1, 1, "word")), 4, 6, same_tokenizer=same_tokenizer, terms=terms)
    with pytest.raises(MtaError, match=r"^aligned layer 1 is not among the teacher's hidden states \(\[0, 2\]\); "):
        loss(student, teacher, student_mask, teacher_mask, spans)


# ---------------------------------------------------------------- token importance


def ref_importance(hidden: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """docs/method.md §2 with python floats: Ĥ = H / (std(H) + 1e-5) (unbiased std over the
    hidden dimension, H not centred), bidirectional softmax(Ĥ Ĥᵀ / √d) without the diagonal over
    the real tokens, the attention each token receives averaged over the real queries."""
    out = []
    dim = hidden.shape[-1]
    for b in range(hidden.shape[0]):
        real = [t for t in range(hidden.shape[1]) if mask[b, t]]
        weights = [0.0] * hidden.shape[1]
        if len(real) <= 1:
            out.append([1.0 if t in real else 0.0 for t in range(hidden.shape[1])])
            continue
        normed = {}
        for t in real:
            row = hidden[b, t].double().tolist()
            mean = sum(row) / dim
            std = math.sqrt(sum((x - mean) ** 2 for x in row) / max(dim - 1, 1))
            normed[t] = [x / (std + 1e-5) for x in row]
        for i in real:
            scores = {
                j: sum(x * y for x, y in zip(normed[i], normed[j], strict=True)) / math.sqrt(dim)
                for j in real
                if j != i
            }
            top = max(scores.values())
            total = sum(math.exp(s - top) for s in scores.values())
            for j, s in scores.items():
                weights[j] += math.exp(s - top) / total / len(real)
        out.append(weights)
    return out


@pytest.mark.parametrize("dim", [2, 5])
def test_token_importance_of_nearly_constant_states_and_of_two_dimensional_ones(dim):
    """States whose spread is of the order of ε (where ``+ ε`` matters) beside ordinary ones,
    and the smallest hidden size with a spread (d = 2, where the unbiased std divides by 1)."""
    generator = torch.Generator().manual_seed(18)
    hidden = torch.randn(2, 5, dim, generator=generator)
    hidden[0, 1] = hidden[0, 1] * 2e-5 + 0.3
    hidden[0, 3] = hidden[0, 3] * 1e-5 - 0.2
    hidden[1, 0] = hidden[1, 0] * 3e-5
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    got = token_importance(hidden, mask)
    torch.testing.assert_close(
        got.double(), torch.tensor(ref_importance(hidden, mask), dtype=torch.float64), atol=1e-6, rtol=1e-4
    )


def test_uniform_importance_lands_on_the_hidden_states_device_in_fp32():
    """``hidden`` gives the device (the mask may come from the collator's CPU tensors)."""
    mask = torch.tensor([[True, True, False], [False, False, False]])
    on_meta = uniform_importance(torch.zeros(2, 3, 4, device="meta"), mask)
    assert on_meta.device.type == "meta" and on_meta.dtype == torch.float32
    got = uniform_importance(torch.zeros(2, 3, 4), mask)
    assert got.dtype == torch.float32 and got.tolist() == [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize(("terms", "same_tokenizer"), [(("dsa", "hra"), False), (("dsa",), True), (("hra",), True)])
def test_the_token_union_is_built_only_for_token_level_hra(terms, same_tokenizer, monkeypatch):
    """Span-level HRA (different tokenizers) and DSA compare pooled spans: neither needs the
    union of the span tokens, so it is not built."""
    built = []
    union = SpanBatch.teacher_token_union
    monkeypatch.setattr(SpanBatch, "teacher_token_union", lambda self, n: (built.append(n), union(self, n))[1])
    student_mask, teacher_mask, spans = _batch(3, 3)
    loss = TrajectoryAlignmentLoss(_pairs((1, 1, "word")), 4, 6, same_tokenizer=same_tokenizer, terms=terms)
    got = loss([torch.randn(1, 3, 4)] * 2, [torch.randn(1, 3, 6)] * 2, student_mask, teacher_mask, spans)
    assert set(got) == set(terms) and all(torch.isfinite(v) for v in got.values())
    assert built == ([3] if same_tokenizer and "hra" in terms else [])


def _naive_uniform_dsa(student, teacher, salience, mask, reduction):
    """Every ordered pair i != j of spans with mask and positive salience weighs 1 (the authors'
    uniform-weights ablation), written as loops over the pairs."""
    per_sequence, gaps = [], []
    for b in range(student.shape[0]):
        kept = [i for i in range(student.shape[1]) if mask[b, i] and salience[b, i] > 0]
        here = []
        for i in kept:
            for j in kept:
                if i != j:
                    cos_s = torch.dot(student[b, i], student[b, j]) / (student[b, i].norm() * student[b, j].norm())
                    cos_t = torch.dot(teacher[b, i], teacher[b, j]) / (teacher[b, i].norm() * teacher[b, j].norm())
                    here.append(float((cos_s - cos_t) ** 2))
        gaps += here
        if here and int(mask[b].sum()) >= 2:
            per_sequence.append(sum(here) / len(here))
    if reduction == "batch":
        return sum(gaps) / len(gaps)
    return sum(per_sequence) / len(per_sequence)


@pytest.mark.parametrize("reduction", ["sequence", "batch"])
def test_dsa_uniform_pair_weights_weigh_every_pair_of_salient_spans_one(reduction):
    from mta.losses.dsa import dynamic_structural_alignment

    torch.manual_seed(0)
    student, teacher = torch.randn(3, 5, 4), torch.randn(3, 5, 6)
    salience = torch.rand(3, 5) + 0.1
    salience[0, 1] = 0.0  # a span without salience drops out of every pair
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, 1:] = False  # one span: no pair
    got = dynamic_structural_alignment(student, teacher, salience, mask, reduction=reduction, pair_weights="uniform")
    assert float(got) == pytest.approx(_naive_uniform_dsa(student, teacher, salience, mask, reduction), rel=1e-5)
    # Uniform: the salience's size does not matter; the default weighs pairs by it.
    rescaled = salience * torch.tensor([1.0, 7.0, 0.2, 3.0, 0.5])
    again = dynamic_structural_alignment(student, teacher, rescaled, mask, reduction=reduction, pair_weights="uniform")
    assert float(again) == pytest.approx(float(got), rel=1e-6)
    weighted = dynamic_structural_alignment(student, teacher, rescaled, mask, reduction=reduction)
    assert float(weighted) != pytest.approx(float(got), rel=1e-3)


def test_hra_batch_reduction_is_one_weighted_mean_over_every_masked_item():
    from mta.losses.hra import hidden_representation_alignment

    torch.manual_seed(1)
    student = torch.randn(2, 4, 6, requires_grad=True)
    teacher = torch.randn(2, 4, 6)
    weights = torch.tensor([[0.5, 2.0, 0.0, 1.0], [3.0, 0.1, 0.2, 0.4]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, True]])
    got = hidden_representation_alignment(student, teacher, weights, mask, reduction="batch")
    total, weight = 0.0, 0.0
    for b in range(2):
        for i in range(4):
            if mask[b, i]:
                cos = torch.dot(student[b, i], teacher[b, i]) / (student[b, i].norm() * teacher[b, i].norm())
                total += float(weights[b, i] * (1 - cos))
                weight += float(weights[b, i])
    assert float(got) == pytest.approx(total / weight, rel=1e-5)
    # Not the per-sequence mean: the sequences' weight sums differ.
    per_sequence = hidden_representation_alignment(student, teacher, weights, mask)
    assert float(per_sequence) != pytest.approx(float(got), rel=1e-3)
    # No weight anywhere: a zero that keeps the graph, not a NaN.
    nothing = hidden_representation_alignment(student, teacher, torch.zeros(2, 4), mask, reduction="batch")
    nothing.backward()
    assert float(nothing) == 0.0 and student.grad is not None and torch.isfinite(student.grad).all()
