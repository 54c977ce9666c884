"""ASAM's parts (mta.training.asam) that mutation testing (bench/mutation.py) found reached only
through a DeepSpeed engine, now pinned in process on a tiny nn.Module, fp32, CPU.

Which parameters ``Asam`` takes and how it marks them (adaptive by scope, student by name),
``Asam.for_engine`` on a stand-in engine (ZeRO-3 refused, ``student_gradient_clip`` read),
``gradient`` (the sum over micro batches and processes, zeros where a loss does not reach,
fp32, ``.grad`` untouched, the student clip on the window's mean), ``clip_student_part``
against ``torch.nn.utils.clip_grad_norm_`` on the mean gradient, ``perturbed`` (w + ε inside,
w restored after, also after an error, the skipped step's warning) and ``perturbation``'s
edges (no parameters, lengths that differ, fp16 weights). Expected values are hand-derived from
the closed form ε = ρ·T²·g / ‖T·g‖, T = |w| + η (module docstring, docs/method.md), or come from
torch's own clip_grad_norm_, never from the code under test.
"""

from __future__ import annotations

import logging
import math
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mta import distributed
from mta.errors import MtaError
from mta.training.asam import Asam, perturbation
from mta.training.config.schema import ZERO3_REFUSAL, AsamSpec

pytestmark = pytest.mark.usefixtures("one_thread")


class StudentAndProjector(nn.Module):
    """student.weight, student.bias, proj.weight, proj.bias trainable; frozen.weight not."""

    def __init__(self):
        super().__init__()
        self.student = nn.Linear(2, 1)
        self.proj = nn.Linear(1, 1)
        self.frozen = nn.Linear(1, 1, bias=False)
        self.frozen.weight.requires_grad_(False)
        with torch.no_grad():
            self.student.weight.copy_(torch.tensor([[1.0, -2.0]]))
            self.student.bias.fill_(0.5)
            self.proj.weight.fill_(3.0)
            self.proj.bias.fill_(-1.0)
            self.frozen.weight.fill_(7.0)


def _engine(module, *, zero3=False):
    return SimpleNamespace(module=module, zero_optimization_partition_weights=lambda: zero3)


# ---------------------------------------------------------------- __init__ and for_engine


def test_asam_takes_the_trainable_parameters_in_order_and_marks_adaptive_and_student():
    model = StudentAndProjector()
    asam = Asam(AsamSpec(rho=0.3, eta=0.02, scope="weights"), model)
    expected = [model.student.weight, model.student.bias, model.proj.weight, model.proj.bias]
    assert len(asam.params) == 4 and all(a is b for a, b in zip(asam.params, expected, strict=True))
    assert asam.adaptive == [True, False, True, False]  # scope weights: T = |w| + η on *weight only
    assert asam.student == [True, True, False, False]  # the parameters under module.student
    assert (asam.rho, asam.eta) == (0.3, 0.02)
    assert asam.student_clip == 0.0 and asam.skipped == 0
    assert Asam(AsamSpec(scope="all"), model).adaptive == [True, True, True, True]


def test_for_engine_refuses_zero3_with_its_message():
    with pytest.raises(MtaError, match=re.escape(ZERO3_REFUSAL)):
        Asam.for_engine(AsamSpec(), _engine(StudentAndProjector(), zero3=True))


def test_for_engine_wraps_the_engine_module_and_reads_its_student_gradient_clip():
    model = StudentAndProjector()
    asam = Asam.for_engine(AsamSpec(rho=0.2), _engine(model))
    assert asam.params[0] is model.student.weight and len(asam.params) == 4 and asam.rho == 0.2
    assert asam.student_clip == 0.0  # no student_gradient_clip on the module: no clip
    model.student_gradient_clip = 2
    clipped = Asam.for_engine(AsamSpec(), _engine(model))
    assert clipped.student_clip == 2.0 and isinstance(clipped.student_clip, float)


# ---------------------------------------------------------------- gradient


def _student_losses(model, inputs):
    """loss_k = student(x_k) + 0·proj: ∂/∂student.weight = x_k, ∂/∂student.bias = 1, proj not reached."""
    return (model.student(torch.tensor(x)).sum() for x in inputs)


def test_gradient_sums_the_micro_batches_and_gives_zeros_where_no_loss_reaches():
    model = StudentAndProjector()
    asam = Asam(AsamSpec(), model)
    total = asam.gradient(_student_losses(model, [[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]]))
    assert [t.tolist() for t in total] == [[[4.5, 1.5]], [3.0], [[0.0]], [0.0]]
    assert all(t.dtype == torch.float32 for t in total)
    assert all(p.grad is None for p in model.parameters())  # .grad untouched


def test_gradient_of_no_micro_batch_is_zero_even_with_the_student_clip():
    model = StudentAndProjector()
    asam = Asam(AsamSpec(), model, student_clip=1.0)
    assert [t.tolist() for t in asam.gradient([])] == [[[0.0, 0.0]], [0.0], [[0.0]], [0.0]]


def test_gradient_of_a_bf16_parameter_is_summed_in_fp32():
    model = nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    asam = Asam(AsamSpec(), model)
    # 1 + 2⁻¹⁰ is not a bf16 number (8 bits of mantissa) but is an fp32 one.
    x = torch.tensor([[1.0]], dtype=torch.bfloat16)
    losses = [model(x).sum(), model(x).sum() * torch.tensor(2.0**-10, dtype=torch.bfloat16)]
    (total,) = asam.gradient(losses)
    assert total.dtype == torch.float32 and total.item() == 1.0 + 2.0**-10


def _clip_by_torch(mean_parts, clip):
    """torch.nn.utils.clip_grad_norm_ on the mean gradient: the independent reference."""
    params = [nn.Parameter(torch.zeros_like(part)) for part in mean_parts]
    for param, part in zip(params, mean_parts, strict=True):
        param.grad = part.clone()
    torch.nn.utils.clip_grad_norm_(params, clip)
    return [param.grad for param in params]


def test_gradient_clips_the_student_part_of_the_mean_over_micro_batches_and_processes(monkeypatch):
    """Two processes with the same window: g is doubled by the all-reduce and the clip is on the
    mean over all four micro batches, i.e. on the mean of the window; the projector part as summed."""
    model = StudentAndProjector()
    inputs = [[3.0, 4.0], [1.0, 0.0]]
    # Per micro batch: student.weight = x, student.bias = 1; proj.weight and proj.bias = x[0].
    mean = [torch.tensor([[2.0, 2.0]]), torch.tensor([1.0])]
    clipped = _clip_by_torch(mean, 1.0)
    assert clipped[0].norm() < mean[0].norm()  # the case clips

    def doubled(tensors):
        for tensor in tensors:
            tensor.mul_(2.0)

    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "sum_tensors_over_ranks", doubled)
    asam = Asam(AsamSpec(), model, student_clip=1.0)
    losses = (model.student(torch.tensor(x)).sum() + model.proj(torch.ones(1)).sum() * x[0] for x in inputs)
    total = asam.gradient(losses)
    assert torch.allclose(total[0], clipped[0] * 4, rtol=1e-6, atol=0)
    assert torch.allclose(total[1], clipped[1] * 4, rtol=1e-6, atol=0)
    assert total[2].tolist() == [[8.0]] and total[3].tolist() == [8.0]  # 2 · (3 + 1): not clipped


@pytest.mark.parametrize(
    ("student_mean", "clip"),
    [
        ([[3.0, 4.0]], 1.0),  # ‖mean‖ = 5 > 1: scaled by 1 / (5 + 1e-6)
        ([[0.6, 0.8]], 1.5),  # ‖mean‖ = 1 < 1.5: the factor is capped at 1
        ([[6e-7, 8e-7]], 1e-6),  # ‖mean‖ = 1e-6: the 1e-6 in the denominator halves it
    ],
)
def test_clip_student_part_is_clip_grad_norm_on_the_mean_and_leaves_the_rest(student_mean, clip):
    model = StudentAndProjector()
    asam = Asam(AsamSpec(), model, student_clip=clip)
    count = 3
    mean = [torch.tensor(student_mean), torch.tensor([0.0])]
    total = [mean[0] * count, mean[1] * count, torch.tensor([[10.0]]), torch.tensor([-20.0])]
    asam.clip_student_part(total, count)
    expected = _clip_by_torch(mean, clip)
    assert torch.allclose(total[0], expected[0] * count, rtol=1e-6, atol=0)
    assert total[1].tolist() == [0.0]
    assert total[2].tolist() == [[10.0]] and total[3].tolist() == [-20.0]


def test_clip_student_part_without_student_parameters_changes_nothing():
    asam = Asam(AsamSpec(), nn.Linear(1, 1), student_clip=1e-3)
    total = [torch.tensor([[50.0]]), torch.tensor([-60.0])]
    asam.clip_student_part(total, 1)
    assert total[0].tolist() == [[50.0]] and total[1].tolist() == [-60.0]


def test_clip_student_part_refuses_a_total_of_another_length():
    asam = Asam(AsamSpec(), StudentAndProjector(), student_clip=1.0)
    with pytest.raises(ValueError):
        asam.clip_student_part([torch.ones(1, 2), torch.ones(1)], 1)


# ---------------------------------------------------------------- perturbed


def _line(w):
    """A bias-free Linear(2, 1) at w, its loss w·x with x = (2, 1): g = x."""
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([w]))
    return model, lambda: model(torch.tensor([2.0, 1.0])).sum()


def test_perturbed_runs_the_block_at_w_plus_epsilon_and_restores_w():
    rho, eta, w, g = 0.5, 0.25, [1.0, -2.0], [2.0, 1.0]
    model, loss = _line(w)
    scale = [abs(x) + eta for x in w]
    norm = math.sqrt(sum((t * x) ** 2 for t, x in zip(scale, g, strict=True)))
    expected = [x + rho * t * t * d / norm for x, t, d in zip(w, scale, g, strict=True)]
    asam = Asam(AsamSpec(rho=rho, eta=eta), model)
    with asam.perturbed([loss()]) as perturbed:
        assert perturbed is True
        assert model.weight[0].tolist() == pytest.approx(expected, rel=1e-6)
        moved = loss().item()
    assert moved == pytest.approx(2 * expected[0] + expected[1], rel=1e-6)  # the block's loss is at w + ε
    assert model.weight.tolist() == [w] and asam.skipped == 0 and model.weight.grad is None


def test_perturbed_restores_w_after_an_error_in_the_block():
    model, loss = _line([1.0, -2.0])
    asam = Asam(AsamSpec(rho=0.5), model)
    with pytest.raises(RuntimeError, match="inside"):
        with asam.perturbed([loss()]):
            assert model.weight.tolist() != [[1.0, -2.0]]
            raise RuntimeError("inside")
    assert model.weight.tolist() == [[1.0, -2.0]]


def test_a_skipped_step_yields_false_counts_and_warns_with_or_without_its_number(caplog):
    model, loss = _line([1.0, -2.0])
    asam = Asam(AsamSpec(), model)
    with caplog.at_level(logging.WARNING, logger="mta.training.asam"):
        with asam.perturbed([loss() * 0.0]) as perturbed:
            assert perturbed is False and model.weight.tolist() == [[1.0, -2.0]]
        with asam.perturbed([loss() * float("nan")], step=0) as perturbed:
            assert perturbed is False
    assert asam.skipped == 2
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("mta.training.asam", logging.WARNING, "ASAM: the gradient is zero or not finite; this step is not perturbed"),
        (
            "mta.training.asam",
            logging.WARNING,
            "ASAM: the gradient of step 1 is zero or not finite; this step is not perturbed",
        ),
    ]


# ---------------------------------------------------------------- perturbation's edges


def test_perturbation_of_no_parameters_is_none():
    assert perturbation([], [], [], rho=0.05, eta=0.0) is None


@pytest.mark.parametrize("longer", ["weights", "grads", "adaptive"])
def test_perturbation_refuses_lists_of_different_lengths(longer):
    lists = {"weights": [torch.ones(2)], "grads": [torch.ones(2)], "adaptive": [True]}
    lists[longer] = lists[longer] * 2
    with pytest.raises(ValueError):
        perturbation(lists["weights"], lists["grads"], lists["adaptive"], rho=0.05, eta=0.0)


def test_perturbation_of_fp16_weights_is_formed_in_fp32_and_returned_in_fp16():
    """g = (300, 400), T = 1: ‖T·g‖ = 500 (its square overflows fp16), ε = ρ·g/500 = (0.6, 0.8)."""
    weights, grads = [torch.ones(2, dtype=torch.float16)], [torch.tensor([300.0, 400.0], dtype=torch.float16)]
    (epsilon,) = perturbation(weights, grads, [False], rho=1.0, eta=0.0)
    assert epsilon.dtype == torch.float16
    assert epsilon.tolist() == pytest.approx([0.6, 0.8], rel=1e-3)
    (wide,) = perturbation([torch.ones(2, dtype=torch.float64)], [torch.ones(2)], [True], rho=1.0, eta=0.0)
    assert wide.dtype == torch.float64 and wide.tolist() == pytest.approx([2**-0.5] * 2, rel=1e-12)


def test_eta_is_added_in_fp32_even_to_an_fp16_weight():
    """An fp16 weight at 0 with η = 1e-8 (below fp16's smallest step) has T = 1e-8, not 0: with
    g = 3e4 its T·g = 3e-4 enters the norm, which sets the fp32 bias's ε = ρ·1e-4 / ‖(3e-4, 1e-4)‖."""
    weights = [torch.zeros(1, dtype=torch.float16), torch.ones(1)]
    grads = [torch.tensor([3e4], dtype=torch.float16), torch.tensor([1e-4])]
    eps_w, eps_b = perturbation(weights, grads, [True, False], rho=1.0, eta=1e-8)
    assert eps_b.item() == pytest.approx(1e-4 / math.sqrt(3e-4**2 + 1e-4**2), rel=1e-5)
    assert eps_w.dtype == torch.float16 and eps_w.item() == 0.0  # 1e-16 · 3e4 / 3.2e-4 underflows in fp16


@pytest.mark.parametrize("adaptive", [True, False])
def test_a_gradient_wider_than_the_weight_is_taken_in_the_weight_precision(adaptive):
    """ε is formed in the weight's dtype (at least fp32): a float64 gradient of 1e100 on an fp32
    weight overflows fp32, so the norm is not finite and nothing is perturbed."""
    assert (
        perturbation([torch.ones(2)], [torch.full((2,), 1e100, dtype=torch.float64)], [adaptive], rho=1.0, eta=0.0)
        is None
    )
    wide = perturbation(
        [torch.ones(2, dtype=torch.float64)],
        [torch.full((2,), 1e100, dtype=torch.float64)],
        [adaptive],
        rho=1.0,
        eta=0.0,
    )
    assert wide is not None and wide[0].tolist() == pytest.approx([2**-0.5] * 2, rel=1e-12)
