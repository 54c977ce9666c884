"""The demo chains every stage: run it end to end on a tiny teacher, then check its report."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from fixtures.instruct import example_instruct_dir
from fixtures.perplexity import loop_sums
from mta.demo.pipeline import run_demo
from mta.demo.report import table, write_report
from mta.demo.settings import VARIANTS, DemoSettings
from mta.evaluation.datasets import load_rows
from mta.models.tokenizers import load_tokenizer


@pytest.mark.slow
def test_demo_runs_every_stage_then_reuses_them(tmp_path, tiny_model_dir):
    torch.set_num_threads(1)
    settings = DemoSettings(
        name="test",
        student_layers=2,
        train_steps=2,
        dev_rows=4,
        eval_limits={"dolly": 3, "self-inst": 2},
        max_new_tokens=4,
        seeds=(10, 20),
        perplexity_rows=4,
        eval_batch_size=4,
    )
    overrides = (
        "data.max_length=384",
        "data.max_prompt_length=256",
        "train.batch_size=4",
        "train.micro_batch_size=4",
        "train.warmup_steps=0",
        "train.num_sample_generations=0",
    )
    out = tmp_path / "demo"
    data = example_instruct_dir(tmp_path / "data")

    results = run_demo(settings, out, data_dir=data, teacher=tiny_model_dir, recipe_overrides=overrides)

    labels = ["teacher", "pruned-start", *(variant.label for variant in VARIANTS)]
    assert list(results["checkpoints"]) == labels
    for label in labels:
        run = results["checkpoints"][label]
        assert set(run["sets"]) == {"dolly", "self-inst"}
        assert run["sets"]["dolly"]["rows"] == 3 and run["sets"]["self-inst"]["rows"] == 2
    # The teacher's perplexity is the one a plain loop computes on the same dev rows and limits.
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    dev_rows, _ = load_rows(data / "dolly" / "dev.jsonl", limit=settings.perplexity_rows)
    total, count, _, _ = loop_sums(teacher, load_tokenizer(tiny_model_dir), dev_rows, 256, settings.max_new_tokens)
    assert results["checkpoints"]["teacher"]["perplexity"]["perplexity"] == pytest.approx(
        math.exp(total / count), rel=1e-4
    )
    # The three students start from the same pruned copy and differ in their objective only.
    init = json.loads((out / "student-init" / "mta_init.json").read_text())
    assert init["kept_layers"] == [0, 3]
    sft_metrics = [json.loads(line) for line in (out / "runs" / "sft" / "metrics.jsonl").read_text().splitlines()]
    mta_metrics = [json.loads(line) for line in (out / "runs" / "mta" / "metrics.jsonl").read_text().splitlines()]
    assert not any("loss/dsa" in record for record in sft_metrics)
    assert any(record.get("loss/dsa", 0) > 0 for record in mta_metrics)

    stages = ["teacher", "student", "data", *(f"train {v.label}" for v in VARIANTS), "evaluate", "inspect"]
    assert list(results["stage_seconds"]) == stages and all(s >= 0 for s in results["stage_seconds"].values())
    markdown, picture = write_report(results, out, elapsed_seconds=1.0)
    text = markdown.read_text(encoding="utf-8")
    assert "| train srkl+mta |" in text and "Wall time of this session, per stage" in text
    for label in labels:
        assert f"| {label} |" in text
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # mta inspect of the students it trained, on the dev rows, shown in results.md
    inspected = out / "inspect" / "results.json"
    assert [s["label"] for s in json.loads(inspected.read_text())["students"]] == labels[1:]
    assert set(results["inspect"]["aligned"]) == set(labels[1:])
    assert "![phrase-span CKA](inspect/cka-phrase.png)" in text
    assert (out / "inspect" / "cka-phrase.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    inspected_at = inspected.stat().st_mtime_ns

    # A second run finds every stage complete and trains nothing again.
    stamps = {v.name: (out / "runs" / v.name / "final" / "config.json").stat().st_mtime_ns for v in VARIANTS}
    again = run_demo(settings, out, data_dir=data, teacher=tiny_model_dir, recipe_overrides=overrides)
    assert again["training_seconds"] == results["training_seconds"]
    assert inspected.stat().st_mtime_ns == inspected_at  # the same weights: the inspection is reused
    assert stamps == {v.name: (out / "runs" / v.name / "final" / "config.json").stat().st_mtime_ns for v in VARIANTS}


def test_parameter_count_reads_the_safetensors_headers(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from mta.models.weights import parameter_count

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert parameter_count(tiny_model_dir) == sum(p.numel() for p in model.parameters())


def test_table_marks_a_single_seed_and_names_each_set(tiny_model_dir):
    def run(mean: float) -> dict:
        score = {"mean": mean, "std": 0.0, "per_seed": {"10": mean}}
        return {
            "checkpoint": str(tiny_model_dir),
            "sets": {"dolly": {"rougeL": score}, "vicuna": {"rougeL": dict(score, mean=mean / 2)}},
            "perplexity": {"perplexity": 12.345},
        }

    results = {"checkpoints": {"a": run(10.0), "b": run(20.0)}, "training_seconds": {"b": 90.0}}
    header, body = table(results)
    assert header[:3] == ["model", "parameters", "ppl Dolly dev"] and header[-1] == "train time"
    assert body[0][3] == "10.00 ± —"  # one seed: no spread to show
    assert body[1][-2] == "15.00"  # average over the two sets
    assert body[1][-1] == "1.5 min" and body[0][-1] == "-"
    assert body[0][2] == "12.35"


def test_quick_is_smaller_than_full_and_both_fit_their_budget():
    quick, full = DemoSettings.quick(), DemoSettings.full()
    assert quick.train_steps < full.train_steps and len(quick.seeds) == 1
    # Its dev passes are small: they cost as much as its steps at the full dev size (issue 50).
    assert quick.dev_rows < full.dev_rows and quick.dev_sample_tokens is not None and full.dev_sample_tokens is None
    assert quick.estimated_seconds() < 6 * 60 < full.estimated_seconds() < 30 * 60
    # Fitted to stage times measured in bf16 (issue 50): there the quick run is within 2 minutes,
    # and fp32 (the suite's, MTA_CPU_BF16=0) takes BF16_SPEEDUP times its compute.
    quick_bf16, quick_fp32 = (dataclasses.replace(quick, precision=p).estimated_seconds() for p in ("bf16", "fp32"))
    assert quick_bf16 < 2 * 60 < quick_fp32
    assert quick.batch_size is not None and not quick.checkpoint_at_end and full.checkpoint_at_end


def test_the_estimate_reads_the_demo_recipes_batch_size():
    from mta.demo import settings
    from mta.demo.pipeline import DEMO_RECIPE
    from mta.training.config.loading import load_recipe

    assert settings.RECIPE_BATCH_SIZE == load_recipe(DEMO_RECIPE).train.batch_size
