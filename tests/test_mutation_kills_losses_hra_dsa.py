"""HRA and DSA where mutation testing (bench/mutation.py) found them unpinned: the modes they
accept (anything else is refused by name, so a default is a real mode and not "anything but the
other one"), DSA's guard against span vectors of near-zero norm (``COS_EPS``), and HRA's mean over
sequences whose weights sum to less than one.

Expected values come from python floats and loops over the formulas of the docstrings
(docs/method.md §3), not from the code under test; the default-mode checks compare the code with
itself (a default is the mode it names) beside checks that the other mode differs.
"""

from __future__ import annotations

import math

import pytest
import torch

from mta.losses import dsa
from mta.losses.dsa import dynamic_structural_alignment
from mta.losses.hra import hidden_representation_alignment


def _unit(vector: list[float], eps: float) -> list[float]:
    """``vector`` divided by its norm, or by ``eps`` when the norm is smaller."""
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / max(norm, eps) for x in vector]


def _uniform_dsa_of_one_sequence(student: list[list[float]], teacher: list[list[float]], eps: float) -> float:
    """Σ_{i≠j} (cos S_ij − cos T_ij)² / #pairs: equal salience on every span of one sequence."""
    s = [_unit(v, eps) for v in student]
    t = [_unit(v, eps) for v in teacher]
    gaps = [
        (sum(a * b for a, b in zip(s[i], s[j], strict=True)) - sum(a * b for a, b in zip(t[i], t[j], strict=True))) ** 2
        for i in range(len(s))
        for j in range(len(s))
        if i != j
    ]
    return sum(gaps) / len(gaps)


def test_dsa_reads_a_span_vector_shorter_than_cos_eps_as_almost_orthogonal_to_every_span():
    """A span of norm 1e-10 (a span of padding-like, near-zero states) is divided by COS_EPS, not
    by its own norm: its cosine with a span pointing the same way is 0.01, not 1."""
    student = [[1e-10, 0.0], [1.0, 0.0], [0.0, 1.0]]
    teacher = [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    expected = _uniform_dsa_of_one_sequence(student, teacher, dsa.COS_EPS)
    assert expected == pytest.approx((1 - 0.01) ** 2 / 3)  # the pair (0, 1) both ways, of six pairs
    got = dynamic_structural_alignment(
        torch.tensor([student]), torch.tensor([teacher]), torch.ones(1, 3), torch.ones(1, 3)
    )
    assert got.item() == pytest.approx(expected, rel=1e-5)


def test_hra_averages_sequences_whose_weights_sum_to_less_than_one():
    """Per sequence Σ w (1 − cos) / Σ w; the mean over the sequences with positive weight, however
    small their sum (the masked item's weight does not count)."""
    student = [[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [2.0, 0.0]]]
    teacher = [[[1.0, 0.0], [1.0, 0.0]], [[1.0, 0.0], [0.0, 3.0]]]
    weights = [[0.1, 0.3], [0.2, 0.4]]
    mask = [[True, True], [True, False]]
    first = (0.1 * 0.0 + 0.3 * 1.0) / 0.4  # cos 1 and cos 0
    second = 1.0 - 1.0 / math.sqrt(2.0)  # one masked item: its own distance, whatever its weight
    got = hidden_representation_alignment(
        torch.tensor(student), torch.tensor(teacher), torch.tensor(weights), torch.tensor(mask)
    )
    assert got.item() == pytest.approx((first + second) / 2, rel=1e-6)


@pytest.mark.parametrize(
    ("loss", "option", "value"),
    [
        ("hra", "reduction", "mean"),
        ("hra", "reduction", "Sequence"),
        ("dsa", "reduction", "sequences"),
        ("dsa", "pair_weights", "equal"),
    ],
)
def test_a_mode_neither_documented_value_names_is_refused_with_the_value(loss, option, value):
    spans = torch.ones(1, 2, 3)
    weights, mask = torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)
    function = hidden_representation_alignment if loss == "hra" else dynamic_structural_alignment
    with pytest.raises(ValueError, match=rf"^{option} must be one of .*, not '{value}'$"):
        function(spans, spans, weights, mask, **{option: value})


def test_the_default_modes_are_the_per_sequence_mean_and_salience_weights():
    """Two sequences of different sizes: the per-sequence mean weighs them equally, the batch
    reduction by their weight; uniform pair weights ignore salience."""
    generator = torch.Generator().manual_seed(3)
    student = torch.randn(2, 3, 4, generator=generator)
    teacher = torch.randn(2, 3, 4, generator=generator)
    salience = torch.tensor([[1.0, 2.0, 3.0], [2.0, 1.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    hra_default = hidden_representation_alignment(student, teacher, salience, mask)
    assert hra_default.item() == hidden_representation_alignment(student, teacher, salience, mask, reduction="sequence")
    assert hra_default.item() != pytest.approx(
        hidden_representation_alignment(student, teacher, salience, mask, reduction="batch").item()
    )
    dsa_default = dynamic_structural_alignment(student, teacher, salience, mask)
    explicit = dynamic_structural_alignment(
        student, teacher, salience, mask, reduction="sequence", pair_weights="salience"
    )
    assert dsa_default.item() == explicit.item()
    for other in ({"reduction": "batch"}, {"pair_weights": "uniform"}):
        assert dsa_default.item() != pytest.approx(
            dynamic_structural_alignment(student, teacher, salience, mask, **other).item()
        )
