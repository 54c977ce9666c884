"""One run per output_dir: another run's outputs are never pruned, resumed or overwritten by
accident, and a step that leaves non-finite weights is never saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.distill import weights, write_recipe
from mta.errors import MtaError
from mta.training.config.loading import load_recipe
from mta.training.lifecycle import run_directory
from mta.training.lifecycle.metrics import read_metrics
from mta.training.trainer import NonFiniteWeights, run_distillation

pytestmark = pytest.mark.usefixtures("one_thread")


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _used_directory(root: Path) -> Path:
    """An output_dir as a finished run leaves it, plus the caches any run may reuse."""
    out = root / "run"
    for name in ("checkpoints/step-40", "checkpoints/step-48", "final", "data/train", "models/tokenizer-512-abc"):
        (out / name).mkdir(parents=True)
        (out / name / "file").write_text(name)
    (out / "metrics.jsonl").write_text('{"split": "train", "step": 48, "loss": 1.0}\n')
    (out / "run.json").write_text(json.dumps({"run_id": "old-run"}))
    return out


def test_a_new_run_into_a_used_directory_is_refused_and_touches_nothing(tmp_path):
    out = _used_directory(tmp_path)
    before = _files(out)
    with pytest.raises(MtaError) as error:
        run_directory.claim(out, "test", resume=None, overwrite=False)
    message = str(error.value)
    assert str(out) in message and "--resume auto" in message and "--overwrite" in message
    assert "checkpoints/" in message and "final/" in message and "metrics.jsonl" in message
    assert _files(out) == before


def test_overwrite_removes_the_run_outputs_and_keeps_the_caches(tmp_path):
    out = _used_directory(tmp_path)
    owner = run_directory.claim(out, "test", resume=None, overwrite=True)
    assert not owner.continued and owner.run_id != "old-run"
    assert sorted(p.name for p in out.iterdir()) == ["data", "models", "run.json"]
    assert (out / "data" / "train" / "file").read_text() == "data/train"
    assert json.loads((out / "run.json").read_text())["run_id"] == owner.run_id


def test_resume_continues_the_run_that_owns_the_directory(tmp_path):
    out = _used_directory(tmp_path)
    before = _files(out)
    owner = run_directory.claim(out, "test", resume="auto", overwrite=False)
    assert owner.continued and owner.run_id == "old-run"
    assert _files(out) == before
    with pytest.raises(MtaError, match="give one of them"):
        run_directory.claim(out, "test", resume="auto", overwrite=True)


def test_an_empty_or_cache_only_directory_starts_a_run(tmp_path):
    out = tmp_path / "run"
    (out / "data").mkdir(parents=True)
    (out / "checkpoints").mkdir()
    first = run_directory.claim(out, "test", resume=None, overwrite=False)
    assert not first.continued and (out / "run.json").exists()
    # --resume auto on a directory without checkpoints continues nothing: same run, no refusal.
    assert run_directory.claim(out, "test", resume="auto", overwrite=False).run_id == first.run_id


@pytest.mark.slow
def test_the_used_directory_of_the_bug_report_is_refused_then_overwritten(
    tmp_path, teacher_dir, tiny_model_dir, same_data
):
    """The reported case: a second run (another lr) into the first run's output_dir."""
    out = tmp_path / "run"
    common = dict(teacher=teacher_dir, student=tiny_model_dir, annotations=same_data, output_dir=out)
    first = write_recipe(tmp_path / "a.yaml", train={"max_steps": 4, "save_interval": 2}, **common)
    run_distillation(load_recipe(first))
    finished = _files(out)
    second = write_recipe(tmp_path / "b.yaml", train={"max_steps": 2, "save_interval": 1, "lr": 1e-3}, **common)
    with pytest.raises(MtaError, match="holds another run's outputs"):
        run_distillation(load_recipe(second))
    assert _files(out) == finished
    final = run_distillation(load_recipe(second), overwrite=True)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"] == [1, 2]
    assert weights(final) != {}


@pytest.mark.slow
def test_a_step_that_leaves_non_finite_weights_is_never_saved(tmp_path, teacher_dir, tiny_model_dir, same_data):
    """Finite recipe values whose first update is not: lr x weight decay overflows fp32.

    (Infinite gradients alone do not get here: DeepSpeed skips a step whose gradient norm
    overflows. An infinite ``train.lr`` is refused by the recipe schema before any step.)
    """
    out = tmp_path / "run"
    recipe = load_recipe(
        write_recipe(
            tmp_path / "r.yaml",
            teacher=teacher_dir,
            student=tiny_model_dir,
            annotations=same_data,
            output_dir=out,
            train={"lr": 1e30, "weight_decay": 1e10, "save_interval": 1},
            data={"dev": None},
        )
    )
    with pytest.raises(NonFiniteWeights, match=r"step 1 left non-finite weights.*--resume auto train\.lr="):
        run_distillation(recipe)
    assert not (out / "final").exists()
    assert not any((out / "checkpoints").glob("step-*"))


@pytest.mark.slow
def test_a_resume_applies_a_lower_lr_and_a_longer_run_and_refuses_a_new_batch(
    tmp_path, teacher_dir, tiny_model_dir, same_data
):
    out = tmp_path / "run"
    common = dict(
        teacher=teacher_dir, student=tiny_model_dir, annotations=same_data, output_dir=out, data={"dev": None}
    )
    run_distillation(
        load_recipe(write_recipe(tmp_path / "a.yaml", train={"max_steps": 2, "save_interval": 2}, **common))
    )
    path = write_recipe(tmp_path / "b.yaml", train={"max_steps": 2, "save_interval": 2}, **common)
    with pytest.raises(MtaError) as error:
        run_distillation(load_recipe(path, ["train.batch_size=8", "train.micro_batch_size=4"]), resume="auto")
    assert "train.batch_size: 4 → 8" in str(error.value) and "train.micro_batch_size: 2 → 4" in str(error.value)
    run_distillation(load_recipe(path, ["train.lr=1e-4", "train.max_steps=4"]), resume="auto")
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["lr"] for r in records] == pytest.approx([5e-3, 5e-3, 1e-4, 1e-4])  # constant schedule
