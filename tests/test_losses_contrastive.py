"""DistiLLM-2's contrastive loss against a loop-based float64 reference (and the chunked
machinery's optional per-token weights it relies on)."""

from __future__ import annotations

import pytest
import torch

from mta.errors import MtaError
from mta.losses.chunked import chunked_token_loss
from mta.losses.contrastive import DistiLLM2Loss
from mta.losses.kd import SkewForwardKL, SkewReverseKL

VOCAB = 11


def ref_loss(
    student,
    teacher,
    labels,
    chosen,
    *,
    beta=1.0,
    alpha=0.1,
    tau=1.0,
    vocab=VOCAB,
    stop_gradient=True,
    per_sequence=True,
):
    """Straight from the formulas, looping over rows and tokens in float64.

    chosen rows: KL(p ‖ αp + (1−α)q); rejected rows: KL(q ‖ α·sg(q) + (1−α)p); each row's
    token mean, then the mean over that kind's rows with tokens; (2−β)·chosen + β·rejected.
    ``per_sequence=False`` is the wrong global token mean (to show the tests tell them apart).
    """
    s = student[..., :vocab].double()
    t = teacher[..., :vocab].double()
    rows = {True: [], False: []}
    for b in range(labels.shape[0]):
        values = []
        for i in range(labels.shape[1]):
            if int(labels[b, i]) == -100:
                continue
            q = torch.softmax(s[b, i] / tau, dim=-1)
            p = torch.softmax(t[b, i] / tau, dim=-1)
            if bool(chosen[b]):
                m = alpha * p + (1 - alpha) * q
                values.append((p * (p.log() - m.log())).sum())
            else:
                m = alpha * (q.detach() if stop_gradient else q) + (1 - alpha) * p
                values.append((q * (q.log() - m.log())).sum())
        if values:
            rows[bool(chosen[b])].append(sum(values) / len(values) if per_sequence else values)
    if not per_sequence:
        for kind in rows:
            tokens = [v for row in rows[kind] for v in row]
            rows[kind] = [sum(tokens) / len(tokens)] if tokens else []
    total = torch.zeros((), dtype=torch.float64)
    if rows[True]:
        total = total + (2 - beta) * sum(rows[True]) / len(rows[True])
    if rows[False]:
        total = total + beta * sum(rows[False]) / len(rows[False])
    return total


def batch(seed=0, width=VOCAB, teacher_width=None, scale=2.0):
    """Rows 0-2 chosen, rows 3-5 rejected; prompts, padding, unequal lengths, an empty row."""
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(6, 7, width, generator=generator) * scale
    teacher = torch.randn(6, 7, teacher_width or width, generator=generator) * scale
    labels = torch.randint(0, VOCAB, (6, 7), generator=generator)
    labels[0, :2] = -100  # prompt
    labels[1, :6] = -100  # a one-token response
    labels[2, 5:] = -100  # padding
    labels[3, :3] = -100
    labels[3, 5] = -100  # padding in the middle
    labels[4, :] = -100  # a rejected row with no response token
    labels[5, :1] = -100
    chosen = torch.tensor([True, True, True, False, False, False])
    return student, teacher, labels, chosen


def value_and_grad(loss_fn, student, teacher, labels, chosen):
    leaf = student.clone().requires_grad_()
    loss = loss_fn(leaf, teacher, labels, chosen)
    loss.backward()
    return loss.detach(), leaf.grad


def ref_value_and_grad(student, teacher, labels, chosen, **kwargs):
    leaf = student.double().clone().requires_grad_()
    loss = ref_loss(leaf, teacher, labels, chosen, **kwargs)
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize(
    "beta,alpha,tau", [(1.0, 0.1, 1.0), (0.5, 0.3, 1.0), (1.7, 0.1, 2.0), (1.0, 0.0, 1.0), (1.3, 1.0, 0.7)]
)
def test_value_and_gradient_match_the_loop_reference(beta, alpha, tau):
    student, teacher, labels, chosen = batch(0)
    loss_fn = DistiLLM2Loss(beta=beta, skew_alpha=alpha, temperature=tau, chunk_size=4)
    got, grad = value_and_grad(loss_fn, student, teacher, labels, chosen)
    expected, expected_grad = ref_value_and_grad(student, teacher, labels, chosen, beta=beta, alpha=alpha, tau=tau)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert got.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad.double(), expected_grad, atol=1e-6, rtol=1e-4)
    assert torch.all(grad[labels == -100] == 0)  # padding, prompt and the empty row
    assert torch.all(grad[4] == 0)


def test_the_stop_gradient_is_inside_the_reverse_mixture_only():
    """Without the detach the gradient differs: the reference above would catch its loss."""
    student, teacher, labels, chosen = batch(1)
    _, grad = value_and_grad(DistiLLM2Loss(skew_alpha=0.3), student, teacher, labels, chosen)
    _, without = ref_value_and_grad(student, teacher, labels, chosen, alpha=0.3, stop_gradient=False)
    rejected = ~chosen
    assert (grad[rejected].double() - without[rejected]).abs().max() > 1e-3
    # The chosen rows' skew forward KL keeps the gradient through q in its mixture.
    _, with_sg = ref_value_and_grad(student, teacher, labels, chosen, alpha=0.3)
    torch.testing.assert_close(grad[chosen].double(), with_sg[chosen], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [1, 2, 10**6])
def test_chunked_equals_unchunked(chunk_size):
    student, teacher, labels, chosen = batch(2)
    whole = value_and_grad(DistiLLM2Loss(beta=0.8, chunk_size=10**6), student, teacher, labels, chosen)
    seen = []
    loss_fn = DistiLLM2Loss(beta=0.8, chunk_size=chunk_size)
    inner = loss_fn._token_loss
    loss_fn._token_loss = lambda s, t, k: (seen.append(s.shape[0]), inner(s, t, k))[1]
    got = value_and_grad(loss_fn, student, teacher, labels, chosen)
    assert max(seen) <= chunk_size  # never more than chunk_size positions in fp32 at once
    torch.testing.assert_close(got[0], whole[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], whole[1], atol=1e-7, rtol=1e-5)


def test_vocab_size_narrower_than_the_logits():
    student, teacher, labels, chosen = batch(3, width=VOCAB + 3, teacher_width=VOCAB + 5)
    student[..., VOCAB:] = 40.0  # padded embedding rows: garbage that must never count
    teacher[..., VOCAB:] = -40.0
    got, grad = value_and_grad(DistiLLM2Loss(vocab_size=VOCAB, chunk_size=3), student, teacher, labels, chosen)
    expected, expected_grad = ref_value_and_grad(student, teacher, labels, chosen)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.all(grad[..., VOCAB:] == 0)
    assert torch.all(expected_grad[..., VOCAB:] == 0)
    torch.testing.assert_close(grad.double(), expected_grad, atol=1e-6, rtol=1e-4)
    # Default: the narrower width, here the student's (which still includes its garbage).
    default = DistiLLM2Loss()(student, teacher, labels, chosen)
    assert default.item() == pytest.approx(ref_loss(student, teacher, labels, chosen, vocab=VOCAB + 3).item(), rel=1e-5)
    with pytest.raises(MtaError, match="exceeds the logits width"):
        DistiLLM2Loss(vocab_size=VOCAB + 4)(student, teacher, labels, chosen)


def test_bf16_logits_are_close_to_fp32():
    student, teacher, labels, chosen = batch(4)
    low = student.bfloat16()
    got, grad = value_and_grad(DistiLLM2Loss(chunk_size=5), low, teacher.bfloat16(), labels, chosen)
    assert got.dtype == torch.float32 and grad.dtype == torch.bfloat16
    # The fp32 loss of the very same (bf16-rounded) values: only the stored gradient is bf16.
    wide, wide_grad = value_and_grad(
        DistiLLM2Loss(chunk_size=5), low.float(), teacher.bfloat16().float(), labels, chosen
    )
    assert got.item() == pytest.approx(wide.item(), rel=1e-6)
    torch.testing.assert_close(grad.float(), wide_grad, atol=1e-4, rtol=1e-2)
    # And close to the loss of the unrounded fp32 logits.
    full, _ = value_and_grad(DistiLLM2Loss(), student, teacher, labels, chosen)
    assert got.item() == pytest.approx(full.item(), rel=3e-2)


def per_row_mean(loss_cls, student, teacher, labels, rows):
    """The existing kd losses, one row at a time (their token mean), averaged over rows."""
    values = [
        loss_cls(skew_alpha=0.2)(student[b : b + 1], teacher[b : b + 1], labels[b : b + 1])
        for b in rows
        if (labels[b] != -100).any()
    ]
    return sum(values) / len(values)


def test_beta_zero_is_the_skew_forward_kl_on_the_teacher_responses():
    student, teacher, labels, chosen = batch(5)
    loss_fn = DistiLLM2Loss(beta=0.0, skew_alpha=0.2)
    seen = []
    inner = loss_fn._token_loss
    loss_fn._token_loss = lambda s, t, k: (seen.append(k), inner(s, t, k))[1]
    got, grad = value_and_grad(loss_fn, student, teacher, labels, chosen)
    # Rows of weight 0 are skipped, not computed: only the chosen rows' tokens are visited.
    assert torch.cat(seen).tolist() == [0] * int((labels[chosen] != -100).sum())
    expected = 2 * per_row_mean(SkewForwardKL, student, teacher, labels, [0, 1, 2])
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.all(grad[~chosen] == 0) and grad[chosen].abs().sum() > 0


def test_beta_two_is_the_skew_reverse_kl_on_the_student_responses():
    student, teacher, labels, chosen = batch(6)
    got, grad = value_and_grad(DistiLLM2Loss(beta=2.0, skew_alpha=0.2), student, teacher, labels, chosen)
    expected = 2 * per_row_mean(SkewReverseKL, student, teacher, labels, [3, 4, 5])
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.all(grad[chosen] == 0) and grad[~chosen].abs().sum() > 0
    _, expected_grad = ref_value_and_grad(student, teacher, labels, chosen, beta=2.0, alpha=0.2)
    torch.testing.assert_close(grad.double(), expected_grad, atol=1e-6, rtol=1e-4)


def test_each_row_is_averaged_over_its_own_tokens():
    student, teacher, labels, chosen = batch(7)
    got = DistiLLM2Loss()(student, teacher, labels, chosen)
    per_sequence = ref_loss(student, teacher, labels, chosen)
    global_mean = ref_loss(student, teacher, labels, chosen, per_sequence=False)
    assert got.item() == pytest.approx(per_sequence.item(), rel=1e-5)
    assert abs(per_sequence.item() - global_mean.item()) > 1e-2 * abs(per_sequence.item())
    assert got.item() != pytest.approx(global_mean.item(), rel=1e-3)


def test_rows_without_response_tokens_count_nowhere():
    student, teacher, labels, chosen = batch(8)
    base = DistiLLM2Loss()(student, teacher, labels, chosen)
    # Dropping the empty rejected row (4) changes nothing: it is not in the batch mean.
    keep = torch.tensor([0, 1, 2, 3, 5])
    dropped = DistiLLM2Loss()(student[keep], teacher[keep], labels[keep], chosen[keep])
    torch.testing.assert_close(base, dropped)
    # A batch with no response token at all: 0 with a zero gradient.
    empty = torch.full_like(labels, -100)
    got, grad = value_and_grad(DistiLLM2Loss(), student, teacher, empty, chosen)
    assert got.item() == 0.0 and torch.all(grad == 0)
    # Only chosen rows: the rejected term is absent, not NaN.
    only = DistiLLM2Loss()(student[:3], teacher[:3], labels[:3], chosen[:3])
    assert only.item() == pytest.approx(ref_loss(student[:3], teacher[:3], labels[:3], chosen[:3]).item(), rel=1e-5)


def test_swapping_chosen_and_rejected_changes_the_result():
    student, teacher, labels, chosen = batch(9)
    loss_fn = DistiLLM2Loss(beta=1.0)
    straight = loss_fn(student, teacher, labels, chosen)
    swapped = loss_fn(student, teacher, labels, ~chosen)
    assert abs(straight.item() - swapped.item()) > 1e-3
    assert swapped.item() == pytest.approx(ref_loss(student, teacher, labels, ~chosen).item(), rel=1e-5)


def test_no_gradient_reaches_the_teacher():
    student, teacher, labels, chosen = batch(10)
    leaf = student.clone().requires_grad_()
    teacher_leaf = teacher.clone().requires_grad_()
    DistiLLM2Loss()(leaf, teacher_leaf, labels, chosen).backward()
    assert teacher_leaf.grad is None
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"beta": -0.1}, "beta"),
        ({"beta": 2.1}, "beta"),
        ({"skew_alpha": 1.5}, "skew_alpha"),
        ({"skew_alpha": -0.1}, "skew_alpha"),
        ({"temperature": 0.0}, "temperature"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_bad_options_raise(kwargs, match):
    with pytest.raises(MtaError, match=match):
        DistiLLM2Loss(**kwargs)


def test_bad_shapes_raise():
    student, teacher, labels, chosen = batch(11)
    loss_fn = DistiLLM2Loss()
    with pytest.raises(MtaError, match="teacher"):
        loss_fn(student, None, labels, chosen)
    with pytest.raises(MtaError, match="same positions"):
        loss_fn(student, teacher[:, :-1], labels, chosen)
    with pytest.raises(MtaError, match="labels"):
        loss_fn(student, teacher, labels[:, :-1], chosen)
    with pytest.raises(MtaError, match="bool"):
        loss_fn(student, teacher, labels, chosen.long())
    with pytest.raises(MtaError, match="bool"):
        loss_fn(student, teacher, labels, chosen[:-1])
    with pytest.raises(MtaError, match="vocab"):
        loss_fn(student[0], teacher[0], labels[0], chosen[:1])


def test_chunked_token_weights_give_the_weighted_sum():
    """The optional weights of chunked_token_loss: Σ w·loss; uniform 1/n equals the plain mean."""
    student, teacher, labels, _ = batch(12)

    def token_loss(s, t, y):
        return (torch.log_softmax(s, -1).exp() * s).sum(-1) - t.sum(-1)

    leaf = student.clone().requires_grad_()
    plain = chunked_token_loss(token_loss, leaf, teacher, labels, vocab_size=VOCAB, chunk_size=3)
    plain.backward()
    n = int((labels != -100).sum())
    weighted_leaf = student.clone().requires_grad_()
    uniform = torch.full(labels.shape, 1.0 / n)
    weighted = chunked_token_loss(
        token_loss, weighted_leaf, teacher, labels, vocab_size=VOCAB, chunk_size=3, token_weights=uniform
    )
    weighted.backward()
    torch.testing.assert_close(weighted, plain)
    torch.testing.assert_close(weighted_leaf.grad, leaf.grad)
    # Arbitrary weights: the weighted sum, in value and gradient.
    w = torch.rand(labels.shape, generator=torch.Generator().manual_seed(0))
    ref_leaf = student.clone().requires_grad_()
    keep = labels != -100
    expected = (token_loss(ref_leaf[keep][:, :VOCAB], teacher[keep][:, :VOCAB], labels[keep]) * w[keep]).sum()
    expected.backward()
    got_leaf = student.clone().requires_grad_()
    got = chunked_token_loss(token_loss, got_leaf, teacher, labels, vocab_size=VOCAB, chunk_size=2, token_weights=w)
    got.backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_leaf.grad, ref_leaf.grad)
    with pytest.raises(MtaError, match="token_weights"):
        chunked_token_loss(
            token_loss, student, teacher, labels, vocab_size=VOCAB, chunk_size=2, token_weights=w[:, :-1]
        )
