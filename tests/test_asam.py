"""ASAM (mta.training.asam): ε against its closed form, one step against a hand-computed two-pass
update (plain torch, then through the Trainer and DeepSpeed ZeRO 0/1/2), the skipped
perturbation, ZeRO-3 refused, and an LLM recipe with train.asam trains."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fixtures.trainers import trainer_of
from mta.errors import MtaError
from mta.training.asam import Asam, perturbation
from mta.training.config.loading import load_recipe
from mta.training.config.schema import AsamSpec, TrainSpec

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny.yaml"


# ---------------------------------------------------------------- ε


def test_epsilon_is_the_closed_form_and_the_steepest_point_of_the_ellipsoid():
    """ε* = ρ T² g / ‖T g‖ maximises gᵀε over ‖T⁻¹ ε‖ ≤ ρ (T = |w| + η), with the norm over all
    parameters: written out element by element, and no other point of the ellipsoid does better."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]
    grads = [torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]
    rho, eta = 0.05, 0.01
    epsilon = perturbation(weights, grads, [True, True], rho=rho, eta=eta)
    flat_w = torch.cat([w.flatten() for w in weights]).tolist()
    flat_g = torch.cat([x.flatten() for x in grads]).tolist()
    scale = [abs(w) + eta for w in flat_w]
    norm = math.sqrt(sum((t * x) ** 2 for t, x in zip(scale, flat_g, strict=True)))
    expected = [rho * t * t * x / norm for t, x in zip(scale, flat_g, strict=True)]
    got = torch.cat([e.flatten() for e in epsilon])
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    assert [e.shape for e in epsilon] == [w.shape for w in weights]
    t = torch.tensor(scale, dtype=torch.float64)
    assert torch.linalg.vector_norm(got / t).item() == pytest.approx(rho, rel=1e-12)  # on the boundary
    rise = float(torch.tensor(flat_g, dtype=torch.float64) @ got)
    for _ in range(200):  # random points of the same ellipsoid climb less
        other = torch.randn(len(flat_w), generator=g, dtype=torch.float64)
        other = rho * t * other / torch.linalg.vector_norm(other)
        assert float(torch.tensor(flat_g, dtype=torch.float64) @ other) <= rise + 1e-15


def test_scope_weights_keeps_t_equal_to_one_off_the_weights():
    weight, bias = torch.tensor([2.0, -0.5], dtype=torch.float64), torch.tensor([3.0], dtype=torch.float64)
    grads = [torch.tensor([1.0, 1.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)]
    eps_w, eps_b = perturbation([weight, bias], grads, [True, False], rho=1.0, eta=0.0)
    norm = math.sqrt(2.0**2 + 0.5**2 + 1.0)  # ‖(|w|·g, 1·g_bias)‖
    assert eps_w.tolist() == pytest.approx([4.0 / norm, 0.25 / norm], rel=1e-12)
    assert eps_b.tolist() == pytest.approx([1.0 / norm], rel=1e-12)  # SAM's ρ g / ‖·‖ on the bias
    # The author's (eta 0): a weight at exactly 0 is never moved.
    assert perturbation([torch.zeros(2)], [torch.ones(2)], [True], rho=1.0, eta=0.0) is None


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf")])
def test_a_zero_or_non_finite_gradient_gives_no_perturbation(bad):
    grads = [torch.full((3,), bad)]
    assert perturbation([torch.ones(3)], grads, [True], rho=0.05, eta=0.01) is None


def test_a_skipped_step_leaves_the_weights_and_warns(caplog):
    model = nn.Linear(3, 1, bias=False)
    before = model.weight.detach().clone()
    asam = Asam(AsamSpec(), model)
    with caplog.at_level(logging.WARNING, logger="mta.training.asam"):
        with asam.perturbed([model.weight.sum() * 0.0], step=4) as perturbed:
            assert not perturbed and torch.equal(model.weight, before)
    assert asam.skipped == 1 and "step 5" in caplog.text and torch.equal(model.weight, before)
    assert model.weight.grad is None  # the first pass never touches .grad


# ---------------------------------------------------------------- one step, by hand


class Quadratic(nn.Module):
    """loss(x, y) = mean((w·x + b − y)²) + 0.1·Σw⁴: curved, so the gradient at w + ε differs."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([0.7, -1.3, 0.4], dtype=torch.float64))
        self.bias = nn.Parameter(torch.tensor([0.2], dtype=torch.float64))

    def forward(self, batch, teacher=None):
        x, y = batch.x, batch.y
        return {"total": ((x @ self.weight + self.bias - y) ** 2).mean() + 0.1 * (self.weight**4).sum()}


def _loss(w, b, batch):
    return ((batch.x @ w + b - batch.y) ** 2).mean() + 0.1 * (w**4).sum()


class Batch(SimpleNamespace):
    def to(self, device):
        return self


def _batches(count=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        Batch(
            x=torch.randn(4, 3, generator=g, dtype=torch.float64),
            y=torch.randn(4, generator=g, dtype=torch.float64),
            num_tokens=4,
            row_ids=[k],
        )
        for k in range(count)
    ]


def hand_asam_gradient(w, b, window, rho, eta, scope):
    """The two passes written out: g at w (summed over the window), ε = ρ T² g / ‖T g‖ with T on
    the weight (and on the bias unless scope is 'weights'), then the window's mean gradient at w + ε."""
    w0, b0 = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    g_w, g_b = torch.autograd.grad(sum(_loss(w0, b0, batch) for batch in window), (w0, b0))
    t_w = w.detach().abs() + eta
    t_b = b.detach().abs() + eta if scope == "all" else torch.ones_like(b)
    norm = torch.sqrt(((t_w * g_w) ** 2).sum() + ((t_b * g_b) ** 2).sum())
    w1 = (w.detach() + rho * t_w**2 * g_w / norm).requires_grad_()
    b1 = (b.detach() + rho * t_b**2 * g_b / norm).requires_grad_()
    return torch.autograd.grad(sum(_loss(w1, b1, batch) for batch in window) / len(window), (w1, b1))


@pytest.mark.parametrize("scope", ["all", "weights"])
def test_one_step_is_the_hand_computed_two_pass_update(scope):
    model, window, lr = Quadratic(), _batches(), 0.3
    spec = AsamSpec(rho=0.5, eta=0.01, scope=scope)
    expected = [
        p.detach() - lr * g
        for p, g in zip(
            (model.weight, model.bias),
            hand_asam_gradient(model.weight, model.bias, window, 0.5, 0.01, scope),
            strict=True,
        )
    ]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    asam = Asam(spec, model)
    with asam.perturbed(model(batch)["total"] for batch in window) as perturbed:
        assert perturbed and not torch.equal(model.weight.detach(), expected[0])
        for batch in window:
            (model(batch)["total"] / len(window)).backward()
    optimizer.step()  # on the restored w with the gradient at w + ε
    assert torch.allclose(model.weight, expected[0], rtol=0, atol=1e-13)
    assert torch.allclose(model.bias, expected[1], rtol=0, atol=1e-13)


# ---------------------------------------------------------------- through the Trainer and DeepSpeed


class ToyEngineModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Quadratic().float()
        self.student = self.inner  # what the trainer's checks walk

    def forward(self, batch, teacher=None):
        return self.inner(SimpleNamespace(x=batch.x.float(), y=batch.y.float()))


def _trainer(zero_stage: int, asam_spec):
    """A Trainer over a DeepSpeed engine of ToyEngineModel, its micro batches replaced."""
    from mta.training import engine as engines

    engines.init_distributed()
    train = TrainSpec(
        lr=0.05,
        projector_lr=0.05,
        weight_decay=0.0,
        schedule="constant",
        batch_size=2,
        micro_batch_size=1,
        max_steps=3,
        grad_clip=0.0,
        zero_stage=zero_stage,
        asam=asam_spec,
    )
    model = ToyEngineModel()
    engine = engines.initialize(model, [], train, {}, 3, 1)
    trainer = trainer_of(engine, train, accumulation=2)
    return trainer, engine


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@pytest.mark.parametrize("with_asam", [True, False])
def test_trainer_steps_are_adamw_on_the_hand_computed_gradients(zero_stage, with_asam):
    """Three optimizer steps of two micro batches each through Trainer.step and DeepSpeed give
    torch AdamW's steps on the gradients computed by hand: at w + ε with ASAM (the first pass
    leaves nothing in DeepSpeed's accumulated gradient), at w without; the gradient norm each step
    reports is that gradient's."""
    spec = AsamSpec(rho=0.5, eta=0.01) if with_asam else None
    trainer, engine = _trainer(zero_stage, spec)
    reference = Quadratic()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.0)
    try:
        for step in range(3):
            window = _batches(seed=10 + step)
            trainer.micro_batches = lambda _step, window=window: iter(window)
            losses = trainer.step(step)
            if with_asam:
                grads = hand_asam_gradient(reference.weight, reference.bias, window, 0.5, 0.01, "all")
            else:
                w0, b0 = (p.detach().clone().requires_grad_() for p in (reference.weight, reference.bias))
                loss = sum(_loss(w0, b0, batch) for batch in window) / len(window)
                grads = torch.autograd.grad(loss, (w0, b0))
            for param, grad in zip((reference.weight, reference.bias), grads, strict=True):
                param.grad = grad
            optimizer.step()
            assert math.isfinite(losses["total"])
            # metrics.jsonl's grad_norm: DeepSpeed's (ZeRO-1/2) or mta's own (ZeRO-0 keeps none).
            assert losses["grad_norm"] == pytest.approx(float(torch.cat([g.flatten() for g in grads]).norm()), rel=1e-5)
            inner = engine.module.inner
            assert torch.allclose(inner.weight.double(), reference.weight, rtol=0, atol=2e-6), (step, inner.weight)
            assert torch.allclose(inner.bias.double(), reference.bias, rtol=0, atol=2e-6)
    finally:
        engine.destroy()


def test_zero3_is_refused_in_the_recipe_with_its_line(tmp_path):
    text = TINY.read_text(encoding="utf-8").replace("  zero_stage: 1\n", "  zero_stage: 3\n  asam:\n    rho: 0.05\n")
    path = tmp_path / "tiny.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(MtaError) as caught:
        load_recipe(path)
    line = text.splitlines().index("  asam:") + 1
    assert f"line {line}: train.asam: ASAM does not run under train.zero_stage=3" in str(caught.value)
    assert "Use train.zero_stage 1 or 2" in str(caught.value)


def test_asam_keys_are_checked():
    with pytest.raises(MtaError, match="train.asam.scope: 'bias' is not allowed"):
        load_recipe(TINY, ["train.asam.scope=bias"])
    with pytest.raises(MtaError, match="train.asam.rho"):
        load_recipe(TINY, ["train.asam.rho=0"])
    recipe = load_recipe(TINY, ["train.asam={}"])
    assert (recipe.train.asam.rho, recipe.train.asam.eta, recipe.train.asam.scope) == (0.05, 0.0, "all")
    assert load_recipe(TINY).train.asam is None


def test_the_tiny_llm_recipe_trains_with_asam_and_it_changes_the_steps(tmp_path):
    """train.asam works for any recipe: the tiny LLM recipe trains, and its weights differ from
    the same run without ASAM (the gradient is taken at w + ε, not at w)."""
    from safetensors.torch import load_file

    from mta.training.lifecycle.metrics import read_metrics
    from mta.training.trainer import run_distillation

    common = [
        "train.max_steps=2",
        "train.save_interval=2",
        "train.eval_interval=100",
        "train.log_interval=1",
        "train.num_sample_generations=0",
        "data.dev=null",
    ]
    finals = {}
    for name, extra in (("asam", ["train.asam={rho: 0.5}"]), ("plain", [])):
        out = tmp_path / name
        finals[name] = run_distillation(load_recipe(TINY, [f"output_dir={out}", *common, *extra]))
        records = read_metrics(out / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2] and all(math.isfinite(r["loss"]) for r in records)
    asam, plain = (load_file(str(finals[name] / "model.safetensors")) for name in ("asam", "plain"))
    assert asam.keys() == plain.keys()
    assert any(not torch.equal(asam[key], plain[key]) for key in asam)
