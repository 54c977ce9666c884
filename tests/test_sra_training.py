"""SRA end to end on the tiny cross-tokenizer recipe (two tiny models whose tokenizers differ):
alone, with MTA, and an interrupted run that resumes to the uninterrupted weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from mta.training.metrics import read_metrics
from mta.training.recipe import load_recipe
from mta.training.trainer import Trainer, run_distillation

from test_distill import one_thread, weights  # noqa: F401  (fixtures)

TINY_CROSS = Path(__file__).resolve().parents[1] / "src" / "mta" / "recipes" / "tiny-cross.yaml"


def _recipe(out: Path, *overrides: str):
    return load_recipe(TINY_CROSS, [f"output_dir={out}", "data.dev=null", "train.max_steps=4",
                                    "train.save_interval=2", "train.log_interval=1", *overrides])


class _Interrupted(Exception):
    pass


@pytest.mark.slow
def test_sra_alone_and_with_mta_train_and_an_interrupted_run_resumes_to_the_same_weights(tmp_path, monkeypatch):
    alone = run_distillation(_recipe(tmp_path / "alone", "loss.dsa_weight=0", "loss.hra_weight=0"))
    records = [r for r in read_metrics(tmp_path / "alone" / "metrics.jsonl") if r["split"] == "train"]
    assert all(r["loss/sra"] > 0 and "loss/dsa" not in r for r in records)
    AutoModelForCausalLM.from_pretrained(alone)

    both = run_distillation(_recipe(tmp_path / "both"))
    records = [r for r in read_metrics(tmp_path / "both" / "metrics.jsonl") if r["split"] == "train"]
    assert all(r["loss/sra"] > 0 and r["loss/dsa"] > 0 for r in records)

    real_step = Trainer.step

    def interrupted(self, step):
        if step == 2:  # after checkpoint step-2 was written
            raise _Interrupted
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "step", interrupted)
    with pytest.raises(_Interrupted):
        run_distillation(_recipe(tmp_path / "again"))
    monkeypatch.setattr(Trainer, "step", real_step)
    resumed = run_distillation(_recipe(tmp_path / "again"), resume="auto")
    expected, got = weights(both), weights(resumed)
    for name in expected:
        assert np.array_equal(expected[name].numpy(), got[name].numpy()), name
