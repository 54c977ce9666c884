"""`mta distill` with the student's own responses (off_policy: adaptive / always), end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from conftest import torchrun
from fixtures.distill import weights, write_recipe
from mta.data.annotations import read_annotations
from mta.data.online_spans import PendingSpans
from mta.training.batching import AnnotatedExamples
from mta.training.config.loading import load_recipe
from mta.training.lifecycle.metrics import read_metrics
from mta.training.off_policy import policy, replay_buffer
from mta.training.trainer import Trainer, run_distillation
from mta_cli.reporting import off_policy_summary

pytestmark = pytest.mark.usefixtures("one_thread")

GENERATION = {"max_new_tokens": 12}
# Every micro batch samples until the buffer (two micro batches) is full, then the decreasing
# schedule mixes fresh samples and replays.
ADAPTIVE = {"mode": "adaptive", "init_threshold": 1.0, "buffer_size": 4, **GENERATION}


def _recipe(tmp_path: Path, name: str, teacher_dir, student_dir, data, generation: dict, **train):
    return write_recipe(
        tmp_path / f"{name}.yaml",
        teacher=teacher_dir,
        student=student_dir,
        annotations=data,
        output_dir=tmp_path / name,
        data={"dev": None},
        off_policy=generation,
        train={"max_steps": 6, "save_interval": 2, **train},
    )


class _Interrupted(Exception):
    pass


@pytest.mark.slow
def test_an_interrupted_adaptive_run_resumes_to_the_uninterrupted_weights_with_its_buffer(
    tmp_path, teacher_dir, tiny_model_dir, same_data, monkeypatch
):
    uninterrupted = run_distillation(
        load_recipe(_recipe(tmp_path, "a", teacher_dir, tiny_model_dir, same_data, ADAPTIVE))
    )
    sources = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if r["split"] == "train"]
    assert sum(r["off_policy/generated"] for r in sources) > 0 and sum(r["off_policy/buffer"] for r in sources) > 0
    # Each log line: τ, the micro batches of each source since the last line, speeds and waits.
    assert all(r["off_policy/threshold"] == 1.0 and r["off_policy/span_wait_s"] >= 0 for r in sources)
    assert all((r["off_policy/tokens_per_s"] > 0) == (r["off_policy/generated"] > 0) for r in sources)
    assert sum(r["off_policy/gold"] + r["off_policy/generated"] + r["off_policy/buffer"] for r in sources) == 6 * 2
    assert off_policy_summary(sources[0]) == "τ 1.00 · gold 0 / generated 2 / buffer 0"

    path = _recipe(tmp_path, "b", teacher_dir, tiny_model_dir, same_data, ADAPTIVE)
    real_step = Trainer.step

    def interrupted(self, step):
        if step == 4:  # after checkpoint step-4 was written
            raise _Interrupted
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "step", interrupted)
    with pytest.raises(_Interrupted):
        run_distillation(load_recipe(path))
    checkpoint = tmp_path / "b" / "checkpoints" / "step-4"
    state = json.loads((checkpoint / policy.STATE_FILE).read_text())
    buffered, _ = replay_buffer.read_generated_rows(checkpoint / replay_buffer.buffer_file(0))
    assert len(buffered) == 4 and state["micro_batches"]["generated"] > 0
    monkeypatch.setattr(Trainer, "step", real_step)
    resumed = run_distillation(load_recipe(path), resume="auto")
    expected, got = weights(uninterrupted), weights(resumed)
    assert expected.keys() == got.keys()
    for name in expected:
        assert np.array_equal(expected[name].numpy(), got[name].numpy()), name


@pytest.mark.slow
def test_always_mode_trains_on_generated_rows_and_saves_them_with_their_spans(
    tmp_path, teacher_dir, tiny_model_dir, same_data, monkeypatch
):
    path = _recipe(
        tmp_path,
        "c",
        teacher_dir,
        tiny_model_dir,
        same_data,
        {"mode": "always", **GENERATION},
        max_steps=2,
        save_generated=True,
        # One micro batch generated and trained before the next: the order the events pin. Under
        # `global` the window is generated first, each parse awaited as the next is generated.
        loss_reduction="micro_batch",
    )
    events = []
    real_forward, real_result = Trainer.teacher_forward, PendingSpans.result
    monkeypatch.setattr(
        Trainer,
        "teacher_forward",
        lambda self, batch, split="train": events.append("teacher") or real_forward(self, batch, split),
    )
    monkeypatch.setattr(PendingSpans, "result", lambda self, *a: events.append("spans") or real_result(self, *a))
    run_distillation(load_recipe(path))
    # Each micro batch waits for its spans only after the teacher's forward (parsed meanwhile);
    # before the first step, the parser waited for its workers to come up.
    assert events == ["spans"] + ["teacher", "spans"] * 4
    out = tmp_path / "c"
    files = sorted((out / "generated").glob("step-*-rank-0.parquet"))
    assert [f.name for f in files] == ["step-000001-rank-0.parquet", "step-000002-rank-0.parquet"]
    table = pq.read_table(files[0])
    assert set(table.column("source").to_pylist()) == {"generated"}
    assert table.column("micro_batch").to_pylist() == [0, 0, 1, 1]
    gold = {row["id"]: row for row in read_annotations(same_data).table.to_pylist()}
    examples = AnnotatedExamples(table.drop_columns(["step", "micro_batch", "source"]), student_pad_id=0)
    batch = examples.batch(np.arange(len(examples)))
    for position, row in enumerate(table.to_pylist()):
        source = gold[row["id"]]
        prompt = source["student_input_ids"][: source["student_prompt_len"]]
        # The prompt is the gold row's; only the generated response is a target.
        assert row["student_input_ids"][: row["student_prompt_len"]] == prompt
        assert row["text"].startswith(source["text"][: source["prompt_chars"]])
        assert len(row["student_input_ids"]) - len(prompt) <= GENERATION["max_new_tokens"]
        labels = batch.student.labels[position].tolist()
        assert all(label == -100 for label in labels[: len(prompt)])
        assert labels[len(prompt) : len(row["student_input_ids"])] == row["student_input_ids"][len(prompt) :]
        for span in row["phrase_spans"] + row["word_spans"]:
            assert row["text"][span["char_start"] : span["char_end"]].strip()
    record = [r for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"][-1]
    assert record["off_policy/generated"] == 2 and record["off_policy/gold"] == 0
    assert "off_policy/threshold" not in record  # no threshold outside adaptive mode
    assert off_policy_summary(record) == "gold 0 / generated 2 / buffer 0"


@pytest.mark.slow
def test_two_zero3_processes_agree_on_every_decision_train_and_resume(tmp_path, teacher_dir, tiny_model_dir, same_data):
    """torchrun, 2 processes, ZeRO-3: every rank takes the same decision for each micro batch
    (each samples its own rows and replays its own buffer), and a resume from a checkpoint
    samples the same responses and ends with the same weights."""
    generation = {"mode": "adaptive", "init_threshold": 1.0, "buffer_size": 2, **GENERATION}
    path = _recipe(
        tmp_path,
        "z3",
        teacher_dir,
        tiny_model_dir,
        same_data,
        generation,
        max_steps=4,
        batch_size=4,
        micro_batch_size=1,
        save_generated=True,
        zero_stage=3,
    )
    out = tmp_path / "z3"
    command = ["-m", "mta_cli.main", "distill", "--recipe", path]
    torchrun(command)
    files = {f.name: pq.read_table(f) for f in sorted((out / "generated").glob("*.parquet"))}
    assert len(files) == 8  # 4 steps × 2 ranks
    sources = []
    for step in range(1, 5):
        rank0, rank1 = files[f"step-{step:06d}-rank-0.parquet"], files[f"step-{step:06d}-rank-1.parquet"]
        assert rank0.column("source").to_pylist() == rank1.column("source").to_pylist()
        assert rank0.column("micro_batch").to_pylist() == rank1.column("micro_batch").to_pylist() == [0, 1]
        assert set(rank0.column("id").to_pylist()).isdisjoint(rank1.column("id").to_pylist())
        sources += rank0.column("source").to_pylist()
    assert {"generated", "buffer"} <= set(sources), sources
    uninterrupted = weights(out / "final")
    generated = {name: table for name, table in files.items() if name >= "step-000003"}

    torchrun([*command, "--resume", out / "checkpoints" / "step-2"])
    for name, table in generated.items():
        assert pq.read_table(out / "generated" / name).equals(table), name
    resumed = weights(out / "final")
    for name in uninterrupted:
        assert np.array_equal(uninterrupted[name].numpy(), resumed[name].numpy()), name


def naive_cross_entropy(model, rows: list[dict]) -> float:
    """Token-mean cross-entropy of the reference responses, one row and one token at a time."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids, prompt = row["student_input_ids"], row["student_prompt_len"]
            log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
            for position in range(max(prompt, 1), len(ids)):
                total -= log_probs[position - 1, ids[position]].item()
                count += 1
    return total / count


@pytest.mark.slow
def test_the_threshold_reads_the_cross_entropy_of_the_first_dev_rows(tmp_path, teacher_dir, tiny_model_dir, same_data):
    generation = {**ADAPTIVE, "init_threshold": 0.0, "dev_rows": 3}
    path = _recipe(tmp_path, "ce", teacher_dir, tiny_model_dir, same_data, generation, max_steps=2, eval_interval=2)
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**raw, "data": {**raw["data"], "dev": str(same_data)}}))
    run_distillation(load_recipe(path))
    dev = [r for r in read_metrics(tmp_path / "ce" / "metrics.jsonl") if r["split"] == "dev"]
    assert [r["step"] for r in dev] == [0, 2]
    rows = read_annotations(same_data).table.slice(0, 3).to_pylist()
    student = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert dev[0]["off_policy/dev_ce"] == pytest.approx(naive_cross_entropy(student, rows), rel=1e-5)
    assert dev[0]["off_policy/threshold"] == 0.0  # the first evaluation sets the reference only
