"""FDD's logit-lens loss against a float64 loop over pairs and tokens (mta.losses.fdd)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fixtures.fdd import reference
from mta.errors import MtaError
from mta.losses.fdd import FeatureDynamicsLoss

B, S, D_S, D_T, V = 2, 5, 6, 8, 11
NORM_EPS = 1e-6


def num(tensor: torch.Tensor) -> float:
    return float(tensor.detach())


class Side(nn.Module):
    """A lens: optional final norm, then a bias-free LM head."""

    def __init__(self, dim: int, width: int, norm: str | None, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.norm = {None: None, "layer": nn.LayerNorm(dim, eps=NORM_EPS), "rms": nn.RMSNorm(dim, eps=NORM_EPS)}[norm]
        if self.norm is not None:
            with torch.no_grad():  # not the identity init, so a wrong norm gradient shows
                for parameter in self.norm.parameters():
                    parameter.add_(0.3 * torch.randn_like(parameter))
        self.head = nn.Linear(dim, width, bias=False)
        with torch.no_grad():
            self.head.weight.mul_(4.0)

    def forward(self, hidden):
        return self.head(hidden if self.norm is None else self.norm(hidden))

    def float64_copy(self):
        """Leaf float64 copies of the parameters and a lens using them."""
        params = {name: p.detach().double().clone().requires_grad_() for name, p in self.named_parameters()}

        def lens(hidden):
            if isinstance(self.norm, nn.LayerNorm):
                hidden = F.layer_norm(hidden, hidden.shape[-1:], params["norm.weight"], params["norm.bias"], NORM_EPS)
            elif isinstance(self.norm, nn.RMSNorm):
                hidden = F.rms_norm(hidden, hidden.shape[-1:], params["norm.weight"], NORM_EPS)
            return F.linear(hidden, params["head.weight"])

        return lens, params


def random_states(seed: int, pairs: int = 3, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    student = [torch.randn(B, S, D_S, generator=generator).to(dtype).requires_grad_() for _ in range(pairs)]
    teacher = [torch.randn(B, S, D_T, generator=generator).to(dtype) for _ in range(pairs)]
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, 3:] = False  # padding
    mask[1, 0] = False
    return student, teacher, mask


def run(loss, student, teacher, student_side, teacher_side, mask, key="fdd"):
    for state in student:
        state.grad = None
    student_side.zero_grad(set_to_none=True)
    out = loss(student, teacher, student_side, teacher_side, mask)
    out[key].backward()
    grads = [state.grad.clone() for state in student]
    param_grads = {name: p.grad.clone() for name, p in student_side.named_parameters()}
    return {k: v.detach() for k, v in out.items()}, grads, param_grads


# --------------------------------------------------------------------------- the authors' formula


def test_reference_reproduces_the_hand_computed_example():
    # Identity lens (hidden = logits), V = 3, K = 2 pairs, one token, temperature 2.
    #   s1 = [0, 0, 0],      t1 = [2 ln2, 0, 0]
    #   s2 = [ln4, 0, 0],    t2 = [0, 2 ln2, 0]
    # Trajectory (T = 2):
    #   pair 1: q = [1/3]*3, p ∝ [2, 1, 1] = [1/2, 1/4, 1/4]:
    #           KL = 1/2 ln(3/2) + 2 · 1/4 ln(3/4) = 1/2 ln(9/8)
    #   pair 2: q ∝ [2, 1, 1] = [1/2, 1/4, 1/4], p = [1/4, 1/2, 1/4]:
    #           KL = 1/4 ln(1/2) + 1/2 ln 2 + 0 = 1/4 ln 2
    #   trajectory = (1/2 ln(9/8) + 1/4 ln 2) / 2 = 1/4 ln(9/8) + 1/8 ln 2 ≈ 0.1160891
    # Dynamics (log-softmax at temperature 1):
    #   log_softmax(s1) = −ln3 · [1, 1, 1]; log_softmax(s2) = [ln(2/3), −ln6, −ln6]
    #   ΔS = [ln2, −ln2, −ln2] = ln2 · [1, −1, −1]
    #   log_softmax(t1) = [ln(2/3), −ln6, −ln6]; log_softmax(t2) = [−ln6, ln(2/3), −ln6]
    #   ΔT = [−ln4, ln4, 0] = 2 ln2 · [−1, 1, 0]
    #   cos = (−1 − 1 + 0) / (√3 · √2) = −2/√6, so dynamics = 1 + 2/√6 ≈ 1.8164966
    # fdd = trajectory + dynamics ≈ 1.9325857
    ln2 = math.log(2.0)
    expected_trajectory = 0.25 * math.log(9 / 8) + 0.125 * ln2
    expected_dynamics = 1 + 2 / math.sqrt(6)
    assert expected_trajectory == pytest.approx(0.1160891, abs=1e-7)
    assert expected_dynamics == pytest.approx(1.8164966, abs=1e-7)

    f64 = {"dtype": torch.float64}
    student = [torch.tensor([[[0.0, 0.0, 0.0]]], **f64), torch.tensor([[[math.log(4.0), 0.0, 0.0]]], **f64)]
    teacher = [torch.tensor([[[2 * ln2, 0.0, 0.0]]], **f64), torch.tensor([[[0.0, 2 * ln2, 0.0]]], **f64)]
    mask = torch.ones(1, 1, dtype=torch.bool)

    def identity(h):
        return h

    trajectory, dynamics, _ = reference(student, teacher, identity, identity, mask, temperature=2.0)
    assert num(trajectory) == pytest.approx(expected_trajectory, abs=1e-12)
    assert num(dynamics) == pytest.approx(expected_dynamics, abs=1e-12)

    out = FeatureDynamicsLoss(temperature=2.0)(student, teacher, identity, identity, mask)
    assert num(out["fdd_trajectory"]) == pytest.approx(expected_trajectory, abs=1e-6)
    assert num(out["fdd_dynamics"]) == pytest.approx(expected_dynamics, abs=1e-6)
    assert num(out["fdd"]) == pytest.approx(expected_trajectory + expected_dynamics, abs=1e-6)


def authors_style_fdd(student_states, teacher_states, student_head, teacher_head, attention_mask, temperature):
    """The authors' get_fdd_loss as a batched formula (my transcription, float64): the bare
    head on every position, KL via kl_div, masked means weighted by the 0/1 attention mask,
    torch's cosine_similarity with eps 1e-5, then traj / K + der / (K − 1)."""
    m = attention_mask.double()
    trajectory, dynamics, previous = 0.0, 0.0, None
    for hs, ht in zip(student_states, teacher_states, strict=True):
        zs, zt = student_head(hs.double()), teacher_head(ht.double()).detach()
        kl = F.kl_div(F.log_softmax(zs / temperature, -1), F.softmax(zt / temperature, -1), reduction="none").sum(-1)
        trajectory = trajectory + (kl * m).sum() / m.sum()
        ls, lt = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
        if previous is not None:
            cos = F.cosine_similarity(ls - previous[0], lt - previous[1], dim=-1, eps=1e-5)
            dynamics = dynamics + ((1 - cos) * m).sum() / m.sum()
        previous = (ls, lt)
    pairs = len(student_states)
    return trajectory / pairs + dynamics / (pairs - 1)


@pytest.mark.parametrize("temperature", [2.0, 5.0])  # span_fdd_finetune.py, fdd_finetune.py
def test_matches_the_authors_formulation_with_bare_head_and_attention_mask(temperature):
    student, teacher, mask = random_states(1)
    attention_mask = mask.long()
    student_side, teacher_side = Side(D_S, V, None, 0), Side(D_T, V, None, 1)
    s64, _ = student_side.float64_copy()
    t64, _ = teacher_side.float64_copy()
    expected = authors_style_fdd(student, teacher, s64, t64, attention_mask, temperature).detach()
    out = FeatureDynamicsLoss(temperature=temperature)(student, teacher, student_side, teacher_side, attention_mask)
    assert num(out["fdd"]) == pytest.approx(num(expected), rel=1e-5)
    assert num(expected) == pytest.approx(
        num(reference(student, teacher, s64, t64, mask, temperature=temperature)[2]), rel=1e-10
    )


def test_defaults_follow_span_fdd_finetune():
    loss = FeatureDynamicsLoss()
    assert (loss.temperature, loss.trajectory_weight, loss.dynamics_weight, loss.vocab_size) == (2.0, 1.0, 1.0, None)


# --------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize(
    "norm, temperature, weights",
    [(None, 2.0, (1.0, 1.0)), ("layer", 5.0, (1.0, 0.0)), ("layer", 2.0, (0.0, 1.0)), ("rms", 1.5, (0.7, 1.3))],
)
def test_values_and_gradients_match_the_reference(norm, temperature, weights):
    student, teacher, mask = random_states(2)
    student_side, teacher_side = Side(D_S, V, norm, 3), Side(D_T, V, norm, 4)
    loss = FeatureDynamicsLoss(
        temperature=temperature, chunk_size=3, trajectory_weight=weights[0], dynamics_weight=weights[1]
    )
    out, grads, param_grads = run(loss, student, teacher, student_side, teacher_side, mask)

    s64, params = student_side.float64_copy()
    t64, _ = teacher_side.float64_copy()
    student64 = [state.detach().double().requires_grad_() for state in student]
    trajectory, dynamics, fdd = reference(
        student64,
        teacher,
        s64,
        t64,
        mask,
        temperature=temperature,
        trajectory_weight=weights[0],
        dynamics_weight=weights[1],
    )
    fdd.backward()

    assert all(value.dtype == torch.float32 and value.dim() == 0 for value in out.values())
    assert num(out["fdd_trajectory"]) == pytest.approx(num(trajectory), rel=1e-5)
    assert num(out["fdd_dynamics"]) == pytest.approx(num(dynamics), rel=1e-5)
    assert num(out["fdd"]) == pytest.approx(num(fdd), rel=1e-5)
    assert num(dynamics) > 0.05 and num(trajectory) > 0.05  # neither term is trivially zero
    for mine, theirs in zip(grads, student64, strict=True):
        torch.testing.assert_close(mine.double(), theirs.grad, rtol=1e-4, atol=1e-6)
        assert mine[~mask].abs().max() == 0
    assert set(param_grads) == set(params)
    for name, grad in param_grads.items():
        assert grad.abs().max() > 0
        torch.testing.assert_close(grad.double(), params[name].grad, rtol=1e-4, atol=1e-6)


def test_masked_out_positions_change_nothing():
    student, teacher, mask = random_states(5)
    student_side, teacher_side = Side(D_S, V, "layer", 6), Side(D_T, V, None, 7)
    loss = FeatureDynamicsLoss(chunk_size=4)
    clean = run(loss, student, teacher, student_side, teacher_side, mask)

    dirty_student = [state.detach().clone() for state in student]
    dirty_teacher = [state.clone() for state in teacher]
    for state in dirty_student + dirty_teacher:
        state[~mask] = torch.randn_like(state[~mask]) * 1e4
    dirty_teacher[0][~mask] = float("nan")
    dirty_student = [state.requires_grad_() for state in dirty_student]
    dirty = run(loss, dirty_student, dirty_teacher, student_side, teacher_side, mask)

    for key in clean[0]:
        assert torch.equal(clean[0][key], dirty[0][key]), key
    for mine, theirs in zip(clean[1], dirty[1], strict=True):
        assert torch.equal(mine, theirs)
    for name in clean[2]:
        torch.testing.assert_close(clean[2][name], dirty[2][name], rtol=1e-6, atol=0)


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_chunked_equals_unchunked(chunk_size):
    student, teacher, mask = random_states(8)
    student_side, teacher_side = Side(D_S, V, "rms", 9), Side(D_T, V, "layer", 10)
    whole = run(FeatureDynamicsLoss(chunk_size=10**6), student, teacher, student_side, teacher_side, mask)
    chunked = run(FeatureDynamicsLoss(chunk_size=chunk_size), student, teacher, student_side, teacher_side, mask)
    for key in whole[0]:
        torch.testing.assert_close(chunked[0][key], whole[0][key], rtol=1e-6, atol=1e-7)
    for mine, theirs in zip(chunked[1], whole[1], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    for name in whole[2]:
        torch.testing.assert_close(chunked[2][name], whole[2][name], rtol=1e-6, atol=1e-7)


def test_logits_are_recomputed_in_backward_not_kept():
    student, teacher, mask = random_states(11)
    width = 23  # no other dimension of the test has this size
    student_side, teacher_side = Side(D_S, width, "layer", 12), Side(D_T, width, None, 13)
    calls = []
    saved = []

    def student_lens(hidden):
        calls.append(hidden.shape[0])
        return student_side(hidden)

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    loss = FeatureDynamicsLoss(chunk_size=3)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = loss(student, teacher, student_lens, teacher_side, mask)
    assert not [shape for shape in saved if width in shape], saved
    forward_calls = len(calls)
    tokens, pairs = int(mask.sum()), len(student)
    assert forward_calls == pairs * math.ceil(tokens / 3) and max(calls) <= 3
    out["fdd"].backward()
    assert len(calls) == 2 * forward_calls  # every chunk's logits recomputed once


def test_vocab_size_ignores_the_extra_columns():
    student, teacher, mask = random_states(14)
    student_wide, teacher_wide = Side(D_S, V + 3, "layer", 15), Side(D_T, V + 5, None, 16)
    student_exact, teacher_exact = Side(D_S, V, "layer", 15), Side(D_T, V, None, 16)
    with torch.no_grad():
        for wide, exact in ((student_wide, student_exact), (teacher_wide, teacher_exact)):
            exact.load_state_dict({k: v[:V] if k == "head.weight" else v for k, v in wide.state_dict().items()})
            wide.head.weight[V:] *= 50.0  # garbage rows that would dominate if they counted
    wide = run(FeatureDynamicsLoss(vocab_size=V), student, teacher, student_wide, teacher_wide, mask)
    exact = run(FeatureDynamicsLoss(), student, teacher, student_exact, teacher_exact, mask)
    for key in wide[0]:
        torch.testing.assert_close(wide[0][key], exact[0][key], rtol=1e-6, atol=1e-7)
    for mine, theirs in zip(wide[1], exact[1], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    assert wide[2]["head.weight"][V:].abs().max() == 0
    torch.testing.assert_close(wide[2]["head.weight"][:V], exact[2]["head.weight"], rtol=1e-6, atol=1e-7)

    # Default: the smaller width (the teacher's V here) is compared.
    default = run(FeatureDynamicsLoss(), student, teacher, student_wide, teacher_exact, mask)
    explicit = run(FeatureDynamicsLoss(vocab_size=V), student, teacher, student_wide, teacher_exact, mask)
    assert torch.equal(default[0]["fdd"], explicit[0]["fdd"])
    with pytest.raises(MtaError, match="vocab_size"):
        FeatureDynamicsLoss(vocab_size=V + 1)(student, teacher, student_wide, teacher_exact, mask)


def test_bf16_inputs_are_close_to_fp32():
    student, teacher, mask = random_states(17)
    student_side, teacher_side = Side(D_S, V, "layer", 18), Side(D_T, V, None, 19)
    loss = FeatureDynamicsLoss(chunk_size=4)
    full = run(loss, student, teacher, student_side, teacher_side, mask)

    student16 = [state.detach().bfloat16().requires_grad_() for state in student]
    teacher16 = [state.bfloat16() for state in teacher]
    student_side16 = Side(D_S, V, "layer", 18).bfloat16()
    student_side16.load_state_dict({k: v.bfloat16() for k, v in student_side.state_dict().items()})
    teacher_side16 = Side(D_T, V, None, 19).bfloat16()
    teacher_side16.load_state_dict({k: v.bfloat16() for k, v in teacher_side.state_dict().items()})
    half = run(loss, student16, teacher16, student_side16, teacher_side16, mask)

    for key in full[0]:
        assert half[0][key].dtype == torch.float32
        torch.testing.assert_close(half[0][key], full[0][key], rtol=5e-2, atol=1e-2)
    for mine, theirs in zip(half[1], full[1], strict=True):
        assert mine.dtype == torch.bfloat16
        assert torch.isfinite(mine).all()
        cosine = F.cosine_similarity(mine.float().flatten(), theirs.flatten(), dim=0)
        assert cosine > 0.97
    assert half[2]["head.weight"].dtype == torch.bfloat16


def test_maths_is_fp32_even_for_bf16_logits():
    # The same bf16 logits, read exactly in float64 by the reference: fp32 maths agrees to ~1e-6,
    # bf16 softmax/KL/cosine maths would be off by ~1e-2.
    student, teacher, mask = random_states(37)
    student16 = [state.detach().bfloat16() for state in student]
    teacher16 = [state.bfloat16() for state in teacher]
    student_side = Side(D_S, V, "layer", 38).bfloat16()
    teacher_side = Side(D_T, V, None, 39).bfloat16()
    out = FeatureDynamicsLoss(temperature=2.0, chunk_size=4)(student16, teacher16, student_side, teacher_side, mask)

    def exact(side):
        return lambda hidden: side(hidden.bfloat16()).double()

    expected = reference(student16, teacher16, exact(student_side), exact(teacher_side), mask, temperature=2.0)
    for key, value in zip(("fdd_trajectory", "fdd_dynamics", "fdd"), expected, strict=True):
        assert out[key].dtype == torch.float32
        assert num(out[key]) == pytest.approx(num(value), rel=2e-5), key


def test_cosine_clamps_each_norm_at_the_authors_eps():
    # A student change of norm ~5e-6 < eps = 1e-5, aligned with a large teacher change: the
    # clamped cosine is |dS| / eps ≈ 0.49 instead of 1, so the dynamics term is ≈ 0.51, not 0.
    student = [torch.zeros(1, 1, 3), torch.tensor([[[6e-6, 0.0, 0.0]]])]
    teacher = [torch.zeros(1, 1, 3), torch.tensor([[[1.0, 0.0, 0.0]]])]
    mask = torch.ones(1, 1, dtype=torch.bool)

    def identity(h):
        return h

    _, expected, _ = reference(student, teacher, identity, identity, mask, temperature=1.0)
    assert 0.4 < num(expected) < 0.6
    out = FeatureDynamicsLoss()(student, teacher, identity, identity, mask)
    assert num(out["fdd_dynamics"]) == pytest.approx(num(expected), abs=0.05)


def test_no_gradient_reaches_the_teacher_and_its_lens_runs_under_no_grad():
    student, teacher, mask = random_states(20)
    teacher = [state.requires_grad_() for state in teacher]
    student_side, teacher_side = Side(D_S, V, None, 21), Side(D_T, V, "layer", 22)
    grad_modes = {"student": [], "teacher": []}

    def student_lens(hidden):
        grad_modes["student"].append(torch.is_grad_enabled())
        return student_side(hidden)

    def teacher_lens(hidden):
        grad_modes["teacher"].append(torch.is_grad_enabled())
        assert not hidden.requires_grad
        return teacher_side(hidden)

    out = FeatureDynamicsLoss(chunk_size=2)(student, teacher, student_lens, teacher_lens, mask)
    out["fdd"].backward()
    assert grad_modes["teacher"] and not any(grad_modes["teacher"])  # forward and recompute
    assert grad_modes["student"] and all(grad_modes["student"])
    assert all(state.grad is None for state in teacher)
    assert all(p.grad is None for p in teacher_side.parameters())
    assert all(state.grad is not None for state in student)


def test_no_grad_mode_gives_the_same_values():
    student, teacher, mask = random_states(23)
    student_side, teacher_side = Side(D_S, V, "rms", 24), Side(D_T, V, None, 25)
    loss = FeatureDynamicsLoss(chunk_size=3)
    with_grad = loss(student, teacher, student_side, teacher_side, mask)
    with torch.no_grad():
        without = loss(student, teacher, student_side, teacher_side, mask)
    for key in with_grad:
        assert torch.equal(with_grad[key].detach(), without[key])
        assert not without[key].requires_grad


# --------------------------------------------------------------------------- edge cases


def test_single_pair_has_zero_dynamics():
    student, teacher, mask = random_states(26, pairs=1)
    student_side, teacher_side = Side(D_S, V, "layer", 27), Side(D_T, V, None, 28)
    loss = FeatureDynamicsLoss(temperature=3.0, trajectory_weight=0.5, dynamics_weight=2.0)
    out, grads, _ = run(loss, student, teacher, student_side, teacher_side, mask)
    s64, _ = student_side.float64_copy()
    t64, _ = teacher_side.float64_copy()
    trajectory, _, _ = reference(student, teacher, s64, t64, mask, temperature=3.0)
    assert num(out["fdd_dynamics"]) == 0.0
    assert num(out["fdd_trajectory"]) == pytest.approx(num(trajectory), rel=1e-5)
    assert num(out["fdd"]) == pytest.approx(0.5 * num(trajectory), rel=1e-5)
    assert grads[0].abs().max() > 0


def test_identical_student_and_teacher_give_zero_loss():
    student, _, mask = random_states(29)
    side = Side(D_S, V, "layer", 30)
    teacher = [state.detach() for state in student]
    out = FeatureDynamicsLoss()(student, teacher, side, side, mask)
    assert num(out["fdd_trajectory"]) == pytest.approx(0.0, abs=1e-6)
    assert num(out["fdd_dynamics"]) == pytest.approx(0.0, abs=1e-6)


def test_an_empty_mask_gives_zeros_with_zero_gradients():
    student, teacher, mask = random_states(31)
    student_side, teacher_side = Side(D_S, V, "layer", 32), Side(D_T, V, None, 33)
    empty = torch.zeros_like(mask)
    out, grads, param_grads = run(FeatureDynamicsLoss(), student, teacher, student_side, teacher_side, empty)
    assert all(num(value) == 0.0 and value.dtype == torch.float32 for value in out.values())
    assert all(grad.abs().max() == 0 for grad in grads)
    assert param_grads and all(grad.abs().max() == 0 for grad in param_grads.values())


def test_bad_arguments_are_refused():
    for kwargs in (
        {"temperature": 0.0},
        {"temperature": -1.0},
        {"chunk_size": 0},
        {"vocab_size": 0},
        {"trajectory_weight": -0.1},
        {"dynamics_weight": float("nan")},
    ):
        with pytest.raises(MtaError):
            FeatureDynamicsLoss(**kwargs)
    student, teacher, mask = random_states(34)
    student_side, teacher_side = Side(D_S, V, None, 35), Side(D_T, V, None, 36)
    loss = FeatureDynamicsLoss()
    with pytest.raises(MtaError, match="at least one"):
        loss([], [], student_side, teacher_side, mask)
    with pytest.raises(MtaError, match="student and"):
        loss(student, teacher[:2], student_side, teacher_side, mask)
    with pytest.raises(MtaError, match="bool"):
        loss(student, teacher, student_side, teacher_side, mask.float())
    with pytest.raises(MtaError, match="expected"):
        loss(student, teacher, student_side, teacher_side, mask[:, :-1])
    with pytest.raises(MtaError, match="expected"):
        loss([student[0][:, :, 0]] + student[1:], teacher, student_side, teacher_side, mask)
