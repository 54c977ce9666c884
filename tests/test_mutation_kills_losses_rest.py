"""The last corners of ``mta.losses`` (kd, chunked, span_masks, importance, trajectory) that mutation
testing (bench/mutation.py) found unpinned.

The documented defaults of the base losses (a chunk of ``loss.chunk_size`` = 128 positions,
``distillm2_beta`` = 1.0) and the options ``build_base_loss`` hands to DistiLLM-2; the gradient of
float64 logits (kept in their own dtype); how many real spans each teacher token lies in; the
authors' importance reading a non-finite padding state as zeros; their uniform-weights HRA counting
only the memberships of real tokens; and the exact messages of refused projectors and teacher-less
token losses. Expected values come from python floats and loops over the formulas of the module
docstrings and docs/method.md (§2, §5, §8), not from the code under test.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fixtures.losses import exactly, kl, softmax
from fixtures.talas_losses import cos
from mta.errors import MtaError
from mta.losses import SpanBatch, TrajectoryAlignmentLoss, build_base_loss, token_importance
from mta.losses.kd import ForwardKL, JensenShannon
from mta.losses.trajectory import projector_at

# ---------------------------------------------------------------- python-float references


# ---------------------------------------------------------------- base losses (kd.py)


def _spy_on_chunks(loss: nn.Module) -> list[int]:
    """The number of rows of each chunk ``loss`` hands its ``token_loss``."""
    seen: list[int] = []
    inner = loss.token_loss

    def spied(student, teacher, labels):
        seen.append(student.shape[0])
        return inner(student, teacher, labels)

    loss.token_loss = spied
    return seen


@pytest.mark.parametrize("made_by", ["class", "factory"])
def test_a_base_loss_built_without_chunk_size_visits_the_response_positions_128_at_a_time(made_by):
    """``loss.chunk_size`` defaults to 128 (docs/recipe-keys.md, docs/python-api.md), for the
    classes as for ``build_base_loss``: 2 × 65 response positions are one chunk of 128 and one of 2."""
    generator = torch.Generator().manual_seed(21)
    student, teacher = torch.randn(2, 66, 3, generator=generator), torch.randn(2, 66, 3, generator=generator)
    labels = torch.zeros(2, 66, dtype=torch.long)
    labels[:, 0] = -100
    loss = ForwardKL() if made_by == "class" else build_base_loss("fkl")
    seen = _spy_on_chunks(loss)
    loss(student, teacher, labels)
    assert seen == [128, 2]


def test_the_token_loss_of_a_divergence_without_teacher_logits_names_the_loss():
    """The per-token function is handed to the chunked loop; without teacher logits it says so."""
    with pytest.raises(MtaError, match=exactly("JensenShannon compares with a teacher; teacher logits are None")):
        JensenShannon().token_loss(torch.zeros(2, 3), None, torch.zeros(2, dtype=torch.long))


def _distillm2_batch():
    """Two chosen and two rejected rows with 3, 1, 2 and 3 response tokens."""
    generator = torch.Generator().manual_seed(22)
    student = torch.randn(4, 4, 5, generator=generator) * 2
    teacher = torch.randn(4, 4, 5, generator=generator) * 2
    labels = torch.tensor([[-100, 1, 2, 3], [-100, -100, -100, 4], [-100, 0, 1, -100], [-100, 2, 2, 2]])
    chosen = torch.tensor([True, True, False, False])
    return student, teacher, labels, chosen


def ref_distillm2(student, teacher, labels, chosen, *, beta: float, alpha: float, tau: float) -> float:
    """docs/method.md §5: (2 − β)·mean over chosen rows of the token-mean KL(p ‖ αp + (1−α)q) +
    β·mean over rejected rows of the token-mean KL(q ‖ αq + (1−α)p), at temperature τ."""
    chosen_rows, rejected_rows = [], []
    for b in range(labels.shape[0]):
        values = []
        for t in range(labels.shape[1]):
            if labels[b, t] == -100:
                continue
            q, p = softmax(student[b, t].tolist(), tau), softmax(teacher[b, t].tolist(), tau)
            if chosen[b]:
                values.append(kl(p, [alpha * x + (1 - alpha) * y for x, y in zip(p, q, strict=True)]))
            else:
                values.append(kl(q, [alpha * y + (1 - alpha) * x for x, y in zip(p, q, strict=True)]))
        (chosen_rows if chosen[b] else rejected_rows).append(sum(values) / len(values))
    return (2 - beta) * sum(chosen_rows) / len(chosen_rows) + beta * sum(rejected_rows) / len(rejected_rows)


def test_distillm2_from_the_factory_defaults_to_beta_one_and_alpha_a_tenth():
    """``distillm2_beta`` = 1.0 and ``skew_alpha`` = 0.1 (docs/method.md §5, the published trainer):
    both halves of the pair weigh the same."""
    student, teacher, labels, chosen = _distillm2_batch()
    got = build_base_loss("distillm2")(student, teacher, labels, chosen).item()
    expected = ref_distillm2(student, teacher, labels, chosen, beta=1.0, alpha=0.1, tau=1.0)
    assert got == pytest.approx(expected, rel=1e-5)


def test_distillm2_from_the_factory_uses_the_given_beta_skew_alpha_and_temperature():
    student, teacher, labels, chosen = _distillm2_batch()
    options = dict(distillm2_beta=0.5, skew_alpha=0.3, temperature=2.0)
    got = build_base_loss("distillm2", **options)(student, teacher, labels, chosen).item()
    expected = ref_distillm2(student, teacher, labels, chosen, beta=0.5, alpha=0.3, tau=2.0)
    assert got == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------- chunked backward (chunked.py)


def test_the_gradient_of_float64_logits_is_float64_and_only_on_the_compared_vocabulary():
    """The gradient is kept in the logits' own dtype (mta.losses.chunked): for float64 logits a
    float64 tensor, d mean KL(p‖q) / d student = (q − p) / tokens on the response positions and
    the first ``vocab_size`` entries (here the teacher's narrower width), 0 elsewhere."""
    generator = torch.Generator().manual_seed(23)
    student = torch.randn(2, 3, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64)
    labels = torch.tensor([[-100, 1, 2], [3, -100, 4]])
    ForwardKL(chunk_size=2)(student, teacher, labels).backward()
    assert student.grad.dtype == torch.float64
    expected = torch.zeros(2, 3, 6, dtype=torch.float64)
    for b, t in [(0, 1), (0, 2), (1, 0), (1, 2)]:
        q, p = softmax(student[b, t, :5].tolist()), softmax(teacher[b, t].tolist())
        expected[b, t, :5] = torch.tensor([(x - y) / 4 for x, y in zip(q, p, strict=True)], dtype=torch.float64)
    assert torch.allclose(student.grad, expected, atol=1e-7, rtol=1e-5), (student.grad - expected).abs().max()


# ---------------------------------------------------------------- span cover counts (span_masks.py)


def test_teacher_token_count_counts_each_token_once_per_real_span_and_never_for_padding_spans():
    """Overlapping and duplicate spans count once each, an empty or reversed range covers nothing,
    and a padding span (mask False) counts nowhere, whatever its range."""
    starts = [[0, 1, 1, 3, 0, 2], [2, 0, 4, 1, 0, 0]]
    ends = [[3, 4, 4, 3, 5, 1], [4, 5, 6, 3, 0, 0]]
    mask = [[True, True, True, True, False, True], [True, False, True, True, True, False]]
    seq_len = 5
    batch = SpanBatch(
        torch.tensor(starts) + 7, torch.tensor(ends) + 7, torch.tensor(starts), torch.tensor(ends), torch.tensor(mask)
    )
    expected = [
        [sum(1 for k in range(6) if mask[b][k] and starts[b][k] <= t < ends[b][k]) for t in range(seq_len)]
        for b in range(2)
    ]
    counts = batch.teacher_token_count(seq_len)
    assert counts.tolist() == expected
    assert counts.dtype == torch.int32  # as documented: a count per token, never int64


# ---------------------------------------------------------------- token importance (importance.py)


def ref_padding_row_importance(hidden: torch.Tensor, mask: list[list[int]]) -> list[list[float]]:
    """The authors' token weights (docs/method.md §8, ``padding_queries``) with python floats: each
    state scaled by 1 / (unbiased std + 1e-5), a state with non-finite values read as zeros; every
    row of the padded batch asks (softmax over the real tokens but itself, scores / √d) and the
    weights are the mean over all rows; a sequence with at most one real token keeps its mask."""
    out = []
    dim = hidden.shape[-1]
    for b, row_mask in enumerate(mask):
        length = len(row_mask)
        if sum(row_mask) <= 1:
            out.append([float(m) for m in row_mask])
            continue
        normed = []
        for t in range(length):
            state = hidden[b, t].double().tolist()
            if not all(math.isfinite(x) for x in state):
                normed.append([0.0] * dim)
                continue
            mean = sum(state) / dim
            std = math.sqrt(sum((x - mean) ** 2 for x in state) / (dim - 1))
            normed.append([x / (std + 1e-5) for x in state])
        weights = [0.0] * length
        for s in range(length):
            keys = [j for j in range(length) if row_mask[j] and j != s]
            scores = [sum(x * y for x, y in zip(normed[s], normed[j], strict=True)) / math.sqrt(dim) for j in keys]
            for j, a in zip(keys, softmax(scores), strict=True):
                weights[j] += a / length
        out.append(weights)
    return out


def test_the_authors_importance_reads_a_non_finite_padding_state_as_zeros():
    """A padding row whose state is NaN (a fully masked attention row can give one) asks as a
    zero state: it spreads its attention evenly over the real tokens."""
    generator = torch.Generator().manual_seed(24)
    hidden = torch.randn(2, 4, 3, generator=generator) * 2 + 0.5
    hidden[0, 3] = float("nan")
    hidden[1, 2] = float("inf")
    mask = [[1, 1, 1, 0], [1, 1, 0, 0]]
    got = token_importance(hidden, torch.tensor(mask), padding_queries=True)
    expected = torch.tensor(ref_padding_row_importance(hidden, mask), dtype=torch.float64)
    assert torch.allclose(got.double(), expected, atol=1e-6, rtol=1e-5), (got.double() - expected).abs().max()


# ---------------------------------------------------------------- the alignment loss (trajectory.py)


def _pairs(*triples):
    return [SimpleNamespace(student=s, teacher=t, granularity=g) for s, t, g in triples]


def test_asking_a_loss_without_hra_for_a_projector_is_refused_by_name():
    loss = TrajectoryAlignmentLoss(_pairs((1, 1, "word")), 4, 6, same_tokenizer=True, terms=("dsa",))
    assert loss.projectors is None
    with pytest.raises(MtaError, match=exactly("this alignment loss was built without 'hra', so it has no projectors")):
        loss._projector(0)


def test_a_projector_that_is_not_a_linear_layer_is_refused_with_its_index_and_type():
    projectors = nn.ModuleList([nn.Linear(2, 3), nn.Sequential(nn.Linear(2, 3))])
    assert projector_at(projectors, 0) is projectors[0]
    with pytest.raises(MtaError, match=exactly("projector 1 is a Sequential, not an nn.Linear")):
        projector_at(projectors, 1)


def test_the_authors_uniform_hra_counts_only_the_memberships_of_real_tokens():
    """``reference_code`` with ``importance="uniform"`` (their ablation, docs/method.md §8): HRA is
    one unweighted mean of 1 − cos(P s_t, t_t) over the batch's (token, span) memberships, a token
    once per span it lies in, and only real tokens are members (theirs selects them with the
    attention mask): the parts of spans that reach into the padding count nowhere."""
    generator = torch.Generator().manual_seed(25)
    student = [torch.randn(2, 5, 3, generator=generator) for _ in range(2)]
    teacher = [torch.randn(2, 5, 4, generator=generator) for _ in range(2)]
    attention = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    ranges = [[(0, 2), (1, 5), (0, 0)], [(2, 5), (0, 1), (3, 5)]]
    real = [[True, True, False], [True, True, True]]
    start = torch.tensor([[a for a, _ in row] for row in ranges])
    end = torch.tensor([[e for _, e in row] for row in ranges])
    spans = {"word": SpanBatch(start, end, start.clone(), end.clone(), torch.tensor(real))}
    loss = TrajectoryAlignmentLoss(
        _pairs((1, 1, "word")), 3, 4, same_tokenizer=True, importance="uniform", terms=("hra",), reference_code=True
    )
    got = loss(student, teacher, attention, attention, spans)["hra"].item()

    weight, bias = loss.projectors[0].weight.double().tolist(), loss.projectors[0].bias.double().tolist()
    distances = []
    for b in range(2):
        for k, (a, e) in enumerate(ranges[b]):
            for t in range(a, e):
                if real[b][k] and attention[b, t]:
                    s = student[1][b, t].double().tolist()
                    projected = [
                        sum(w * x for w, x in zip(row, s, strict=True)) + c for row, c in zip(weight, bias, strict=True)
                    ]
                    distances.append(1 - cos(projected, teacher[1][b, t].double().tolist()))
    assert len(distances) == 7
    assert got == pytest.approx(sum(distances) / len(distances), rel=1e-5)
