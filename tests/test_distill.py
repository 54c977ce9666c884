"""`mta distill` end to end on tiny models: same and different tokenizers, ZeRO 1/2/3, SFT,
metrics, a NaN stop, refusal of mismatched annotations, and SIGKILL + --resume auto."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from conftest import subprocess_env, torchrun
from fixtures.distill import annotate_examples, weights, write_recipe
from mta.errors import MtaError
from mta.training.config.loading import load_recipe
from mta.training.lifecycle.metrics import read_metrics
from mta.training.objective import DistillationObjective
from mta.training.trainer import NonFiniteLoss, run_distillation

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def other_teacher_dir(other_tokenizer_dir, tmp_path_factory):
    from mta.models.tiny import build_tiny_model

    return build_tiny_model(other_tokenizer_dir, tmp_path_factory.mktemp("other-teacher"), hidden_size=48, seed=3)


@pytest.fixture(scope="module")
def cross_data(other_tokenizer_dir, tiny_tokenizer_dir, tmp_path_factory):
    return annotate_examples(other_tokenizer_dir, tiny_tokenizer_dir, tmp_path_factory.mktemp("ann-cross") / "a")


def train_losses(output_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(output_dir / "metrics.jsonl") if r["split"] == "train"]


def dev_losses(output_dir: Path) -> list[float]:
    """The loss on the same dev rows at each evaluation: what "goes down" is judged on."""
    return [r["loss"] for r in read_metrics(output_dir / "metrics.jsonl") if r["split"] == "dev"]


@pytest.mark.slow
def test_same_tokenizer_loss_goes_down_and_final_reloads(tmp_path, tiny_model_dir, tiny_run_recipe):
    out = tmp_path / "run"
    recipe = load_recipe(
        tiny_run_recipe(
            out,
            train={"max_steps": 8, "eval_interval": 4, "num_sample_generations": 2, "sample_max_new_tokens": 4},
        )
    )
    final = run_distillation(recipe)

    assert len(train_losses(out)) == 8
    assert dev_losses(out)[-1] < dev_losses(out)[0]
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if r["split"] == "train"]
    assert {"step", "loss", "loss/base", "loss/dsa", "loss/hra", "lr", "tokens_per_s"} <= set(train[0])
    assert [r["step"] for r in train] == list(range(1, 9))
    for record in train:  # the total is the recipe's weighted sum of the components
        expected = record["loss/base"] + 2.0 * record["loss/dsa"] + 0.2 * record["loss/hra"]
        assert record["loss"] == pytest.approx(expected, rel=1e-5)
    dev = [r for r in records if r["split"] == "dev"]
    assert [r["step"] for r in dev] == [0, 4, 8]
    assert len(dev[0]["samples"]) == 2 and {"prompt", "generation"} <= set(dev[0]["samples"][0])

    # Plain transformers reads the result; it holds the trained weights, not the start.
    model = AutoModelForCausalLM.from_pretrained(final)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trained = dict(model.named_parameters())
    assert any(not torch.equal(p, trained[name]) for name, p in start.named_parameters())
    assert (final / "tokenizer.json").exists()
    assert yaml.safe_load((final / "recipe.yaml").read_text())["train"]["max_steps"] == 8
    assert "deepspeed" in json.loads((final / "versions.json").read_text())
    # The last step's checkpoint carries the resumable state beside the HF files.
    assert (out / "checkpoints" / "step-8" / "deepspeed").is_dir()


@pytest.mark.slow
def test_different_tokenizers_align_spans_without_a_logit_loss(tmp_path, other_teacher_dir, tiny_model_dir, cross_data):
    out = tmp_path / "run"
    recipe_path = write_recipe(
        tmp_path / "r.yaml",
        teacher=other_teacher_dir,
        student=tiny_model_dir,
        annotations=cross_data,
        output_dir=out,
        loss={"base": "ce"},
        train={"eval_interval": 3},
    )
    final = run_distillation(load_recipe(recipe_path))
    assert dev_losses(out)[-1] < dev_losses(out)[0]
    record = read_metrics(out / "metrics.jsonl")[0]
    assert record["loss/dsa"] > 0 and record["loss/hra"] > 0
    AutoModelForCausalLM.from_pretrained(final)

    with pytest.raises(MtaError, match="tokenizers differ.*loss.base=ce"):
        run_distillation(load_recipe(recipe_path, ["loss.base=srkl", f"output_dir={tmp_path / 'srkl'}"]))


@pytest.mark.slow
def test_zero_stages_1_2_3_and_a_zero3_teacher_train_the_same_model(tmp_path, teacher_dir, tiny_model_dir, same_data):
    finals = {}
    # The last one also partitions the teacher with ZeRO-3 (train.teacher_zero3).
    for stage, teacher_zero3 in ((1, False), (2, False), (3, False), (3, True)):
        name = f"zero{stage}" + ("-teacher" if teacher_zero3 else "")
        recipe = load_recipe(
            write_recipe(
                tmp_path / f"{name}.yaml",
                teacher=teacher_dir,
                student=tiny_model_dir,
                annotations=same_data,
                output_dir=tmp_path / name,
                data={"dev": None},
                train={"zero_stage": stage, "teacher_zero3": teacher_zero3, "max_steps": 3},
            )
        )
        finals[name] = weights(run_distillation(recipe))
    start = weights(tiny_model_dir)
    reference = finals.pop("zero1")
    assert any(not torch.equal(start[key], reference[key]) for key in start)
    for name, final in finals.items():
        assert final.keys() == reference.keys()
        for key, tensor in final.items():
            # atol 1e-4: after 3 AdamW steps an embedding entry whose gradient is near 0 moves by a
            # step-size-sized amount on float noise (with SDPA attention one entry of ZeRO-3's, of
            # 16,384, differs from ZeRO-1's by 6.2e-5, the others by under 3e-5; the step-1
            # gradients agree to 7e-8, tests/test_loss_reduction.py compares them under ZeRO-1 and
            # ZeRO-3).
            torch.testing.assert_close(tensor, reference[key], rtol=1e-4, atol=1e-4, msg=f"{name} {key}")


@pytest.mark.slow
def test_sft_loads_no_teacher(tmp_path, tiny_model_dir, same_data, monkeypatch):
    import mta.training.llm.build as build

    loaded = []
    real_load = build.load_causal_lm
    monkeypatch.setattr(
        build, "load_causal_lm", lambda spec, recipe, role: loaded.append(role) or real_load(spec, recipe, role)
    )
    out = tmp_path / "sft"
    recipe = load_recipe(
        write_recipe(
            tmp_path / "r.yaml",
            teacher=None,
            student=tiny_model_dir,
            annotations=same_data,
            output_dir=out,
            loss={"base": "ce", "dsa_weight": 0, "hra_weight": 0},
            train={"eval_interval": 3},
        )
    )
    run_distillation(recipe)
    assert loaded == ["student"]
    record = read_metrics(out / "metrics.jsonl")[0]
    assert set(k for k in record if k.startswith("loss/")) == {"loss/base"}
    assert dev_losses(out)[-1] < dev_losses(out)[0]


@pytest.mark.slow
def test_nan_loss_stops_naming_step_and_rows_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, tiny_run_recipe):
    calls = {"n": 0}
    real_forward = DistillationObjective.forward

    def poisoned(self, *args, **kwargs):
        losses = real_forward(self, *args, **kwargs)
        calls["n"] += self.training
        if self.training and calls["n"] == 9:  # step 5, first micro batch (2 micro batches per step)
            losses["total"] = losses["total"] * float("nan")
        return losses

    monkeypatch.setattr(DistillationObjective, "forward", poisoned)
    out = tmp_path / "run"
    recipe = load_recipe(
        tiny_run_recipe(
            out,
            train={"save_interval": 2},
            data={"dev": None},
        )
    )
    with pytest.raises(NonFiniteLoss, match=r"step 5 .*rows \['\d+', '\d+'\]"):
        run_distillation(recipe)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    assert not (out / "final").exists()
    # The run can be picked up again from the last good checkpoint.
    monkeypatch.setattr(DistillationObjective, "forward", real_forward)
    run_distillation(recipe, resume="auto")
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]  # no dev split


def test_annotations_for_other_tokenizers_are_refused(tmp_path, teacher_dir, tiny_model_dir, cross_data):
    recipe = load_recipe(
        write_recipe(
            tmp_path / "r.yaml",
            teacher=teacher_dir,
            student=tiny_model_dir,
            annotations=cross_data,
            output_dir=tmp_path / "o",
        )
    )
    with pytest.raises(MtaError) as error:
        run_distillation(recipe)
    message = str(error.value)
    assert "teacher tokenizer" in message and str(teacher_dir) in message
    assert "mta annotate" in message and "--max-length 384" in message


def dropout_student(tokenizer_dir: Path, out_dir: Path) -> Path:
    """The tiny student with attention dropout: its training draws from torch's RNG each step, so a
    resume that did not restore the checkpoint's RNG state would draw other masks and other weights."""
    from mta.models.tiny import build_tiny_model

    student = build_tiny_model(tokenizer_dir, out_dir)
    config = json.loads((student / "config.json").read_text())
    config["attention_dropout"] = 0.3
    (student / "config.json").write_text(json.dumps(config, indent=2))
    return student


def test_every_train_record_has_the_gradient_norm_and_the_last_step_is_evaluated(tmp_path, tiny_run_recipe):
    """ZeRO-0 (mta measures the norm itself: DeepSpeed keeps none there): grad_norm in every train
    record and in the progress line; 3 steps at eval_interval 2 end with a dev loss at step 3."""
    import io

    from rich.console import Console

    from mta_cli.reporting import PlainReporter

    out = tmp_path / "run"
    recipe = tiny_run_recipe(
        out,
        train={"max_steps": 3, "eval_interval": 2, "log_interval": 2, "zero_stage": 0},
    )
    stream = io.StringIO()
    run_distillation(load_recipe(recipe), reporter=PlainReporter(Console(file=stream)))
    records = read_metrics(out / "metrics.jsonl")
    assert [(r["split"], r["step"]) for r in records] == [
        ("dev", 0),
        ("train", 2),
        ("dev", 2),
        ("train", 3),
        ("dev", 3),
    ]
    norms = [r["grad_norm"] for r in records if r["split"] == "train"]
    assert all(norm > 0 and math.isfinite(norm) for norm in norms), norms
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("distill: step ")]
    assert len(lines) == 2 and all(f"grad_norm {norm:.4g} · " in line for norm, line in zip(norms, lines, strict=True))
    assert [line.split(":")[0] for line in stream.getvalue().splitlines() if line.startswith("dev @")] == [
        f"dev @ step {step}" for step in (0, 2, 3)
    ]


@pytest.mark.slow
def test_sigkill_then_resume_auto_ends_with_the_uninterrupted_weights(
    tmp_path, teacher_dir, tiny_tokenizer_dir, same_data
):
    student = dropout_student(tiny_tokenizer_dir, tmp_path / "student")
    train = {
        "max_steps": 8,
        "save_interval": 2,
        "schedule": "cosine",
        "warmup_steps": 1,
        "eval_interval": 3,
        "num_sample_generations": 1,
        "sample_max_new_tokens": 3,
    }
    uninterrupted = run_distillation(
        load_recipe(
            write_recipe(
                tmp_path / "a.yaml",
                teacher=teacher_dir,
                student=student,
                annotations=same_data,
                output_dir=tmp_path / "a",
                train=train,
            ),
            ["seed=5"],
        )
    )

    out = tmp_path / "b"
    recipe_path = write_recipe(
        tmp_path / "b.yaml",
        teacher=teacher_dir,
        student=student,
        annotations=same_data,
        output_dir=out,
        train=train,
    )
    # A fresh single-process run: not the rendezvous this test process already holds.
    env = subprocess_env()
    log = tmp_path / "distill.log"  # a file, not a pipe: a full pipe would stall the run
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "mta_cli.main", "distill", "--recipe", str(recipe_path), "seed=5"],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    # Killed as soon as step 2's checkpoint is complete (step-N.partial is renamed to step-N only
    # once whole): the run is then past a checkpoint and, as checked below, not finished.
    state = out / "checkpoints" / "step-2" / "trainer_state.json"
    deadline = time.monotonic() + 600  # a generous bound on a loaded machine; the wait is a poll
    try:
        while not state.exists():
            assert process.poll() is None, log.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.01)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended before it was killed"
    assert not (out / "final").exists(), "the run finished before it was killed"
    done = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"]
    assert 2 <= max(done) < 8, done  # killed mid-run: past step 2, short of the last step

    resumed = run_distillation(load_recipe(recipe_path, ["seed=5"]), resume="auto")
    expected, got = weights(uninterrupted), weights(resumed)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"]
    assert steps == list(range(1, 9))


@pytest.mark.slow
def test_two_processes_keep_the_global_batch_and_train_the_same_model(tmp_path, teacher_dir, tiny_model_dir, same_data):
    """torchrun with 2 processes: half the accumulation each, the same steps and weights as 1."""
    common = dict(
        teacher=teacher_dir,
        student=tiny_model_dir,
        annotations=same_data,
        data={"dev": None},
        train={"max_steps": 3, "batch_size": 4, "micro_batch_size": 1},
    )
    single = run_distillation(load_recipe(write_recipe(tmp_path / "one.yaml", output_dir=tmp_path / "one", **common)))

    recipe_path = write_recipe(tmp_path / "two.yaml", output_dir=tmp_path / "two", **common)
    stderr = torchrun(["-m", "mta_cli.main", "distill", "--recipe", recipe_path])
    assert "4 = 1 per device × 2 accumulation × 2 process(es)" in " ".join(stderr.split())
    expected, got = weights(single), weights(tmp_path / "two" / "final")
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
