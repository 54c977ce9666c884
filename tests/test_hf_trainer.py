"""The Python API inside the Hugging Face ecosystem (issue 50): ``examples/hf_trainer_mta.py``
trains through a ``transformers.Trainer`` with DSA and HRA on; what goes wrong on the way is
refused naming the fix: a Trainer that dropped the annotated columns, annotated rows without
span columns, an unknown granularity, a tokenizer's ``BatchEncoding`` as the batch, float labels,
and labels all -100 (a warning: the loss is 0)."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

import mta
from conftest import REPO
from fixtures.batching import random_rows

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 40


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("hf_trainer_mta", REPO / "examples" / "hf_trainer_mta.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("hf-trainer")
    return module, out, module.main(out)


def test_the_trainer_example_trains_with_dsa_and_hra_on(example):
    _, out, losses = example
    assert set(losses) == {"base", "dsa", "hra", "total"}
    assert losses["dsa"] > 0 and losses["hra"] > 0 and all(map(torch.isfinite, map(torch.tensor, losses.values())))
    from transformers import AutoModelForCausalLM

    final, start = (AutoModelForCausalLM.from_pretrained(out / name) for name in ("final", "student"))
    moved = [not torch.equal(a, b) for a, b in zip(final.parameters(), start.parameters(), strict=True)]
    assert all(moved)  # every student weight trained (a plain transformers checkpoint)


def test_a_trainer_that_drops_the_annotated_columns_is_told_how_to_keep_them(example, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

    module, out, _ = example
    student = AutoModelForCausalLM.from_pretrained(out / "student")
    teacher = AutoModelForCausalLM.from_pretrained(out / "teacher")
    tokenizer = AutoTokenizer.from_pretrained(out / "student")
    annotator = mta.Annotator(mta.AnnotateSettings(teacher=str(out / "student"), student=str(out / "student")))
    rows = annotator.annotate([{"prompt": "Name a fruit.\n", "response": "A ripe banana is a sweet fruit."}] * 2)
    for row in rows:  # a column the model's forward takes: the Trainer keeps it, drops the others
        row["input_ids"] = row["student_input_ids"]
    loss_fn = mta.MTALoss.for_models(student, teacher, vocab_size=len(tokenizer), same_tokenizer=True)
    trainer = module.MTATrainer(
        model=student,
        args=TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True),  # columns dropped
        train_dataset=Dataset.from_list(rows),
        data_collator=mta.Collator(granularities=loss_fn.granularities),
        teacher=teacher,
        mta_loss=loss_fn,
    )
    with pytest.raises(mta.MtaError, match=r"not annotated.*Trainer: it removes .*remove_unused_columns=False"):
        trainer.train()


def annotated_rows(count: int = 3) -> list[dict]:
    rows = random_rows(count, 5)
    for row in rows:
        row["student_input_ids"] = [token % VOCAB for token in row["student_input_ids"]]
        row["teacher_input_ids"], row["teacher_prompt_len"] = row["student_input_ids"], row["student_prompt_len"]
    return rows


def small_loss() -> mta.MTALoss:
    return mta.MTALoss(
        [(1, 1, "word"), (2, 2, "phrase")],
        student_hidden_size=8,
        teacher_hidden_size=8,
        vocab_size=VOCAB,
        same_tokenizer=True,
    )


def outputs_for(batch: mta.TrainBatch, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    shape = batch.student.input_ids.shape
    return {
        "logits": torch.randn(*shape, VOCAB, generator=generator),
        "hidden_states": tuple(torch.randn(*shape, 8, generator=generator) for _ in range(3)),
    }


def test_rows_without_span_columns_are_refused_not_trained_with_the_method_off():
    rows = annotated_rows()
    collate = mta.Collator(granularities=small_loss().granularities)
    batch = collate(rows)
    assert all(spans.mask.any() for spans in batch.spans.values())  # whole rows carry spans
    stripped = [{key: value for key, value in row.items() if key != "word_spans"} for row in rows]
    with pytest.raises(mta.MtaError, match=r"no word_spans.*remove_unused_columns=False.*granularities=\(\)"):
        collate(stripped)
    assert mta.Collator(granularities=("phrase",))(stripped).spans["phrase"].mask.any()  # not read: fine


@pytest.mark.parametrize("granularities", [("sentence",), "word", ("word", "clause")])
def test_an_unknown_granularity_names_the_kinds(granularities):
    with pytest.raises(mta.MtaError, match=r"the span kinds are 'phrase', 'word'.*MTALoss.granularities"):
        mta.Collator(granularities=granularities)


def test_a_tokenizer_batch_in_place_of_the_train_batch_names_the_collator():
    from transformers import BatchEncoding

    loss = small_loss()
    batch = mta.Collator(granularities=loss.granularities)(annotated_rows())
    out = outputs_for(batch, 1)
    encoding = BatchEncoding({"input_ids": batch.student.input_ids, "attention_mask": batch.student.attention_mask})
    with pytest.raises(mta.MtaError, match=r"got a BatchEncoding: collate the rows with mta.Collator"):
        loss(out, out, encoding)
    without = mta.Collator(granularities=())(annotated_rows())
    with pytest.raises(mta.MtaError, match=r"no phrase, word spans.*granularities=loss_fn.granularities"):
        loss(out, out, without)
    assert torch.isfinite(loss(out, out, batch)["total"])


def test_float_labels_are_refused_and_all_ignored_labels_warned():
    kd = mta.KDLoss("fkl")
    logits = torch.randn(2, 5, VOCAB)
    labels = torch.randint(0, VOCAB, (2, 5))
    with pytest.raises(mta.MtaError, match=r"labels are torch.float32, not token ids.*torch.long"):
        kd(logits, logits, labels.float())
    with pytest.raises(mta.MtaError, match=r"torch.bool"):
        kd(logits, logits, labels > 3)
    with pytest.warns(UserWarning, match=r"every label is -100.*the loss is 0"):
        value = kd(logits, logits.flip(0), torch.full_like(labels, -100))
    assert value.item() == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # real labels: no warning
        assert kd(logits, logits.flip(0), labels).item() > 0
    loss = small_loss()
    batch = mta.Collator(granularities=loss.granularities)(annotated_rows())
    out = outputs_for(batch, 2)
    with pytest.warns(UserWarning, match=r"MTALoss: every label is -100"):
        loss(out, out, batch, labels=torch.full_like(batch.student.labels, -100))
