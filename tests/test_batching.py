"""Batching: vectorised gathers against a plain per-row construction, and a reproducible order."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from fixtures.batching import random_rows
from mta.data.artefact_schema import SCHEMA
from mta.errors import MtaError
from mta.training.batching import AnnotatedExamples, StepSchedule, micro_batch_order

PAD = {"student": 7, "teacher": 3}


def _reference_tokens(rows, side):
    """One row at a time: right padding, labels only on response tokens."""
    width = max(len(row[f"{side}_input_ids"]) for row in rows)
    ids = torch.full((len(rows), width), PAD[side])
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for b, row in enumerate(rows):
        for t, token in enumerate(row[f"{side}_input_ids"]):
            ids[b, t] = token
            mask[b, t] = 1
            if t >= row[f"{side}_prompt_len"]:
                labels[b, t] = token
    return ids, mask, labels


@pytest.fixture(scope="module")
def rows():
    return random_rows(23)


@pytest.fixture(scope="module")
def examples(rows):
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    # Several chunks, as a multi-part artefact gives: gathers must not assume one.
    table = pa.concat_tables([table.slice(0, 9), table.slice(9)])
    return AnnotatedExamples(table, student_pad_id=PAD["student"], teacher_pad_id=PAD["teacher"])


@pytest.mark.parametrize("picked", [[0], [4, 2, 19], list(range(23)), [22, 22, 1]])
def test_batch_matches_a_per_row_construction(rows, examples, picked):
    batch = examples.batch(picked)
    chosen = [rows[i] for i in picked]
    assert batch.row_ids == [str(i) for i in picked]
    for side in ("student", "teacher"):
        ids, mask, labels = _reference_tokens(chosen, side)
        tokens = getattr(batch, side)
        assert torch.equal(tokens.input_ids, ids)
        assert torch.equal(tokens.attention_mask, mask)
        assert torch.equal(tokens.labels, labels)
    for granularity, column in (("phrase", "phrase_spans"), ("word", "word_spans")):
        spans = batch.spans[granularity]
        for b, row in enumerate(chosen):
            real = row[column]
            assert spans.mask[b].sum().item() == len(real)
            for k, span in enumerate(real):
                for field in ("student_start", "student_end", "teacher_start", "teacher_end"):
                    assert getattr(spans, field)[b, k].item() == span[field]
            # Padding spans are empty ranges: they cover no token on either side.
            padded = ~spans.mask[b]
            assert not spans.student_token_mask(40)[b][padded].any()
            assert not spans.teacher_token_mask(40)[b][padded].any()


def test_batch_without_any_span(rows):
    table = pa.Table.from_pylist([row | {"phrase_spans": [], "word_spans": []} for row in rows[:3]], schema=SCHEMA)
    batch = AnnotatedExamples(table, student_pad_id=0).batch([0, 1, 2])
    assert batch.spans["phrase"].mask.shape == (3, 0)


def test_sft_batches_leave_the_teacher_out(rows):
    table = pa.Table.from_pylist(rows, schema=SCHEMA).drop_columns(["teacher_input_ids"])
    batch = AnnotatedExamples(table, student_pad_id=0, with_teacher=False, granularities=()).batch([1, 2])
    assert batch.teacher is None and batch.spans == {}


def test_missing_columns_are_named(rows):
    table = pa.Table.from_pylist(rows, schema=SCHEMA).drop_columns(["word_spans"])
    with pytest.raises(MtaError, match="word_spans"):
        AnnotatedExamples(table, student_pad_id=0)


def test_order_is_reproducible_covers_rows_once_and_groups_lengths():
    lengths = np.random.default_rng(1).integers(1, 500, 1000)
    first = micro_batch_order(lengths, 8, seed=42, epoch=0)
    again = micro_batch_order(lengths, 8, seed=42, epoch=0)
    other_epoch = micro_batch_order(lengths, 8, seed=42, epoch=1)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other_epoch, strict=True))
    assert all(len(batch) == 8 for batch in first)
    flat = np.concatenate(first)
    assert len(flat) == len(set(flat.tolist())) == 1000

    # Length-aware: far less padding than a plain shuffle.
    def padding(batches):
        return sum(int(lengths[b].max()) * len(b) - int(lengths[b].sum()) for b in batches)

    shuffled = np.split(np.random.default_rng(0).permutation(1000), 125)
    assert padding(first) < padding(shuffled) / 4


def test_step_schedule_splits_each_step_across_processes():
    schedule = StepSchedule(num_rows=100, micro_batch_size=4, accumulation=3, world_size=2)
    assert schedule.steps_per_epoch == 4  # 25 micro batches // 6 per step
    assert schedule.locate(9) == (2, 1)
    taken = [i for rank in (0, 1) for i in schedule.micro_batch_indices(1, rank)]
    assert sorted(taken) == list(range(6, 12))
    assert schedule.total_steps(epochs=1.5, max_steps=None) == 6
    with pytest.raises(MtaError, match="fewer than one global batch"):
        _ = StepSchedule(10, 4, 2, 2).steps_per_epoch


# --- pair rows (DistiLLM-2) ------------------------------------------------------------------


def pair_table(pairs: int):

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 30, size=2 * pairs)
    return pa.table(
        {
            "id": np.arange(2 * pairs),
            "pair_id": np.repeat(np.arange(pairs), 2),
            "role": ["chosen", "rejected"] * pairs,
            "student_input_ids": [list(range(n)) for n in lengths],
            "teacher_input_ids": [list(range(n)) for n in lengths],
            "student_prompt_len": [1] * (2 * pairs),
            "teacher_prompt_len": [1] * (2 * pairs),
        }
    ), lengths


def test_pairs_stay_together_chosen_first_and_every_pair_is_visited_once():
    table, lengths = pair_table(40)
    examples = AnnotatedExamples(table, student_pad_id=0, granularities=())
    order = micro_batch_order(lengths, 4, seed=1, epoch=0, paired=examples.pair_ids is not None)
    assert all(len(rows) == 4 for rows in order) and len(order) == 20
    for rows in order:
        assert (rows[0::2] % 2 == 0).all() and (rows[1::2] == rows[0::2] + 1).all()
        batch = examples.batch(rows)
        assert batch.chosen.tolist() == [True, False, True, False]
    assert sorted(np.concatenate(order).tolist()) == list(range(80))
    # Unpaired, the same rows would be split (the check above can fail).
    loose = micro_batch_order(lengths, 4, seed=1, epoch=0)
    assert any(not (rows[1::2] == rows[0::2] + 1).all() for rows in loose)


def test_pairs_need_an_even_micro_batch_and_complete_pairs():
    table, lengths = pair_table(4)
    with pytest.raises(MtaError, match="micro_batch_size must be even"):
        micro_batch_order(lengths, 3, seed=1, epoch=0, paired=True)
    broken = table.set_column(2, "role", [["chosen", "chosen"] + ["chosen", "rejected"] * 3])
    with pytest.raises(MtaError, match="lacks its chosen"):
        AnnotatedExamples(broken, student_pad_id=0, granularities=())
    single = AnnotatedExamples(table.drop_columns(["pair_id", "role"]), student_pad_id=0, granularities=())
    assert single.pair_ids is None and single.batch([0, 1]).chosen is None
