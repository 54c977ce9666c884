"""The closed-form token losses and gradients (mta.losses.closed_form) against autograd through the
formulas of mta.losses.kd, at the skew and JSD ends, two temperatures and sharp logits; and the
fused head's caller keeps its teacher logits (the closed forms overwrite their inputs)."""

from __future__ import annotations

import pytest
import torch

from mta.losses.fused_head import LogitsTeacher, OutputHead, fused_head_loss
from mta.losses.kd import build_base_loss

CASES = [
    ("ce", {}),
    ("fkl", {}),
    ("rkl", {}),
    *[("skl", {"skew_alpha": a}) for a in (0.0, 0.1, 0.9, 1.0)],
    *[("srkl", {"skew_alpha": a}) for a in (0.0, 0.1, 0.9, 1.0)],
    *[("jsd", {"jsd_beta": b}) for b in (0.0, 0.3, 1.0)],
    ("tvd", {}),
]


def autograd_reference(loss, student, teacher, labels):
    student = student.clone().requires_grad_(True)
    per_token = loss.token_loss(student, None if teacher is None else teacher.clone(), labels)
    (grad,) = torch.autograd.grad(per_token.sum(), student)
    return per_token.detach(), grad


@pytest.mark.parametrize(("name", "options"), CASES)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("scale", [1.0, 30.0])  # sharp logits: most probabilities underflow
def test_each_closed_form_equals_autograd_through_the_formula(name, options, temperature, scale):
    generator = torch.Generator().manual_seed(11)
    student = torch.randn(6, 29, generator=generator, dtype=torch.float64) * scale
    teacher = torch.randn(6, 29, generator=generator, dtype=torch.float64) * scale
    labels = torch.randint(0, 29, (6,), generator=generator)
    extra = {} if name == "ce" else {"temperature": temperature}
    loss = build_base_loss(name, **extra, **options)
    closed = loss.token_loss_and_grad(student.clone(), None if name == "ce" else teacher.clone(), labels)
    if closed is None:  # the skew ends: the fused head runs autograd
        assert options.get("skew_alpha") in (0.0, 1.0)
        return
    expected_loss, expected_grad = autograd_reference(loss, student, None if name == "ce" else teacher, labels)
    got_loss, got_grad = closed
    torch.testing.assert_close(got_loss, expected_loss, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-8, atol=1e-10)


def test_the_fused_head_leaves_the_callers_teacher_logits_as_they_were():
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(5, 4, generator=generator, requires_grad=True)
    head = OutputHead(torch.randn(9, 4, generator=generator, requires_grad=True))
    teacher = torch.randn(5, 9, generator=generator)
    kept = teacher.clone()
    loss = build_base_loss("srkl", temperature=2.0)
    total = fused_head_loss(
        loss.token_loss,
        hidden,
        head,
        LogitsTeacher(teacher),
        torch.zeros(5, dtype=torch.long),
        vocab_size=9,
        chunk_size=2,
        token_loss_and_grad=loss.token_loss_and_grad,
    )
    total.mean.backward()
    assert torch.equal(teacher, kept)
