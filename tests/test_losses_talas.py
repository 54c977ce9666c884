"""TALAS's terms (mta.losses.talas) and the student's pooling against plain loop references.

The references loop over rows, tokens, layers and matrix entries with scalar float64 maths and
share no code with mta; values and gradients are compared, and padding must change nothing.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.talas_losses import ref_cls_attention, ref_lasd, ref_mean, ref_simcse, ref_tamd
from mta.embedding.pooling import cls_attention_pool, pool
from mta.losses.talas import TeacherAnchor, lasd_loss, simcse_loss, tamd_loss

L, B, D_S, D_T, T = 4, 5, 6, 7, 9
LENGTHS = [9, 4, 1, 6, 3]  # real tokens per row; the rest is right padding


def _mask() -> torch.Tensor:
    return torch.tensor([[1] * n + [0] * (T - n) for n in LENGTHS])


def numeric_grad(function, tensor, eps=1e-6):
    """Central differences of a float64 scalar function over every entry of ``tensor``."""
    grad = torch.zeros_like(tensor)
    flat, out = tensor.view(-1), grad.view(-1)
    for index in range(flat.numel()):
        keep = flat[index].item()
        flat[index] = keep + eps
        plus = function()
        flat[index] = keep - eps
        minus = function()
        flat[index] = keep
        out[index] = (plus - minus) / (2 * eps)
    return grad


# ---------------------------------------------------------------- pooling


@pytest.mark.parametrize("mode", ["cls_attention", "mean", "cls"])
def test_pooling_matches_the_loop_and_ignores_padding(mode):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, D_S, generator=g, dtype=torch.float64)
    mask = _mask()
    pooled = pool(hidden, mask, mode)
    rows = hidden.tolist()
    expected = {
        "cls_attention": lambda: ref_cls_attention(rows, LENGTHS),
        "mean": lambda: ref_mean(rows, LENGTHS),
        "cls": lambda: [row[0] for row in rows],
    }[mode]()
    # float64 in, float64 throughout: as exact as the loop (float32 sums would be ~1e-8 off).
    assert torch.allclose(pooled, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # Anything in the padded positions (and more padding) leaves every row's embedding as it was.
    noisy = hidden.clone()
    noisy[mask == 0] = 1e3 * torch.randn(int((mask == 0).sum()), D_S, generator=g, dtype=torch.float64)
    longer = torch.cat([noisy, torch.randn(B, 3, D_S, generator=g, dtype=torch.float64)], dim=1)
    assert torch.allclose(pool(longer, torch.cat([mask, torch.zeros(B, 3, dtype=mask.dtype)], 1), mode), pooled)


def test_cls_attention_gradient_matches_the_loop():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, T, D_S, generator=g, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(B, D_S, generator=g, dtype=torch.float64)
    (cls_attention_pool(hidden, _mask()) * probe).sum().backward()
    base = hidden.detach().clone()
    numeric = numeric_grad(
        lambda: sum(
            sum(a * b for a, b in zip(row, w, strict=True))
            for row, w in zip(ref_cls_attention(base.tolist(), LENGTHS), probe.tolist(), strict=True)
        ),
        base,
    )
    assert torch.allclose(hidden.grad, numeric, atol=1e-6)
    assert (hidden.grad[_mask() == 0] == 0).all()  # padding gets no gradient


# ---------------------------------------------------------------- TAMD


def test_tamd_matches_the_loop_in_value_and_gradient():
    g = torch.Generator().manual_seed(2)
    anchor = TeacherAnchor(2, D_S, D_T).double()
    with torch.no_grad():
        for projection in anchor.projections:
            projection.weight.copy_(torch.randn(D_T, D_S, generator=g))
    embeddings = torch.randn(2, B, D_S, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(B, D_T, generator=g, dtype=torch.float64)
    loss = anchor(embeddings, teacher)
    weights = [p.weight.detach().tolist() for p in anchor.projections]
    assert loss.item() == pytest.approx(ref_tamd(embeddings.tolist(), weights, teacher.tolist()), abs=1e-12)
    loss.backward()
    base = embeddings.detach().clone()
    numeric = numeric_grad(lambda: ref_tamd(base.tolist(), weights, teacher.tolist()), base)
    assert torch.allclose(embeddings.grad, numeric, atol=1e-6)
    w0 = anchor.projections[0].weight.detach().clone()
    numeric_w = numeric_grad(lambda: ref_tamd(base.tolist(), [w0.tolist(), weights[1]], teacher.tolist()), w0)
    assert torch.allclose(anchor.projections[0].weight.grad, numeric_w, atol=1e-6)


def test_tamd_is_zero_when_the_projection_is_parallel_to_the_teacher():
    g = torch.Generator().manual_seed(3)
    projected = torch.randn(2, B, D_T, generator=g, dtype=torch.float64)
    scales = torch.rand(2, B, 1, generator=g, dtype=torch.float64) + 0.5  # positive: same direction
    assert tamd_loss(projected, projected[0]).item() > 0.1  # layer 1 points elsewhere
    assert tamd_loss(projected[:1] * scales[:1], projected[0]).item() == pytest.approx(0.0, abs=1e-12)
    assert tamd_loss(-projected[:1], projected[0]).item() == pytest.approx(2.0, abs=1e-12)


def test_projections_start_as_the_author_initialises_them():
    torch.manual_seed(0)
    anchor = TeacherAnchor(2, 384, 1024)
    weights = torch.cat([p.weight.flatten() for p in anchor.projections])
    assert all(p.bias is None for p in anchor.projections)
    assert weights.std().item() == pytest.approx(1e-3, rel=0.01) and abs(weights.mean().item()) < 1e-5


# ---------------------------------------------------------------- LASD


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_lasd_matches_the_loop_in_value_and_gradient(reduction):
    g = torch.Generator().manual_seed(4)
    embeddings = torch.randn(L, B, D_S, generator=g, dtype=torch.float64, requires_grad=True)
    loss = lasd_loss(embeddings, reduction=reduction)
    assert loss.item() == pytest.approx(ref_lasd(embeddings.tolist(), reduction=reduction), rel=1e-12)
    loss.backward()
    base = embeddings.detach().clone()
    numeric = numeric_grad(lambda: ref_lasd(base.tolist(), reduction=reduction), base)
    assert torch.allclose(embeddings.grad, numeric, atol=1e-6)


def test_lasd_sum_is_the_mean_times_the_matrix_entries():
    embeddings = torch.randn(L, B, D_S, generator=torch.Generator().manual_seed(5))
    assert lasd_loss(embeddings, reduction="sum").item() == pytest.approx(
        B * B * lasd_loss(embeddings, reduction="mean").item(), rel=1e-5
    )


def test_lasd_is_zero_for_identical_layers_and_for_rescaled_ones():
    layer = torch.randn(1, B, D_S, generator=torch.Generator().manual_seed(6))
    same = layer.expand(L, B, D_S)
    assert lasd_loss(same).item() == pytest.approx(0.0, abs=1e-12)
    assert lasd_loss(torch.cat([layer, 3.0 * layer])).item() == pytest.approx(0.0, abs=1e-10)
    assert lasd_loss(torch.cat([layer, layer.flip(1)])).item() > 0.01


def test_lasd_detach_keeps_the_guide_out_of_the_gradient():
    g = torch.Generator().manual_seed(7)
    embeddings = torch.randn(2, B, D_S, generator=g, dtype=torch.float64, requires_grad=True)
    lasd_loss(embeddings, detach_upper=True).backward()
    assert (embeddings.grad[1] == 0).all() and embeddings.grad[0].abs().sum() > 0
    embeddings.grad = None
    lasd_loss(embeddings).backward()  # the author's: both layers move
    assert embeddings.grad[1].abs().sum() > 0
    detached = lasd_loss(embeddings, detach_upper=True)
    assert detached.item() == pytest.approx(lasd_loss(embeddings).item(), rel=1e-12)  # same value


# ---------------------------------------------------------------- SimCSE


def test_simcse_matches_the_loop_in_value_and_gradient():
    g = torch.Generator().manual_seed(8)
    first = torch.randn(B, D_S, generator=g, dtype=torch.float64, requires_grad=True)
    second = torch.randn(B, D_S, generator=g, dtype=torch.float64)
    loss = simcse_loss(first, second, temperature=0.1)
    assert loss.item() == pytest.approx(ref_simcse(first.tolist(), second.tolist(), 0.1), rel=1e-12)
    loss.backward()
    base = first.detach().clone()
    numeric = numeric_grad(lambda: ref_simcse(base.tolist(), second.tolist(), 0.1), base)
    assert torch.allclose(first.grad, numeric, atol=1e-6)


def test_simcse_is_lowest_when_each_row_finds_its_own_second_pass():
    g = torch.Generator().manual_seed(9)
    first = torch.randn(B, D_S, generator=g)
    assert simcse_loss(first, first).item() < simcse_loss(first, first.roll(1, 0)).item()
    assert simcse_loss(first, first, temperature=0.01).item() < 1e-3
