"""DistiLLM-2 pairs against a plain restatement (ARCHITECTURE.md, annotate; ``mta.data.rows``;
``mta.training.batching``): pair row n becomes rows 2n ("chosen", the teacher's response) and
2n + 1 ("rejected", the student's), and both halves sit together, chosen first, in every micro
batch. The last test fails when the artefact gains a role this table does not place."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from mta.data.artefact_schema import ROLES
from mta.data.rows import Example, RowProblem, read_rows
from mta.errors import MtaError
from mta.training.batching import AnnotatedExamples, StepSchedule, micro_batch_order

# role -> (its row id for pair row n, the response it holds, its place inside the pair)
PLACES = {
    "chosen": (lambda n: 2 * n, "chosen", 0),
    "rejected": (lambda n: 2 * n + 1, "rejected", 1),
}


def pair_file(path: Path, count: int) -> Path:
    lines = [{"prompt": f"Q{n}? ", "chosen": f"teacher {n}", "rejected": f"student {n}"} for n in range(count)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.mark.parametrize("role", sorted(PLACES))
def test_each_role_has_its_restated_id_response_and_place(role, tmp_path):
    rows = list(read_rows(pair_file(tmp_path / "pairs.jsonl", 4)))
    assert all(isinstance(row, Example) for row in rows) and len(rows) == 8
    row_id, field, place = PLACES[role]
    for n in range(4):
        row = rows[2 * n + place]
        assert (row.id, row.pair_id, row.role, row.response) == (
            row_id(n),
            n,
            role,
            f"{'teacher' if field == 'chosen' else 'student'} {n}",
        )
        assert row.prompt == rows[2 * n + 1 - place].prompt  # both halves answer one prompt


def test_a_single_row_in_a_pair_file_is_a_problem_not_a_row(tmp_path):
    path = pair_file(tmp_path / "pairs.jsonl", 2)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps({"prompt": "Q? ", "response": "plain"}) + "\n")
    rows = list(read_rows(path))
    assert [row.id for row in rows if isinstance(row, Example)] == [0, 1, 2, 3]
    assert isinstance(rows[-1], RowProblem) and rows[-1].reason == "mixed_formats"


def pair_table(pairs: int, seed: int = 0) -> tuple[pa.Table, np.ndarray]:
    lengths = np.random.default_rng(seed).integers(2, 30, size=2 * pairs)
    return pa.table(
        {
            "id": list(range(2 * pairs)),
            "pair_id": [n // 2 for n in range(2 * pairs)],
            "role": [ROLES[n % 2] for n in range(2 * pairs)],
            "student_input_ids": [list(range(n)) for n in lengths],
            "teacher_input_ids": [list(range(n)) for n in lengths],
            "student_prompt_len": [1] * (2 * pairs),
            "teacher_prompt_len": [1] * (2 * pairs),
        }
    ), lengths


@pytest.mark.parametrize("micro_batch_size", [2, 4, 6, 8])
def test_every_micro_batch_holds_whole_pairs_chosen_first(micro_batch_size):
    table, lengths = pair_table(37, seed=micro_batch_size)
    examples = AnnotatedExamples(table, student_pad_id=0, granularities=())
    for seed, epoch in ((0, 0), (0, 1), (5, 3)):
        order = micro_batch_order(lengths, micro_batch_size, seed=seed, epoch=epoch, group_factor=4, paired=True)
        assert all(len(rows) == micro_batch_size for rows in order)
        assert len(order) == 37 // (micro_batch_size // 2)  # the leftover pairs are skipped, whole
        for rows in order:
            first, second = rows[0::2], rows[1::2]
            assert (first % 2 == 0).all() and (second == first + 1).all()
            assert examples.batch(rows).chosen.tolist() == [True, False] * (micro_batch_size // 2)
        visited = np.concatenate(order)
        assert len(set(visited.tolist())) == len(visited)  # no pair twice in an epoch
        # Pairs are ordered as rows would be, by the longer half.
        by_pair = micro_batch_order(
            np.maximum(lengths[0::2], lengths[1::2]), micro_batch_size // 2, seed=seed, epoch=epoch, group_factor=4
        )
        assert [(rows[0::2] // 2).tolist() for rows in order] == [pairs.tolist() for pairs in by_pair]


def test_a_step_split_over_ranks_keeps_every_pair_in_one_micro_batch():
    table, lengths = pair_table(24)
    order = micro_batch_order(lengths, 4, seed=1, epoch=0, paired=True)
    schedule = StepSchedule(num_rows=48, micro_batch_size=4, accumulation=2, world_size=3)
    for step in range(schedule.steps_per_epoch):
        for rank in range(3):
            for index in schedule.micro_batch_indices(step, rank):
                rows = order[index]
                assert (rows[1::2] == rows[0::2] + 1).all() and (rows[0::2] % 2 == 0).all()


def test_an_odd_micro_batch_or_a_broken_pair_is_refused():
    table, lengths = pair_table(4)
    with pytest.raises(MtaError, match="micro_batch_size must be even"):
        micro_batch_order(lengths, 3, seed=0, epoch=0, paired=True)
    swapped = table.set_column(2, "role", [["rejected", "chosen"] * 4])
    with pytest.raises(MtaError, match="lacks its chosen"):
        AnnotatedExamples(swapped, student_pad_id=0, granularities=())
    split = table.set_column(1, "pair_id", [[0, 1, 1, 2, 2, 3, 3, 4]])
    with pytest.raises(MtaError, match="not in pairs"):
        AnnotatedExamples(split, student_pad_id=0, granularities=())


def test_every_role_of_the_artefact_is_placed():
    assert tuple(sorted(PLACES, key=lambda role: PLACES[role][2])) == ROLES
