"""loss.base uld and gold end to end on the tiny cross-tokenizer recipe (two tiny models whose
tokenizers differ), with MTA's DSA + HRA and SRA on top: gold trains, its dev cross-entropy on
the references falls, an interrupted run resumes to the uninterrupted weights and the export
loads; uld from a teacher cache at full k equals the online run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import MINIMAL_RECIPE
from fixtures.distill import weights
from fixtures.recipes import error_of, write
from mta.data.annotations import read_annotations
from mta.training.batching import AnnotatedExamples
from mta.training.config.loading import load_recipe
from mta.training.dry_run import plan_run
from mta.training.lifecycle.metrics import read_metrics
from mta.training.teacher_cache.teacher import run_teacher_stage
from mta.training.trainer import Trainer, run_distillation

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_CROSS = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cross.yaml"


def _recipe(out: Path, *overrides: str):
    return load_recipe(
        TINY_CROSS,
        [
            f"output_dir={out}",
            "train.max_steps=4",
            "train.save_interval=2",
            "train.eval_interval=4",
            "train.log_interval=1",
            "train.num_sample_generations=0",
            *overrides,
        ],
    )


def dev_cross_entropy(model_dir: Path, out: Path) -> float:
    """The student's mean cross-entropy on the reference responses of the run's dev rows."""
    table = read_annotations(out / "data" / "dev").table
    batch = AnnotatedExamples(table, student_pad_id=0, with_teacher=False, granularities=()).batch(
        np.arange(table.num_rows)
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        return float(
            model(
                input_ids=batch.student.input_ids,
                attention_mask=batch.student.attention_mask,
                labels=batch.student.labels,
            ).loss
        )


class _Interrupted(Exception):
    pass


@pytest.mark.slow
def test_gold_with_mta_and_sra_trains_resumes_and_exports(tmp_path, monkeypatch):
    final = run_distillation(_recipe(tmp_path / "gold", "loss.base=gold"))
    records = [r for r in read_metrics(tmp_path / "gold" / "metrics.jsonl") if r["split"] == "train"]
    assert len(records) == 4 and all(r["loss/base"] > 0 and r["loss/dsa"] > 0 and r["loss/sra"] > 0 for r in records)
    (start,) = (tmp_path / "gold" / "models").glob("student-*")
    assert dev_cross_entropy(final, tmp_path / "gold") < dev_cross_entropy(start, tmp_path / "gold")

    # The dry run counts the units on the run's annotated rows: against a plain count of them.
    table = read_annotations(tmp_path / "gold" / "data" / "train").table.to_pylist()
    units = single_s = single_t = tokens_s = tokens_t = 0
    for row in table:
        for span in row["boundary_spans"]:
            if (
                span["student_start"] >= row["student_prompt_len"]
                and span["teacher_start"] >= row["teacher_prompt_len"]
            ):
                size_s, size_t = (
                    span["student_end"] - span["student_start"],
                    span["teacher_end"] - span["teacher_start"],
                )
                units += 1
                tokens_s, tokens_t = tokens_s + size_s, tokens_t + size_t
                single_s += size_s == size_t == 1
    single_t = single_s
    notes = plan_run(_recipe(tmp_path / "gold", "loss.base=gold")).notes
    assert (
        f"gold: {units:,} aligned units in the responses of data.train's {len(table):,} rows; "
        f"{single_s / tokens_s:.1%} of the student's and {single_t / tokens_t:.1%} of the teacher's response tokens"
    ) in " ".join(notes)
    assert 0 < single_s < units

    real_step = Trainer.step

    def interrupted(self, step):
        if step == 2:  # after checkpoint step-2 was written
            raise _Interrupted
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "step", interrupted)
    with pytest.raises(_Interrupted):
        run_distillation(_recipe(tmp_path / "again", "loss.base=gold"))
    monkeypatch.setattr(Trainer, "step", real_step)
    resumed = run_distillation(_recipe(tmp_path / "again", "loss.base=gold"), resume="auto")
    expected, got = weights(final), weights(resumed)
    for name in expected:
        assert np.array_equal(expected[name].numpy(), got[name].numpy()), name


@pytest.mark.slow
def test_uld_from_a_teacher_cache_at_full_k_equals_the_online_run(tmp_path):
    # The cache holds no attention rows and no LM head: SRA's importance centres, no span logit term.
    settings = ("loss.base=uld", "loss.sra_centre=importance", "loss.sra_logit_weight=0", "train.max_steps=2")
    cache = tmp_path / "cache"
    cached_recipe = _recipe(
        tmp_path / "cached",
        *settings,
        f"teacher_cache.dir={cache}",
        "teacher_cache.top_k=320",
        "teacher_cache.storage=fp32",
        "teacher_cache.states=storage",
    )
    run_teacher_stage(cached_recipe)
    online = run_distillation(_recipe(tmp_path / "online", *settings))
    cached = run_distillation(cached_recipe)
    expected, got = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("online", "cached"))
    assert [r["split"] for r in got] == [r["split"] for r in expected]
    for want, have in zip(expected, got, strict=True):
        assert have["loss/base"] == pytest.approx(want["loss/base"], rel=2e-4), (want, have)
        assert have["loss"] == pytest.approx(want["loss"], rel=2e-4)
    for name, tensor in weights(online).items():
        torch.testing.assert_close(weights(cached)[name], tensor, rtol=1e-3, atol=1e-4)


UNIT_RECIPE = MINIMAL_RECIPE.format(teacher="teacher-model", student="student-model").replace(
    "  base: fkl\n", "  base: uld\n  uld_weight: 0\n  uld_ce_weight: 0\n"
)


def test_a_unit_base_that_compares_nothing_is_refused_at_its_line(tmp_path):
    path = write(tmp_path, UNIT_RECIPE)
    line = UNIT_RECIPE.splitlines().index("  uld_weight: 0") + 1
    message = error_of(path)
    assert (
        f"line {line}: loss.uld_weight: loss.base=uld with loss.uld_weight=0, loss.uld_ce_weight=0 compares nothing"
        in message
    )
    # gold has a third term: with it on, the same weights train; with it off, they are refused.
    assert load_recipe(path, ("loss.base=gold",)).loss.shared_kl_weight == 1.0
    assert "loss.shared_kl_weight=0 compares nothing" in error_of(path, ("loss.base=gold", "loss.shared_kl_weight=0"))
    assert load_recipe(path, ("loss.uld_ce_weight=1",)).loss.uld_ce_weight == 1.0
    message = error_of(path, ("loss.base=gold", "loss.shared_divergence=rkl"))
    assert "loss.shared_divergence" in message and "'fkl' or 'srkl'" in message


def test_generation_with_a_unit_base_is_refused_saying_why(tmp_path):
    text = UNIT_RECIPE.replace("  uld_weight: 0\n  uld_ce_weight: 0\n", "") + "off_policy:\n  mode: always\n"
    line = text.splitlines().index("  mode: always") + 1
    message = error_of(write(tmp_path, text))
    assert f"line {line}: off_policy.mode: loss.base=uld compares the two models on the units" in message
    assert "generated rows carry no such units; use off_policy.mode=off" in message
