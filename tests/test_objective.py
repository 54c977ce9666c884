"""The training objective's base term against a plain loop over a real ``TrainBatch``: position t
of both models' logits predicts label t + 1 (docs/method.md §3, §5), the weight scales it."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from fixtures.batching import random_rows
from fixtures.losses import ALPHA, ref_token_loss
from mta.data.artefact_schema import SCHEMA
from mta.training.batching import IGNORE_INDEX, AnnotatedExamples
from mta.training.config.schema import LossSpec
from mta.training.objective import DistillationObjective
from mta.training.teacher import TeacherOutput

VOCAB, PADDED = 40, 3  # the tokenizer's vocabulary and the embedding rows a checkpoint adds


def same_tokenizer_batch(count: int, seed: int):
    """Annotate rows of one tokenizer (both sides hold the same ids), gathered by batching."""
    rows = random_rows(count, seed)
    for row in rows:
        row["student_input_ids"] = [token % VOCAB for token in row["student_input_ids"]]
        row["teacher_input_ids"] = row["student_input_ids"]
        row["teacher_prompt_len"] = row["student_prompt_len"]
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    return AnnotatedExamples(table, student_pad_id=0, teacher_pad_id=0, granularities=()).batch(list(range(count)))


def ref_base_term(name, student_logits, teacher_logits, labels, tau) -> float:
    """Mean over response tokens of the loss at position t against the label at t + 1, with
    position t of the student and position t of the teacher (no tensor shifting)."""
    values = []
    batch, seq = labels.shape
    for b in range(batch):
        for t in range(seq - 1):
            label = int(labels[b, t + 1])
            if label == IGNORE_INDEX:
                continue
            s_row = [float(x) for x in student_logits[b, t, :VOCAB]]
            t_row = [float(x) for x in teacher_logits[b, t, :VOCAB]]
            values.append(ref_token_loss(name, s_row, t_row, label, tau))
    return sum(values) / len(values)


@pytest.mark.parametrize("name,tau", [("fkl", 1.0), ("srkl", 2.0), ("ce", 1.0)])
def test_base_term_pairs_position_t_of_both_models_with_label_t_plus_1(name, tau):
    batch = same_tokenizer_batch(5, seed=3)
    labels = batch.student.labels
    assert (labels[:, 1:] != IGNORE_INDEX).sum() > 10  # enough response tokens to tell shifts apart
    generator = torch.Generator().manual_seed(11)
    shape = (*batch.student.input_ids.shape, VOCAB + PADDED)
    # Sharp, unrelated distributions at every position: any shift of either side changes the loss.
    student_logits = torch.randn(shape, generator=generator) * 10
    teacher_logits = torch.randn((*shape[:-1], VOCAB + PADDED + 2), generator=generator) * 10
    spec = LossSpec(base=name, base_weight=0.5, temperature=tau, skew_alpha=ALPHA, dsa_weight=0, hra_weight=0)
    objective = DistillationObjective(
        spec, [], student_hidden_size=8, teacher_hidden_size=None, same_tokenizer=True, vocab_size=VOCAB
    )
    teacher = TeacherOutput(hidden_states={}, logits=teacher_logits)
    losses = objective(student_logits, None, teacher, batch)
    assert set(losses) == {"base", "total"}
    expected = ref_base_term(name, student_logits, teacher_logits, labels, tau)
    assert losses["base"].item() == pytest.approx(expected, rel=1e-4)
    assert losses["total"].item() == pytest.approx(0.5 * expected, rel=1e-4)
