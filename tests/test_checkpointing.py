"""Checkpoints: a crash while saving leaves the previous ones whole, only the newest N are kept,
--resume picks the newest complete one, and metrics.jsonl never describes a step twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mta.errors import MtaError
from mta.training.config.loading import load_recipe
from mta.training.lifecycle import checkpointing as checkpoint
from mta.training.lifecycle.checkpointing import complete_checkpoints, latest_checkpoint, resolve_resume
from mta.training.lifecycle.metrics import MetricsLog, read_metrics
from mta.training.trainer import run_distillation

pytestmark = pytest.mark.usefixtures("one_thread")


def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    path = root / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / checkpoint.STATE_FILE).write_text("{}")
    return path


def test_latest_checkpoint_ignores_partial_and_foreign_directories(tmp_path):
    _fake_checkpoint(tmp_path, 4)
    _fake_checkpoint(tmp_path, 10)
    _fake_checkpoint(tmp_path, 12, complete=False)  # killed before its state file was written
    (tmp_path / "checkpoints" / "step-14.partial").mkdir()
    (tmp_path / "checkpoints" / "notes").mkdir()
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [4, 10]
    assert latest_checkpoint(tmp_path).name == "step-10"
    assert resolve_resume("auto", tmp_path).name == "step-10"
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("auto", tmp_path / "elsewhere") is None  # nothing yet: start fresh
    with pytest.raises(MtaError, match="not a complete checkpoint"):
        resolve_resume(str(tmp_path / "checkpoints" / "step-12"), tmp_path)


def test_metrics_log_drops_the_lines_after_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"split": "train", "step": step, "loss": 1.0} for step in range(1, 7)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"split": "tr')  # torn line
    log = MetricsLog(path, resume_step=4)
    log.write({"split": "train", "step": 5, "loss": 0.5})
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 0.5)]
    MetricsLog(path)  # a fresh run starts a fresh file
    assert not path.exists()


@pytest.mark.slow
def test_crash_while_saving_keeps_the_previous_checkpoints(tmp_path, monkeypatch, tiny_run_recipe):
    out = tmp_path / "run"
    recipe = load_recipe(
        tiny_run_recipe(
            out,
            data={"dev": None},
            train={"max_steps": 8, "save_interval": 1, "keep_checkpoints": 2},
        )
    )
    saves = {"n": 0}
    real_export = checkpoint.export_student

    def crash_on_fourth(engine, tokenizer, recipe, directory, **options):
        saves["n"] += 1
        real_export(engine, tokenizer, recipe, directory, **options)
        if saves["n"] == 4:
            raise KeyboardInterrupt("simulated crash half-way through a checkpoint")

    monkeypatch.setattr(checkpoint, "export_student", crash_on_fourth)
    with pytest.raises(KeyboardInterrupt):
        run_distillation(recipe)
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    # Only the newest two complete ones are kept; the interrupted one was removed.
    assert names == ["step-2", "step-3"]
    assert latest_checkpoint(out).name == "step-3"
    monkeypatch.setattr(checkpoint, "export_student", real_export)
    final = run_distillation(recipe, resume="auto")
    assert final.name == "final"
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step-7", "step-8"]


def test_checkpoint_at_end_false_writes_final_but_no_last_step_checkpoint(tmp_path, tiny_run_recipe):
    """train.checkpoint_at_end=false (the quick demo): the interval's checkpoint is written as
    usual, the last step's is not, final/ is."""
    out = tmp_path / "run"
    recipe = load_recipe(
        tiny_run_recipe(out, data={"dev": None}, train={"max_steps": 2, "save_interval": 1, "checkpoint_at_end": False})
    )
    assert run_distillation(recipe) == out / "final" and (out / "final" / "config.json").is_file()
    assert [path.name for _, path in complete_checkpoints(out)] == ["step-1"]
