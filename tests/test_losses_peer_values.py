"""mta's base losses against the numbers other projects publish or compute (docs/method.md §5,
"Conventions of other projects"). The numbers are written here with their source; no code of
theirs is copied. Each convention difference is named where the test aligns it.
"""

from __future__ import annotations

import pytest
import torch

from mta.api import KDLoss
from mta.losses.kd import build_base_loss

# ---------------------------------------------------------------- torchtune

# pytorch/torchtune tests/torchtune/modules/loss/test_kd_losses.py,
# TestForwardKLWithChunkedOutputLoss.test_forward_kl_loss_expected: bf16 logits [2, 4, 4], labels
# aligned with the positions (no shift), every position a target; expected 1.7209 (their tolerance
# 1e-2). Their ForwardKLLoss is the cross-entropy form -Σ p log q (no teacher entropy), softmax in fp32.
TORCHTUNE_STUDENT = [
    [[1.1250, -0.4102, -0.0879, -2.5000], [0.2676, 0.3535, 0.8711, -1.4688]]
    + [[-0.1084, 1.6641, 0.0084, 0.1196], [0.5000, -0.6406, -0.2236, -1.5938]],
    [[-1.5312, -1.9219, 0.0000, -0.5039], [-1.5391, 1.5312, 0.5820, 0.2695]]
    + [[-0.3887, 1.2188, 0.0000, 0.6055], [0.5000, 1.3828, 0.1309, -1.0312]],
]
TORCHTUNE_TEACHER = [
    [[-0.0381, -1.2578, -1.2031, 0.0947], [-0.7852, 0.4492, 1.5547, 0.0972]]
    + [[0.8203, 0.0012, 0.7656, 0.3477], [-1.5781, 0.4297, 0.5977, 0.3926]],
    [[1.5156, 0.1641, 2.0781, -0.7734], [-0.5898, 0.4453, -0.7969, 0.6328]]
    + [[0.6289, -0.8359, 0.9258, 0.2109], [0.0006, 0.5195, 3.2344, -1.5781]],
]
TORCHTUNE_LABELS = [[0, 3, 3, 1], [1, 1, 1, 1]]
TORCHTUNE_EXPECTED = 1.7209


def test_torchtune_forward_kl_golden_value_is_mta_fkl_plus_the_teacher_entropy():
    student = torch.tensor(TORCHTUNE_STUDENT, dtype=torch.bfloat16)
    teacher = torch.tensor(TORCHTUNE_TEACHER, dtype=torch.bfloat16)
    labels = torch.tensor(TORCHTUNE_LABELS)
    fkl = KDLoss("fkl", labels_shifted=True)(student, teacher, labels)  # their labels are aligned
    p = teacher.float().softmax(dim=-1)
    entropy = -(p * p.log()).sum(dim=-1).mean()  # every position is a target
    assert abs((fkl + entropy).item() - TORCHTUNE_EXPECTED) < 5e-5  # their 4 digits
    assert abs(fkl.item() - TORCHTUNE_EXPECTED) > 0.5  # mta's fkl is the true KL: the entropy is the gap


# ---------------------------------------------------------------- shared fixed logits


def fixed_logits(shape: tuple[int, ...], step: float, phase: float) -> torch.Tensor:
    """Deterministic float64 logits, the same on every machine: 3·sin(step·i + phase)."""
    count = 1
    for size in shape:
        count *= size
    return (torch.sin(torch.arange(count, dtype=torch.float64) * step + phase) * 3).reshape(shape)


STUDENT = fixed_logits((2, 4, 6), 1.7, 0.3)
TEACHER = fixed_logits((2, 4, 6), 0.9, 1.1)
LABELS = torch.tensor([[5, 2, -100, -100], [1, 3, 4, -100]])  # right padded, aligned with the positions

# ---------------------------------------------------------------- TRL GKD

# trl 1.16.0, trl.experimental.gkd.GKDTrainer.generalized_jsd_loss(STUDENT, TEACHER, labels=LABELS,
# beta, temperature), reduction "batchmean" (the mean over the labelled tokens), run in float64.
# Its mixture is β·teacher + (1−β)·student and the loss β·KL(teacher‖m) + (1−β)·KL(student‖m):
# mta's jsd with jsd_beta = β, no τ² factor on either side. β = 0 and 1 are special cases there:
# KL(teacher‖student) and KL(student‖teacher), the forward and reverse KL (the limits of the
# generalised JSD divided by β and by 1−β); mta's jsd reads them the same way.
TRL_GKD = {
    (0.1, 1.0): 0.16274891036895384,
    (0.1, 2.0): 0.06862526853195802,
    (0.5, 1.0): 0.351055641925676,
    (0.5, 2.0): 0.16714006274787185,
    (0.9, 1.0): 0.13864925407231424,
    (0.9, 2.0): 0.062262157269809326,
    (0.0, 1.0): 2.5390556826086113,
    (1.0, 1.0): 1.8608503217798362,
}


@pytest.mark.parametrize("beta,temperature", sorted(TRL_GKD))
def test_trl_generalized_jsd_values_are_mta_jsd(beta, temperature):
    loss = KDLoss("jsd", labels_shifted=True, jsd_beta=beta, temperature=temperature)
    value = loss(STUDENT.float(), TEACHER.float(), LABELS)
    assert value.item() == pytest.approx(TRL_GKD[beta, temperature], rel=1e-6, abs=1e-7)


def test_trl_generalized_jsd_as_installed_still_gives_those_numbers():
    gkd = pytest.importorskip("trl.experimental.gkd").GKDTrainer
    for (beta, temperature), expected in TRL_GKD.items():
        value = gkd.generalized_jsd_loss(STUDENT, TEACHER, labels=LABELS, beta=beta, temperature=temperature)
        assert value.item() == pytest.approx(expected, rel=1e-9)


def test_jsd_beta_0_and_1_are_the_forward_and_reverse_kl_with_their_gradients():
    for beta, name in ((0.0, "fkl"), (1.0, "rkl")):
        student = STUDENT.float().requires_grad_(True)
        jsd = KDLoss("jsd", labels_shifted=True, jsd_beta=beta)(student, TEACHER.float(), LABELS)
        (jsd_grad,) = torch.autograd.grad(jsd, student)
        kl = KDLoss(name, labels_shifted=True)(student, TEACHER.float(), LABELS)
        (kl_grad,) = torch.autograd.grad(kl, student)
        assert jsd.item() == kl.item() > 0.5
        torch.testing.assert_close(jsd_grad, kl_grad)
        assert jsd_grad.abs().sum() > 0


# ---------------------------------------------------------------- DistiLLM

# jongwooko/distillm distillm/losses.py, skewed_forward_kl and skewed_reverse_kl with lam = λ on
# (logits, teacher_logits, labels) aligned, -100 right padding, the mean over labelled tokens; their
# formulas evaluated in float64 on STUDENT, TEACHER, LABELS. Their skewed forward KL is the
# cross-entropy form −Σ p log(λp + (1−λ)q) (the teacher entropy dropped): mta's `skl` + H(p), the
# same gradient. Their skewed reverse KL Σ q log(q / ((1−λ)p + λq)) is mta's `srkl` (a true KL).
# λ is mta's `skew_alpha`: the weight of the distribution the KL is taken from, inside the mixture.
DISTILLM = {
    ("skl", 0.1): 2.1330581409307605,
    ("srkl", 0.1): 1.1335445055692648,
    ("skl", 0.3): 1.5196942375645692,
    ("srkl", 0.3): 0.6521372900137543,
}


def distillm_reference(name: str, student: torch.Tensor, alpha: float) -> torch.Tensor:
    """The published formulas, written out in float64 (the second implementation)."""
    p, q = TEACHER.softmax(dim=-1), student.softmax(dim=-1)
    if name == "skl":
        per_token = -(p * torch.log(alpha * p + (1 - alpha) * q)).sum(dim=-1)
    else:
        per_token = (q * (q.log() - torch.log((1 - alpha) * p + alpha * q))).sum(dim=-1)
    mask = (LABELS != -100).double()
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("name,alpha", sorted(DISTILLM))
def test_distillm_skewed_kl_values_and_gradients(name, alpha):
    student64 = STUDENT.clone().requires_grad_(True)
    reference = distillm_reference(name, student64, alpha)
    assert reference.item() == pytest.approx(DISTILLM[name, alpha], rel=1e-12)
    (reference_grad,) = torch.autograd.grad(reference, student64)

    student = STUDENT.float().requires_grad_(True)
    value = build_base_loss(name, skew_alpha=alpha, chunk_size=3)(student, TEACHER.float(), LABELS)
    (grad,) = torch.autograd.grad(value, student)
    p = TEACHER.softmax(dim=-1)
    entropy = -(p * p.log()).sum(dim=-1)[LABELS != -100].mean() if name == "skl" else 0.0
    assert value.item() + float(entropy) == pytest.approx(DISTILLM[name, alpha], rel=1e-6)
    torch.testing.assert_close(grad.double(), reference_grad, rtol=1e-5, atol=1e-7)
    assert grad[LABELS == -100].abs().max() == 0  # padding positions get no gradient
