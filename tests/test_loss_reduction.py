"""``train.loss_reduction``: the same global batch gives the same gradient however it is split
into micro batches and processes (docs/method.md §5, "Reduction").

In process, through ``Trainer.step`` and DeepSpeed (ZeRO-1, one process, three micro batches of
1, 3 and 2 rows): with every term on, the accumulated gradient under ``global`` equals the
gradient of the plain objective on the six rows as one batch, and each logged term its value
there; under ``micro_batch`` it equals the mean of the three micro batches' own means (0.2.0's
behaviour, pinned). Each base loss and each term alone: tests/test_losses_global_counts.py. Run as a
script under torchrun, this file is the two-process worker (ZeRO-1 and ZeRO-3, gloo): each rank
trains its own unequal micro batches of the same six rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]  # as a torchrun worker: conftest and fixtures

from conftest import torchrun  # noqa: E402
from fixtures.distill import write_recipe  # noqa: E402

ROWS = np.arange(6)
GROUPS = ([0], [1, 2, 3], [4, 5])  # one process: three micro batches of unequal size and length
RANK_GROUPS = (([0], [1, 2, 3]), ([4], [5]))  # two processes, two micro batches each
TERMS = ("dsa", "hra", "fdd", "sra")
LOSS = {
    "base": "fkl",
    "dsa_weight": 1.0,
    "hra_weight": 1.0,
    "fdd_weight": 1.0,
    "fdd_layers": "auto",
    "sra_weight": 1.0,
    "sra_layers": "last",
    "layers": "auto",
}


def build(
    out: Path,
    teacher,
    student,
    annotations,
    *,
    accumulation: int,
    world_size: int = 1,
    zero_stage: int = 1,
    loss: dict | None = None,
):
    """A run of every term on the tiny pair (or ``loss``), its learning rates 0 (the weights never move)."""
    from mta.reporting import SilentReporter
    from mta.training.config.loading import load_recipe
    from mta.training.trainer import build_run

    path = write_recipe(
        out / "r.yaml",
        teacher=teacher,
        student=student,
        annotations=annotations,
        output_dir=out / "run",
        loss=loss or LOSS,
        data={"dev": None},  # nothing evaluated: no dev split to load
        train={
            "batch_size": 2 * accumulation * world_size,
            "micro_batch_size": 2,
            "max_steps": 1,
            "zero_stage": zero_stage,
        },
    )
    run = build_run(load_recipe(path), SilentReporter())
    for group in run.engine.optimizer.param_groups:
        group["lr"] = 0.0
    run.engine.lr_scheduler.base_lrs = [0.0 for _ in run.engine.lr_scheduler.base_lrs]  # every later step too
    return run


def only(run, term: str, base: str = "fkl") -> None:
    """Weigh ``term`` 1 and every other term 0; ``base`` as the base loss."""
    from mta.losses.kd import build_base_loss

    objective = run.engine.module.objective
    objective.base = build_base_loss(base, vocab_size=objective.base.vocab_size, chunk_size=16)
    objective.weights = {name: float(name == term) for name in objective.weights}


def step_gradient(run, groups, reduction: str, monkeypatch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``Trainer.step`` over micro batches of ``groups`` rows: the full gradient DeepSpeed holds just
    before the optimizer step (every process's), and the step's record."""
    from deepspeed.utils import safe_get_full_grad

    from mta.training import engine as engines
    from mta.training.trainer import Trainer

    run.recipe = run.recipe.model_copy(
        update={"train": run.recipe.train.model_copy(update={"loss_reduction": reduction})}
    )
    trainer = Trainer(run, reporter=None)
    trainer.micro_batches = lambda step: (run.train.batch(np.array(rows)) for rows in groups)
    captured: dict[str, torch.Tensor] = {}
    real = engines.own_gradient_norm

    def capture(engine):
        for name, param in engine.module.named_parameters():
            grad = safe_get_full_grad(param)
            if grad is not None:
                captured[name] = grad.detach().float().clone()
        return real(engine)

    monkeypatch.setattr(engines, "own_gradient_norm", capture)
    record = trainer.step(0)
    return captured, record


def plain_gradient(run, groups) -> dict[str, torch.Tensor]:
    """The gradient of the mean over ``groups`` of the objective's own mean on each group's rows,
    by autograd outside DeepSpeed (one group of every row: the global batch's gradient)."""
    from mta.training.trainer import Trainer

    trainer = Trainer(run, reporter=None)
    named = [(name, p) for name, p in run.engine.module.named_parameters() if p.requires_grad]
    total = 0.0
    for rows in groups:
        batch = run.train.batch(np.array(rows)).to(run.device)
        total = total + run.engine.module(batch, trainer.teacher_forward(batch))["total"] / len(groups)
    grads = torch.autograd.grad(total, [p for _, p in named], allow_unused=True)
    return {name: g.detach().float() for (name, _), g in zip(named, grads, strict=True) if g is not None}


def gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Relative distance of two gradients over the parameters both hold."""
    names = sorted(set(a) & set(b))
    left = torch.cat([a[n].flatten() for n in names])
    right = torch.cat([b[n].flatten() for n in names])
    return float((left - right).norm() / right.norm().clamp(min=1e-30))


# --------------------------------------------------------------------------- in process

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory, teacher_dir, tiny_model_dir, same_data):
    built = build(tmp_path_factory.mktemp("reduction"), teacher_dir, tiny_model_dir, same_data, accumulation=3)
    yield built
    built.close()


def test_global_reduction_gives_the_global_batch_gradient_under_accumulation(run, monkeypatch):
    """Every term at once (fkl + DSA + HRA + FDD + SRA): the gradient is the global batch's, and
    each term's logged value is its global value (a term divided by a wrong count would show)."""
    from mta.training.trainer import Trainer

    only(run, "all", "fkl")
    objective = run.engine.module.objective
    objective.weights = {name: 1.0 for name in objective.weights}
    whole = plain_gradient(run, [ROWS])
    batch = run.train.batch(ROWS).to(run.device)
    with torch.no_grad():
        expected = run.engine.module(batch, Trainer(run, None).teacher_forward(batch))
    assert set(expected) == {"base", *TERMS, "total"}
    split, record = step_gradient(run, GROUPS, "global", monkeypatch)
    assert set(split) >= set(whole)
    assert gap(split, whole) < 1e-4
    for name, value in expected.items():
        assert record[name] == pytest.approx(value.item(), rel=1e-5), name
    # The three micro batches' own means averaged: another gradient (what the test tells apart).
    assert gap(plain_gradient(run, GROUPS), whole) > 1e-2


def test_micro_batch_reduction_keeps_the_mean_of_micro_batch_means(run, monkeypatch):
    only(run, "base", "srkl")
    means, whole = plain_gradient(run, GROUPS), plain_gradient(run, [ROWS])
    split, _ = step_gradient(run, GROUPS, "micro_batch", monkeypatch)
    assert gap(split, means) < 1e-4
    assert gap(split, whole) > 1e-2


# --------------------------------------------------------------------------- two processes

# ZeRO-3 without FDD: its logit lens calls the LM head once per chunk of positions, so two
# processes with different token counts would gather the partitioned head unequally often.
ZERO3_LOSS = {**LOSS, "fdd_weight": 0.0}


def test_two_processes_under_zero_1_and_zero_3_give_the_global_batch_gradient(
    run, tmp_path, teacher_dir, tiny_model_dir, same_data
):
    only(run, "all")
    objective = run.engine.module.objective
    objective.weights = {name: 1.0 for name in objective.weights}
    whole = {1: plain_gradient(run, [ROWS])}
    objective.weights["fdd"] = 0.0
    whole[3] = plain_gradient(run, [ROWS])
    torchrun(
        [__file__, "--out", tmp_path, "--teacher", teacher_dir, "--student", tiny_model_dir, "--data", same_data],
        timeout=240,
    )
    for stage in (1, 3):
        grads = torch.load(tmp_path / f"zero{stage}.pt")
        assert set(grads) >= set(whole[stage])
        assert gap(grads, whole[stage]) < 1e-4, stage


def worker(args) -> None:
    """Each rank: a run at ZeRO-1, then one at ZeRO-3 (without FDD), every term weighted 1;
    rank 0 saves the full gradient of the step over its ``RANK_GROUPS``."""
    from mta import distributed
    from mta.losses.kd import build_base_loss

    torch.set_num_threads(1)
    for stage in args.stages:
        out = Path(args.out) / f"stage{stage}"
        out.mkdir(parents=True, exist_ok=True)
        loss = LOSS if stage < 3 else ZERO3_LOSS
        built = build(
            out, args.teacher, args.student, args.data, accumulation=2, world_size=2, zero_stage=stage, loss=loss
        )
        objective = built.engine.module.objective
        objective.base = build_base_loss("fkl", vocab_size=objective.base.vocab_size, chunk_size=16)
        objective.weights = {name: 1.0 for name in objective.weights}
        with pytest.MonkeyPatch.context() as patch:
            grads, _ = step_gradient(built, RANK_GROUPS[distributed.rank()], "global", patch)
        if distributed.rank() == 0:
            torch.save(grads, Path(args.out) / f"zero{stage}.pt")
        built.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("out", "teacher", "student", "data"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    worker(parser.parse_args())
