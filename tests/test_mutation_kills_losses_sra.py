"""Edge cases of SRA (``mta.losses.sra``) that mutation testing (bench/mutation.py) found unchecked.

The centre-of-mass fallbacks at their boundaries (a one-token span, a mass of exactly
``MASS_EPS``), the last real token of a sequence whose only real token is the first, the shared
vocabulary's space mapping, empty result and tokenizer wrapper, the constructor's and forward's
refusals with their messages, the dtype each head sees, vectors shorter than ``COS_EPS``, spans
out of scope whose states overflow fp32, and results under another default device. Expected
values are hand-derived or come from python floats and loops (the module docstrings), never from
the code under test; the default-device check compares the code with itself under another
default, since what it pins is that the result does not depend on it.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from mta.errors import MtaError
from mta.losses.dsa import COS_EPS
from mta.losses.pooling import MASS_EPS
from mta.losses.span_masks import SpanBatch
from mta.losses.sra import (
    SpanRepresentationLoss,
    centre_weights,
    last_token_attention,
    shared_vocabulary,
    span_centres,
    tokenizers_shared_vocabulary,
)


def span_batch(rows: list[list[tuple[tuple[int, int], tuple[int, int]]]]) -> SpanBatch:
    """Per sequence a list of ((student start, end), (teacher start, end)); padded with empty spans."""
    num = max(len(row) for row in rows)
    tensors = [torch.zeros(len(rows), num, dtype=torch.long) for _ in range(4)]
    mask = torch.zeros(len(rows), num, dtype=torch.bool)
    for b, row in enumerate(rows):
        for k, ((ss, se), (ts, te)) in enumerate(row):
            for tensor, value in zip(tensors, (ss, se, ts, te), strict=True):
                tensor[b, k] = value
            mask[b, k] = True
    return SpanBatch(*tensors, mask)


def assert_close(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    """Same shape, dtype and device, values within fp32 rounding (cheaper than torch.testing's)."""
    assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device, msg
    assert torch.allclose(got, want, rtol=1.3e-6, atol=1e-5), msg


def identity_loss(width: int, **kwargs) -> SpanRepresentationLoss:
    """One layer pair whose projector is the identity (student and teacher of the same width)."""
    loss = SpanRepresentationLoss(1, width, width, **kwargs)
    with torch.no_grad():
        loss.projectors[0].weight.copy_(torch.eye(width))
        loss.projectors[0].bias.zero_()
    return loss


# ---------------------------------------------------------------- centres


def test_a_light_one_token_span_is_its_token_and_a_mass_of_exactly_mass_eps_takes_the_plain_mean():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 5.0], [7.0, 11.0]]])
    spans = span_batch([[((0, 1), (0, 1)), ((1, 3), (1, 3))]])
    # token 0 weighs 0 (span 0: plain mean of one token); span 1 weighs exactly MASS_EPS (in fp32),
    # "at most MASS_EPS": the plain mean, not the weighted one (which would be token 1 alone).
    weights = torch.tensor([[0.0, MASS_EPS, 0.0]])
    token_mask = spans.student_token_mask(3)
    matrix, mass = centre_weights(token_mask, weights)
    assert matrix.tolist() == [[[1.0, 0.0, 0.0], [0.0, 0.5, 0.5]]]
    assert mass[0, 0].item() == 0.0 and mass[0, 1].item() == pytest.approx(MASS_EPS, rel=1e-6)
    centres = span_centres(hidden, token_mask, weights)
    assert centres.tolist() == [[[1.0, 2.0], [5.0, 8.0]]]


# ---------------------------------------------------------------- last_token_attention


def ref_last_token_attention(attentions: torch.Tensor, mask: list[list[int]]) -> list[list[float]]:
    out = []
    for b, row in enumerate(mask):
        real = [t for t, m in enumerate(row) if m]
        if not real:
            out.append([0.0] * len(row))
            continue
        last = real[-1]
        heads = attentions.shape[1]
        out.append([sum(float(attentions[b, h, last, t]) for h in range(heads)) * row[t] for t in range(len(row))])
    return out


def test_last_token_attention_reads_row_zero_when_only_the_first_token_is_real():
    attentions = torch.rand(3, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    mask = [[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]
    got = last_token_attention(attentions, torch.tensor(mask))
    want = ref_last_token_attention(attentions, mask)
    assert_close(got, torch.tensor(want))
    assert got[0, 0].item() > 0  # the first token's own attention row, not row 1


def test_last_token_attention_follows_the_inputs_device_not_the_default_one():
    attentions = torch.rand(2, 2, 3, 3, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    expected = last_token_attention(attentions, mask)
    with torch.device("meta"):
        got = last_token_attention(attentions, mask)
    assert got.device == expected.device
    assert_close(got, expected)


# ---------------------------------------------------------------- shared vocabulary


def test_space_markers_match_a_literal_space():
    s_ids, t_ids = shared_vocabulary({"Ġthe": 0, "cat": 1}, {" the": 4, "▁cat": 2})
    assert list(zip(s_ids.tolist(), t_ids.tolist(), strict=True)) == [(0, 4)]


def test_an_empty_shared_vocabulary_is_still_two_long_tensors():
    s_ids, t_ids = shared_vocabulary({"a": 0}, {"b": 0})
    assert s_ids.dtype == t_ids.dtype == torch.long
    assert s_ids.shape == t_ids.shape == (0,)


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int], special: list[str]) -> None:
        self._vocab, self._special = vocab, special

    @property
    def all_special_tokens(self) -> list[str]:
        return list(self._special)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


def test_tokenizers_shared_vocabulary_reads_each_sides_vocabulary_and_special_tokens():
    # "<s>" is special on both sides: matched; "</s>" is special for the teacher only: unmatched;
    # "Ġa" / "▁a" match as " a"; "b" exists on the student side only.
    student = FakeTokenizer({"<s>": 0, "Ġa": 1, "</s>": 2, "b": 3}, ["<s>"])
    teacher = FakeTokenizer({"<s>": 5, "▁a": 3, "</s>": 4}, ["<s>", "</s>"])
    s_ids, t_ids = tokenizers_shared_vocabulary(student, teacher)
    assert s_ids.dtype == t_ids.dtype == torch.long
    assert list(zip(s_ids.tolist(), t_ids.tolist(), strict=True)) == [(0, 5), (1, 3)]
    # the other way round, the pairs swap sides
    s_ids, t_ids = tokenizers_shared_vocabulary(teacher, student)
    assert list(zip(s_ids.tolist(), t_ids.tolist(), strict=True)) == [(3, 1), (5, 0)]


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        ((0, 2, 2), {}, "SRA needs at least one (student, teacher) layer pair, got 0"),
        ((1, 2, 2), {"temperature": 0.0}, "the SRA logit temperature must be positive, got 0.0"),
        ((1, 2, 2), {"temperature": -1.0}, "the SRA logit temperature must be positive, got -1.0"),
        ((1, 2, 2), {"geometry_weight": -1.0}, "SRA term weights must be >= 0, got geometry -1.0, logit 1.0"),
        ((1, 2, 2), {"logit_weight": -0.5}, "SRA term weights must be >= 0, got geometry 50.0, logit -0.5"),
    ],
)
def test_bad_constructor_options_are_refused_with_the_value(args, kwargs, message):
    with pytest.raises(MtaError, match=f"^{re.escape(message)}$"):
        SpanRepresentationLoss(*args, **kwargs)


def test_zero_term_weights_are_allowed():
    loss = SpanRepresentationLoss(1, 2, 2, geometry_weight=0.0, logit_weight=0.0)
    assert (loss.geometry_weight, loss.logit_weight) == (0.0, 0.0)
    assert SpanRepresentationLoss(1, 2, 2, geometry_weight=0.0).geometry_weight == 0.0
    assert SpanRepresentationLoss(1, 2, 2, logit_weight=0.0).logit_weight == 0.0


def small_case(pairs: int = 1, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(2)
    spans = span_batch([[((0, 1), (0, 2)), ((1, 3), (2, 3))]])
    student = [torch.randn(1, 3, 2, generator=generator).to(dtype) for _ in range(pairs)]
    teacher = [torch.randn(1, 3, 3, generator=generator).to(dtype) for _ in range(pairs)]
    weights = torch.ones(1, 3)
    return student, teacher, weights, weights.clone(), spans, torch.ones(1, 2, dtype=torch.bool)


def test_a_wrong_number_of_teacher_states_alone_is_refused():
    student, teacher, *rest = small_case(pairs=2)
    loss = SpanRepresentationLoss(2, 2, 3)
    with pytest.raises(MtaError, match="got 2 student and 1 teacher hidden states"):
        loss(student, teacher[:1], *rest)
    with pytest.raises(MtaError, match="got 1 student and 2 teacher hidden states"):
        loss(student[:1], teacher, *rest)


def test_the_logit_term_with_one_head_missing_is_refused_by_name():
    student, teacher, *rest = small_case()
    loss = SpanRepresentationLoss(1, 2, 3)
    shared = (torch.tensor([0]), torch.tensor([0]))
    head = lambda hidden, ids: hidden[:, :1]  # noqa: E731
    message = "^" + re.escape("the SRA logit term needs both the student's and the teacher's head") + "$"
    for student_head, teacher_head in ((head, None), (None, head)):
        with pytest.raises(MtaError, match=message):
            loss(student, teacher, *rest, student_head=student_head, teacher_head=teacher_head, shared_vocab=shared)


def test_each_head_sees_its_own_sides_hidden_dtype():
    student, teacher, *rest = small_case()
    student = [student[0].bfloat16()]
    teacher = [teacher[0].half()]
    seen = {}

    def recording(side):
        def head(hidden, ids):
            seen[side] = hidden.dtype
            return hidden.float()[:, ids]

        return head

    shared = (torch.tensor([0, 1]), torch.tensor([2, 0]))
    heads = {"student_head": recording("student"), "teacher_head": recording("teacher")}
    out = SpanRepresentationLoss(1, 2, 3)(student, teacher, *rest, **heads, shared_vocab=shared)
    assert seen == {"student": torch.bfloat16, "teacher": torch.float16}
    assert out["sra_logit"].dtype == torch.float32 and torch.isfinite(out["sra_logit"])


# ---------------------------------------------------------------- cosine floor, scope, device


def cosine_with_floor(a: list[float], b: list[float]) -> float:
    """F.normalize's contract: v / max(|v|, eps), here eps = COS_EPS."""
    norm_a = max(math.sqrt(sum(x * x for x in a)), COS_EPS)
    norm_b = max(math.sqrt(sum(x * x for x in b)), COS_EPS)
    return sum(x * y for x, y in zip(a, b, strict=True)) / (norm_a * norm_b)


@pytest.mark.parametrize(
    "student,teacher",
    [([3e-10, 4e-10], [1.0, 0.0]), ([3.0, 4.0], [0.0, 2e-10])],
    ids=["short student centre", "short teacher centre"],
)
def test_a_centre_shorter_than_cos_eps_is_divided_by_cos_eps_not_by_its_norm(student, teacher):
    """A span term of ``1 − cos`` where one side is shorter than COS_EPS: its cosine is damped
    (the vector is measured against COS_EPS), so near-zero centres count as nearly orthogonal."""
    loss = identity_loss(2)
    spans = span_batch([[((0, 1), (0, 1))]])
    out = loss(
        [torch.tensor([[student]])],
        [torch.tensor([[teacher]])],
        torch.ones(1, 1),
        torch.ones(1, 1),
        spans,
        torch.ones(1, 1, dtype=torch.bool),
    )
    expected = 1.0 - cosine_with_floor(student, teacher)
    assert expected > 0.95  # the floor matters: the plain cosine would give 0.4 / 0.2
    assert out["sra_span"].item() == pytest.approx(expected, rel=1e-5)


def test_student_states_of_a_span_out_of_scope_are_never_read_even_when_they_overflow():
    """Spans out of scope contribute nothing: states that would overflow fp32 once projected
    leave every value and the gradient of the in-scope tokens as they are."""
    loss = SpanRepresentationLoss(1, 2, 2)
    with torch.no_grad():
        loss.projectors[0].weight.fill_(1.0)  # 3e38 + 3e38 overflows
        loss.projectors[0].bias.zero_()
    spans = span_batch([[((0, 1), (0, 1)), ((1, 2), (1, 2)), ((2, 4), (2, 4))]])
    scope = torch.tensor([[True, True, False]])
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(1, 4, 2, generator=generator)
    teacher = torch.randn(1, 4, 2, generator=generator)
    weights = torch.rand(1, 4, generator=generator) + 0.5

    def run(student):
        leaf = student.clone().requires_grad_(True)
        out = loss([leaf], [teacher], weights, weights, spans, scope)
        (grad,) = torch.autograd.grad(out["sra"], leaf)
        return out, grad

    huge = base.clone()
    huge[0, 2:] = 3e38
    ordinary, ordinary_grad = run(base)
    overflowing, overflowing_grad = run(huge)
    for key, value in ordinary.items():
        assert torch.isfinite(overflowing[key]), key
        assert_close(overflowing[key], value, msg=key)
    assert_close(overflowing_grad, ordinary_grad)
    assert torch.count_nonzero(ordinary_grad[0, 2:]) == 0 and torch.count_nonzero(ordinary_grad[0, :2]) > 0


def test_results_stay_on_the_inputs_device_under_another_default_device():
    student, teacher, *rest = small_case()
    loss = SpanRepresentationLoss(1, 2, 3)
    expected = loss(student, teacher, *rest)
    with torch.device("meta"):
        got = loss(student, teacher, *rest)
    for key, value in expected.items():
        assert got[key].device == value.device and got[key].dtype == torch.float32, key
        assert_close(got[key], value, msg=key)
