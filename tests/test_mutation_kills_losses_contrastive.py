"""Edge cases of DistiLLM-2's contrastive loss (``mta.losses.contrastive``) that mutation testing
(bench/mutation.py) found unchecked.

The default chunk of 128 response positions, the smallest vocabulary (one entry: every
divergence is 0), the exact messages of refused input (they name the option, the positions and
the batch size), and the result under another default device or dtype. Expected values are
hand-derived from the module docstring; the default-device and default-dtype checks compare the
code with itself under another default, since what they pin is that the result does not depend
on it.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.losses import exactly
from mta.errors import MtaError
from mta.losses.contrastive import DistiLLM2Loss


def small_batch(batch: int = 4, seq: int = 5, vocab: int = 6, seed: int = 0):
    """Half the rows chosen, half rejected; a prompt token at the start of each row."""
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(batch, seq, vocab, generator=generator)
    teacher = torch.randn(batch, seq, vocab, generator=generator)
    labels = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels[:, 0] = -100
    chosen = torch.arange(batch) % 2 == 0
    return student, teacher, labels, chosen


def test_the_default_chunk_is_128_response_positions():
    student, teacher, labels, chosen = small_batch(batch=2, seq=71, vocab=3)  # 2 x 70 response tokens
    loss_fn = DistiLLM2Loss()
    seen = []
    inner = loss_fn._token_loss
    loss_fn._token_loss = lambda s, t, k: (seen.append(s.shape[0]), inner(s, t, k))[1]
    loss_fn(student, teacher, labels, chosen)
    assert seen == [128, 12]


def test_a_one_entry_vocabulary_is_allowed_and_gives_zero():
    """With vocab_size 1 both distributions put all mass on the one entry: every KL is 0 (up to
    the fp32 rounding of the mixture's log(α + (1 − α)))."""
    student, teacher, labels, chosen = small_batch()
    leaf = student.clone().requires_grad_(True)
    loss = DistiLLM2Loss(vocab_size=1)(leaf, teacher, labels.clamp(max=0), chosen)
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert leaf.grad.abs().max().item() < 1e-6


def test_a_skew_alpha_outside_the_unit_interval_is_refused_by_its_name():
    with pytest.raises(MtaError, match=exactly("skew_alpha must lie in [0, 1], got 1.5")):
        DistiLLM2Loss(skew_alpha=1.5)


def test_refused_shapes_name_the_problem_exactly():
    student, teacher, labels, chosen = small_batch(batch=4, seq=5)
    loss_fn = DistiLLM2Loss()
    with pytest.raises(MtaError, match=exactly("DistiLLM2Loss compares with a teacher; teacher_logits is None")):
        loss_fn(student, None, labels, chosen)
    with pytest.raises(MtaError, match=exactly("labels (4, 4) do not match the logits positions (4, 5)")):
        loss_fn(student, teacher, labels[:, :4], chosen)
    message = "chosen must be a bool tensor [batch] = [4], got torch.bool (3,)"
    with pytest.raises(MtaError, match=exactly(message)):
        loss_fn(student, teacher, labels, chosen[:3])


def test_the_token_loss_refuses_missing_teacher_logits_by_name():
    """The per-token function is handed to the chunked loop; without teacher logits it says so."""
    with pytest.raises(MtaError, match=exactly("DistiLLM2Loss compares with a teacher; teacher logits are None")):
        DistiLLM2Loss()._token_loss(torch.zeros(2, 3), None, torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("default", ["meta device", "float64"])
def test_the_result_follows_the_inputs_not_the_default_device_or_dtype(default):
    """Every tensor the loss creates goes on the logits' device and stays fp32: under another
    default (a CUDA run, a caller's set_default_dtype) value and gradient do not change."""
    student, teacher, labels, chosen = small_batch(seed=1)

    def value_and_grad():
        leaf = student.clone().requires_grad_(True)
        loss = DistiLLM2Loss(beta=0.7, skew_alpha=0.2)(leaf, teacher, labels, chosen)
        (grad,) = torch.autograd.grad(loss, leaf)
        return loss, grad

    expected, expected_grad = value_and_grad()
    if default == "meta device":
        with torch.device("meta"):
            got, grad = value_and_grad()
    else:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            got, grad = value_and_grad()
        finally:
            torch.set_default_dtype(previous)
    assert got.device == expected.device and got.dtype == expected.dtype == torch.float32
    assert grad.device == expected_grad.device and grad.dtype == torch.float32
    assert torch.allclose(got, expected, rtol=1e-6, atol=0)
    assert torch.allclose(grad, expected_grad, rtol=1e-5, atol=1e-8)
