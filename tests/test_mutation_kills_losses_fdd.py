"""Edges of FDD's logit-lens loss (mta.losses.fdd) that mutation testing (bench/mutation.py) found unchecked.

The dynamics mean over several tokens with two pairs, temperatures below 1, a one-token
vocabulary, the default chunk of 128 positions, the results' fp32 dtype and device under other
defaults, and the messages of refused settings and inputs. With the identity lens (hidden state =
logits) every expected value comes from the float64 loop over the formulas (tests/fixtures/fdd.py,
docs/method.md), not from the code under test; the default-device and default-dtype
checks compare the code with itself under another default, since what they pin is that the
result does not depend on it.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.fdd import reference
from mta.errors import MtaError
from mta.losses.fdd import FeatureDynamicsLoss

# ---------------------------------------------------------------- helpers


def identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def logit_states(seed: int, pairs: int, width: int, batch: int = 2, seq: int = 4, scale: float = 2.0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, seq, width, generator=generator) * scale for _ in range(pairs)]


MASK = torch.tensor([[True, False, True, True], [False, True, True, False]])  # five tokens, holes in both rows


# ---------------------------------------------------------------- values


@pytest.mark.parametrize(
    ("pairs", "temperature", "vocab_size"),
    [(2, 0.5, None), (2, 1.0, 4), (3, 0.25, None)],
)
def test_values_over_several_tokens_with_temperatures_down_to_a_quarter(pairs, temperature, vocab_size):
    """Both terms are means over the five masked tokens (two pairs included: one change per
    token, still averaged over tokens), at temperatures at or below 1; without vocab_size the
    narrower side's width (the teacher's 6 of the student's 7) is compared."""
    student, teacher = logit_states(40, pairs, 7), logit_states(41, pairs, 6, scale=3.0)
    loss = FeatureDynamicsLoss(temperature=temperature, vocab_size=vocab_size, chunk_size=2)
    out = loss(student, teacher, identity, identity, MASK)
    trajectory, dynamics, _ = (
        value.item()
        for value in reference(student, teacher, identity, identity, MASK, temperature=temperature, vocab=vocab_size)
    )
    assert dynamics > 0.1 and trajectory > 0.1
    assert out["fdd_trajectory"].item() == pytest.approx(trajectory, rel=1e-5)
    assert out["fdd_dynamics"].item() == pytest.approx(dynamics, rel=1e-5)
    assert out["fdd"].item() == pytest.approx(trajectory + dynamics, rel=1e-5)


def test_a_one_token_vocabulary_is_accepted_and_gives_no_trajectory_and_full_dynamics():
    """vocab_size = 1 is the smallest valid vocabulary. Over one token every distribution is
    certain (KL 0) and every log-probability is 0, so each change is the zero vector, whose
    clamped cosine is 0 / ε² = 0: dynamics is 1 − 0 = 1 per token."""
    student, teacher = logit_states(42, 2, 5), logit_states(43, 2, 5)
    out = FeatureDynamicsLoss(vocab_size=1)(student, teacher, identity, identity, MASK)
    assert out["fdd_trajectory"].item() == 0.0
    assert out["fdd_dynamics"].item() == pytest.approx(1.0, abs=1e-7)


def test_the_default_chunk_holds_128_positions():
    """``chunk_size`` defaults to 128 (docs/recipe-keys.md, loss.chunk_size): 130 masked
    positions reach the lens as one chunk of 128 and one of 2."""
    student, teacher = logit_states(44, 1, 3, batch=1, seq=131), logit_states(45, 1, 3, batch=1, seq=131)
    mask = torch.ones(1, 131, dtype=torch.bool)
    mask[0, 7] = False
    sizes: list[int] = []

    def student_lens(hidden: torch.Tensor) -> torch.Tensor:
        sizes.append(hidden.shape[0])
        return hidden

    with torch.no_grad():
        FeatureDynamicsLoss()(student, teacher, student_lens, identity, mask)
    assert sizes == [128, 2]


@pytest.mark.parametrize("default", ["meta device", "float64"])
def test_results_are_fp32_on_the_inputs_device_whatever_the_defaults(default):
    """The loss's accumulators follow the inputs, not the default device or dtype: under a
    default of the meta device or of float64 the values, dtype and device do not change."""
    student = [s.requires_grad_() for s in logit_states(46, 2, 5)]
    teacher = logit_states(47, 2, 5)
    loss = FeatureDynamicsLoss(chunk_size=3)
    expected = loss(student, teacher, identity, identity, MASK)
    if default == "meta device":
        with torch.device("meta"):
            got = loss(student, teacher, identity, identity, MASK)
    else:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            got = loss(student, teacher, identity, identity, MASK)
        finally:
            torch.set_default_dtype(previous)
    for key, value in expected.items():
        assert value.dtype == torch.float32 and value.device.type == "cpu", key
        assert got[key].dtype == torch.float32 and got[key].device.type == "cpu", key
        torch.testing.assert_close(got[key], value, msg=key)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"temperature": 0}, r"fdd temperature must be positive, got 0"),
        ({"temperature": -1.5}, r"fdd temperature must be positive, got -1\.5"),
        ({"vocab_size": 0}, r"vocab_size must be at least 1, got 0"),
        ({"chunk_size": 0}, r"chunk_size must be at least 1, got 0"),
        ({"trajectory_weight": -0.1}, r"fdd trajectory_weight must be non-negative, got -0\.1"),
        ({"dynamics_weight": float("nan")}, r"fdd dynamics_weight must be non-negative, got nan"),
    ],
)
def test_refused_settings_are_named_with_their_value(setting, message):
    with pytest.raises(MtaError, match=rf"^{message}$"):
        FeatureDynamicsLoss(**setting)


def test_refused_inputs_name_the_side_and_the_shapes():
    student, teacher = logit_states(48, 2, 5), logit_states(49, 2, 5)
    loss = FeatureDynamicsLoss()
    with pytest.raises(MtaError, match=r"^fdd needs at least one \(student layer, teacher layer\) pair; got none$"):
        loss([], [], identity, identity, MASK)
    with pytest.raises(MtaError, match=r"^fdd mask must be \[batch, seq\], got \(2, 4, 1\)$"):
        loss(student, teacher, identity, identity, MASK[..., None])
    with pytest.raises(
        MtaError,
        match=(
            r"^fdd student hidden state 1 is \(2, 4\); "
            r"expected \[batch, seq, dim\] over the mask's \(2, 4\) positions$"
        ),
    ):
        loss([student[0], student[1][..., 0]], teacher, identity, identity, MASK)
    with pytest.raises(
        MtaError,
        match=r"^fdd teacher hidden state 0 is \(2, 3, 5\); expected \[batch, seq, dim\] over the mask's \(2, 4\)",
    ):
        loss(student, [teacher[0][:, :3], teacher[1]], identity, identity, MASK)


@pytest.mark.parametrize("side", ["student", "teacher"])
def test_a_lens_that_does_not_return_two_dimensional_logits_is_named(side):
    student, teacher = logit_states(50, 1, 5), logit_states(51, 1, 5)

    def lens_3d(hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, None, :]

    lenses = (lens_3d, identity) if side == "student" else (identity, lens_3d)
    with pytest.raises(MtaError, match=rf"^the {side} lens must return \[n, vocab\] logits, got \(\d+, 1, 5\)$"):
        FeatureDynamicsLoss()(student, teacher, *lenses, MASK)
