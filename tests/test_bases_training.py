"""The other published bases end to end on tiny models: FDD (alone and with the student's own
samples) and DistiLLM-2 (`mta generate` -> `mta annotate` -> `mta distill loss.base=distillm2`).
Each trains, logs its term, and leaves a checkpoint that loads with transformers alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import EXAMPLES
from fixtures.distill import LENGTHS, write_recipe
from mta.data.annotate import AnnotateSettings, annotate_file
from mta.data.annotations import read_annotations
from mta.pairs.generate import PairSettings, generate_pairs
from mta.training import trainer as trainer_module
from mta.training.config.loading import load_recipe
from mta.training.lifecycle.metrics import read_metrics
from mta.training.trainer import run_distillation

pytestmark = pytest.mark.usefixtures("one_thread")


def _train_records(out):
    return [r for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("generation", ["off", "always"])
def test_fdd_trains_with_and_without_the_students_samples_and_reloads(
    tmp_path, teacher_dir, tiny_model_dir, same_data, generation
):
    path = write_recipe(
        tmp_path / "fdd.yaml",
        teacher=teacher_dir,
        student=tiny_model_dir,
        annotations=same_data,
        output_dir=tmp_path / "fdd",
        data={"dev": None},
        loss={"fdd_weight": 1.0, "fdd_tokens": "response" if generation == "always" else "all"},
        off_policy={"mode": generation, "max_new_tokens": 8},
        train={"max_steps": 2},
    )
    final = run_distillation(load_recipe(path))
    records = _train_records(tmp_path / "fdd")
    assert all(r["loss/fdd"] > 0 for r in records)
    if generation == "always":
        assert sum(r["off_policy/generated"] for r in records) == 4
    reloaded = AutoModelForCausalLM.from_pretrained(final)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert any(not torch.equal(a, b) for a, b in zip(reloaded.parameters(), start.parameters(), strict=True))


@pytest.mark.slow
def test_distillm2_trains_on_generated_pairs_kept_together(
    tmp_path, teacher_dir, tiny_model_dir, same_data, monkeypatch
):
    pairs = generate_pairs(
        teacher_dir,
        tiny_model_dir,
        EXAMPLES,
        tmp_path / "pairs.jsonl",
        PairSettings(max_new_tokens=8, batch_size=8, limit=12),
    ).path
    settings = AnnotateSettings(teacher=str(teacher_dir), student=str(tiny_model_dir), workers=1, **LENGTHS)
    annotated = annotate_file(pairs, tmp_path / "pairs-ann", settings)
    table = read_annotations(annotated).table
    assert table.num_rows == 24 and table.column("role").to_pylist() == ["chosen", "rejected"] * 12

    seen = []
    real = trainer_module.Trainer.teacher_forward

    def recording(self, batch, split="train"):
        if batch.chosen is not None:  # dev batches (Dolly-like rows, no pairs) are not recorded
            seen.append((batch.row_ids, batch.chosen.tolist()))
        return real(self, batch, split)

    monkeypatch.setattr(trainer_module.Trainer, "teacher_forward", recording)
    # The dev set holds no pairs, as the published recipes' (Dolly's dev rows): its loss reads
    # every reference response as a chosen one.
    path = write_recipe(
        tmp_path / "d2.yaml",
        teacher=teacher_dir,
        student=tiny_model_dir,
        annotations=annotated,
        output_dir=tmp_path / "d2",
        data={"dev": str(same_data)},
        loss={"base": "distillm2"},
        train={"max_steps": 3, "eval_interval": 3},
    )
    final = run_distillation(load_recipe(path))
    # Every micro batch is whole pairs, the teacher's response first.
    assert len(seen) == 3 * 2
    for row_ids, chosen in seen:
        ids = np.array([int(row) for row in row_ids])
        assert chosen == [True, False] and ids[1] == ids[0] + 1 and ids[0] % 2 == 0
    assert all(np.isfinite(r["loss/base"]) and r["loss/base"] > 0 for r in _train_records(tmp_path / "d2"))
    dev = [r for r in read_metrics(tmp_path / "d2" / "metrics.jsonl") if r["split"] == "dev"]
    assert dev and all(np.isfinite(r["loss/base"]) and r["loss/base"] > 0 for r in dev)
    AutoModelForCausalLM.from_pretrained(final)


def test_distillm2_on_data_without_pairs_is_refused_before_training(tmp_path, teacher_dir, tiny_model_dir, same_data):
    from mta.errors import MtaError

    path = write_recipe(
        tmp_path / "d2.yaml",
        teacher=teacher_dir,
        student=tiny_model_dir,
        annotations=same_data,
        output_dir=tmp_path / "d2",
        data={"dev": None},
        loss={"base": "distillm2"},
        train={"max_steps": 1},
    )
    with pytest.raises(MtaError, match=r"loss\.base=distillm2 trains on pair rows, and data\.train .* holds none"):
        run_distillation(load_recipe(path))
    assert not (tmp_path / "d2" / "checkpoints").exists()
