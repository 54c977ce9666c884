"""DistiLLM's adaptive off-policy sampling: the decision, the threshold, the replay buffer."""

from __future__ import annotations

import json
import random
from itertools import product

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fixtures.generated_rows import make_row
from mta.data.artefact_schema import SCHEMA_VERSION
from mta.errors import MtaError
from mta.training.batching import AnnotatedExamples
from mta.training.config.schema import OffPolicySpec, Recipe
from mta.training.off_policy import policy
from mta.training.off_policy.policy import (
    OffPolicyState,
    agreed_dev_loss,
    buffer_generator,
    choose,
    decide,
    draw,
    generation_params,
    generation_seeds,
    read_state,
    schedule_value,
    update_threshold,
    write_state,
)
from mta.training.off_policy.replay_buffer import (
    ReplayBuffer,
    agreed_buffer_flags,
    buffer_file,
    read_generated_rows,
    rows_table,
    write_generated_rows,
)

SEED = 42
ADAPTIVE = OffPolicySpec(mode="adaptive")


def restated(r: float, tau: float, step: int, total: int, schedule: str, full: bool) -> str:
    """The issue's statement of the rule, written out again independently of the module."""
    t = step + 1
    s = {"decreasing": tau * (1 - t / total), "constant": 0.5 * tau, "increasing": tau * t / total}[schedule]
    if r < s or (r < tau and not full):
        return "generated"
    if r < tau:
        return "buffer"
    return "gold"


# --- the decision ------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["decreasing", "constant", "increasing"])
def test_decide_is_the_stated_rule_for_every_schedule_and_reaches_every_branch(schedule):
    spec = OffPolicySpec(mode="adaptive", schedule=schedule)
    total = 12
    seen = set()
    for tau, full, step, k in product((0.0, 0.35, 0.8, 1.0), (False, True), range(total), range(4)):
        got = decide(OffPolicyState(tau), spec, step, total, k, full, False, SEED)
        assert got == restated(draw(SEED, step, k), tau, step, total, schedule, full)
        seen.add((got, full))
    # Generated with and without a full buffer (r < s), buffer draws only when full, gold both ways.
    assert seen == {("generated", False), ("generated", True), ("buffer", True), ("gold", False), ("gold", True)}


def test_choose_on_scripted_draws_at_the_boundaries():
    tau, s = 0.6, 0.3
    assert choose(0.1, tau, s, buffer_full=True) == "generated"  # r < s: fresh rows even when full
    assert choose(0.3, tau, s, buffer_full=True) == "buffer"  # r = s is not below s
    assert choose(0.45, tau, s, buffer_full=False) == "generated"  # below τ, buffer still filling
    assert choose(0.45, tau, s, buffer_full=True) == "buffer"
    assert choose(0.6, tau, s, buffer_full=False) == "gold"  # r = τ is not below τ
    assert choose(0.99, tau, s, buffer_full=True) == "gold"
    assert choose(0.0, 0.0, 0.0, buffer_full=False) == "gold"  # τ = 0: the reference only


def test_schedule_values_follow_the_published_one_based_step():
    assert schedule_value("decreasing", 0.8, 0, 4) == pytest.approx(0.6)  # t = 1 of 4
    assert schedule_value("decreasing", 0.8, 3, 4) == 0.0  # the last step generates only to fill
    assert schedule_value("increasing", 0.8, 3, 4) == 0.8
    assert schedule_value("constant", 0.8, 2, 4) == 0.4
    with pytest.raises(ValueError, match="not a step of a 4-step run"):
        schedule_value("decreasing", 0.8, 4, 4)


def test_off_and_always_ignore_the_draw_and_the_buffer():
    for step, k, full, empty in product(range(3), range(3), (False, True), (False, True)):
        assert decide(OffPolicyState(1.0), OffPolicySpec(), step, 3, k, full, empty, SEED) == "gold"
        assert decide(OffPolicyState(0.0), OffPolicySpec(mode="always"), step, 3, k, full, empty, SEED) == "generated"


def test_a_buffer_decision_on_an_empty_buffer_generates(monkeypatch):
    monkeypatch.setattr(policy, "draw", lambda seed, step, micro_batch: 0.9)
    state = OffPolicyState(1.0)
    assert decide(state, ADAPTIVE, 9, 10, 0, True, False, SEED) == "buffer"
    assert decide(state, ADAPTIVE, 9, 10, 0, True, True, SEED) == "generated"


def test_the_state_machine_on_scripted_draws_and_dev_losses(monkeypatch):
    """A 4-step run, one micro batch of one row per step, a buffer of 2 rows, τ steps of 0.5."""
    spec = OffPolicySpec(mode="adaptive", threshold_step=0.5, buffer_size=2)
    draws = iter([0.05, 0.40, 0.30, 0.70])
    dev_losses = iter([2.0, 2.15, 2.2, 2.3])  # at step 0, then after steps 1, 2 and 3
    monkeypatch.setattr(policy, "draw", lambda seed, step, micro_batch: next(draws))
    buffer, state, trace = ReplayBuffer(spec.buffer_size), OffPolicyState.initial(spec), []
    state = update_threshold(state, spec, next(dev_losses))
    assert (state.threshold, state.reference_loss) == (0.0, 2.0)
    for step in range(4):
        source = decide(state, spec, step, 4, 0, buffer.full, buffer.empty, SEED)
        if source == "generated":
            buffer.push([make_row(step)], step)
        state = state.count(source)
        if step < 3:
            state = update_threshold(state, spec, next(dev_losses))
        trace.append((source, state.threshold, state.reference_loss, len(buffer)))
    assert trace == [
        ("gold", 0.5, 2.15, 0),  # τ = 0 trains on the reference; 2.15 ≥ 2.0 + 0.1 raises τ
        ("generated", 0.5, 2.15, 1),  # 0.40 < τ with the buffer filling; 2.2 < 2.25: no change
        ("generated", 1.0, 2.3, 2),  # 0.30 < τ, still filling; 2.3 ≥ 2.25 raises τ to 1
        ("buffer", 1.0, 2.3, 2),  # s = 0 at the last step and the buffer is full
    ]
    assert state.micro_batches == {"gold": 1, "generated": 2, "buffer": 1}
    assert (state.dev_evaluations, state.threshold_raises) == (4, 2)


# --- ranks and keyed streams ---------------------------------------------------------------


def test_the_draw_is_keyed_pinned_and_independent_of_the_global_streams():
    assert draw(42, 0, 0) == 0.6695181927257077  # the key "42/off-policy/draw/0/0" never changes
    before = [draw(SEED, step, k) for step in range(5) for k in range(3)]
    random.seed(1)
    np.random.seed(2)
    np.random.uniform(size=10)
    assert [draw(SEED, step, k) for step in range(5) for k in range(3)] == before
    assert len(set(before)) == len(before) and all(0 <= r < 1 for r in before)
    assert draw(SEED + 1, 0, 0) != draw(SEED, 0, 0)


def test_every_rank_decides_the_same_and_draws_its_own_buffer_rows():
    # decide takes no rank: ranks given the same agreed state decide the same in every micro batch.
    state, per_rank = OffPolicyState(0.7), {}
    for rank in range(4):
        per_rank[rank] = [decide(state, ADAPTIVE, step, 8, k, True, False, SEED) for step in range(8) for k in range(2)]
    assert all(decisions == per_rank[0] for decisions in per_rank.values())
    picks = {rank: buffer_generator(SEED, 3, 1, rank).choice(100, size=5, replace=False).tolist() for rank in range(4)}
    assert len({tuple(p) for p in picks.values()}) == 4  # each rank its own stream
    assert buffer_generator(SEED, 3, 1, 2).choice(100, size=5, replace=False).tolist() == picks[2]


def test_without_a_process_group_the_agreed_values_are_the_local_ones():
    buffer = ReplayBuffer(2)
    assert agreed_buffer_flags(buffer) == (False, True)
    buffer.push([make_row(0)], step=0)
    assert agreed_buffer_flags(buffer) == (False, False)
    buffer.push([make_row(1)], step=0)
    assert agreed_buffer_flags(buffer) == (True, False)
    assert agreed_dev_loss(2.5) == 2.5


def test_draws_are_uniform():
    draws = np.array([draw(SEED, step, k) for step in range(1000) for k in range(4)])
    assert abs(draws.mean() - 0.5) < 0.02
    assert abs((draws < 0.3).mean() - 0.3) < 0.03


def test_generation_is_sampled_as_published_and_keyed_by_row():
    recipe = Recipe.model_validate(
        {
            "name": "r",
            "output_dir": "o",
            "teacher": {"path": "t"},
            "student": {"path": "s"},
            "data": {"train": "x", "dev": "d", "max_length": 64, "max_prompt_length": 24},
            "train": {"max_steps": 1, "batch_size": 2, "micro_batch_size": 2},
            "off_policy": {"mode": "adaptive"},
        }
    )
    params = generation_params(recipe)
    assert (params.temperature, params.top_k, params.top_p, params.max_new_tokens) == (1.0, 0, 1.0, 40)
    seeds = generation_seeds(SEED, 5, ["3", 7])
    assert seeds == generation_seeds(SEED, 5, [3, "7"]) and len(set(seeds)) == 2
    assert generation_seeds(SEED, 6, [3]) != seeds[:1]
    assert buffer_file(3) == "replay_buffer-rank-00003.parquet"


# --- the threshold ---------------------------------------------------------------------------


def test_the_first_dev_loss_sets_the_reference_and_later_rises_raise_the_threshold():
    state = update_threshold(OffPolicyState.initial(ADAPTIVE), ADAPTIVE, 2.0)
    assert (state.threshold, state.reference_loss, state.dev_evaluations) == (0.0, 2.0, 1)
    # Small rises do not move L₀, so they add up against the same reference.
    for loss in (2.05, 2.09, 1.5):
        state = update_threshold(state, ADAPTIVE, loss)
        assert (state.threshold, state.reference_loss) == (0.0, 2.0)
    state = update_threshold(state, ADAPTIVE, 2.1)  # exactly L₀ + ε raises (≥)
    assert (state.threshold, state.reference_loss, state.threshold_raises) == (0.1, 2.1, 1)


def test_the_threshold_reaches_one_exactly_and_stays_there_while_the_reference_moves():
    state = OffPolicyState(0.0, reference_loss=0.0)
    for rise in range(1, 13):
        state = update_threshold(state, ADAPTIVE, float(rise))
    assert state.threshold == 1.0 and state.reference_loss == 12.0 and state.threshold_raises == 12
    bigger = OffPolicySpec(mode="adaptive", threshold_step=0.3, loss_eps=0.0)
    assert update_threshold(OffPolicyState(0.9, 1.0), bigger, 1.0).threshold == 1.0


def test_the_threshold_is_left_alone_outside_adaptive_and_never_steered_by_nan():
    state = OffPolicyState(0.2, reference_loss=1.0)
    assert update_threshold(state, OffPolicySpec(), 9.0) is state
    assert update_threshold(state, OffPolicySpec(mode="always"), 9.0) is state
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="not finite"):
            update_threshold(state, ADAPTIVE, bad)


def test_the_state_round_trips_through_json_exactly(tmp_path):
    state = OffPolicyState(0.30000000000000004, reference_loss=1 / 3, dev_evaluations=7, threshold_raises=3)
    state = state.count("buffer").count("generated").count("generated")
    assert OffPolicyState.from_json(json.loads(json.dumps(state.to_json()))) == state
    write_state(tmp_path / "state.json", state)
    assert read_state(tmp_path / "state.json") == state
    assert [path.name for path in tmp_path.iterdir()] == ["state.json"]  # no temporary left
    assert OffPolicyState.from_json(OffPolicyState.initial(ADAPTIVE).to_json()).reference_loss is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": "other/1"}, "not an off-policy sampling state"),
        ({"threshold": 1.5}, "outside"),
        ({"threshold": None}, "finite number"),
        ({"reference_loss": "2"}, "finite number"),
        ({"dev_evaluations": -1}, "a count"),
        ({"threshold_raises": True}, "a count"),
        ({"micro_batches": {"gold": 1}}, "micro_batches must map"),
        ({"extra": 1}, "has the keys"),
    ],
)
def test_a_malformed_state_is_refused(tmp_path, change, message):
    payload = OffPolicyState(0.5, 2.0).to_json() | change
    with pytest.raises(ValueError, match=message):
        OffPolicyState.from_json(payload)
    (tmp_path / "state.json").write_text(json.dumps(payload), encoding="utf-8")
    with pytest.raises(MtaError, match=f"state.json: not a readable off-policy sampling state: .*{message}"):
        read_state(tmp_path / "state.json")


# --- the replay buffer ----------------------------------------------------------------------


def test_the_buffer_is_first_in_first_out():
    buffer = ReplayBuffer(3)
    assert buffer.empty and not buffer.full
    buffer.push([make_row(0), make_row(1)], step=0)
    buffer.push([make_row(2), make_row(3)], step=1)
    assert [row["id"] for row in buffer.rows()] == [1, 2, 3] and buffer.steps() == [0, 1, 1]
    assert buffer.full and len(buffer) == 3
    buffer.push([make_row(4)], step=2)
    assert [row["id"] for row in buffer.rows()] == [2, 3, 4]


def test_rows_arrive_as_mappings_or_as_the_span_parsers_record_batch():
    buffer = ReplayBuffer(4)
    batch = rows_table([make_row(0), make_row(1)]).to_batches()[0]
    buffer.push(batch, step=3)
    buffer.push([make_row(2)], step=4)
    assert buffer.rows() == rows_table([make_row(i) for i in range(3)]).to_pylist()
    assert buffer.steps() == [3, 3, 4]
    with pytest.raises(ValueError, match="must have the annotate schema"):
        buffer.push(pa.table({"id": [1]}), step=5)


def test_rows_that_are_not_annotate_rows_are_refused_and_add_nothing():
    buffer = ReplayBuffer(4)
    buffer.push([make_row(0)], step=0)
    broken = make_row(1)
    del broken["word_spans"]
    with pytest.raises(ValueError, match=r"missing \['word_spans'\]"):
        buffer.push([make_row(2), broken], step=1)
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError)):
        buffer.push([make_row(3) | {"prompt_chars": "thirty"}], step=1)
    with pytest.raises(ValueError, match="at least 1 row"):
        ReplayBuffer(0)
    assert [row["id"] for row in buffer.rows()] == [0]


def test_sampling_is_uniform_without_replacement_and_reproducible():
    buffer = ReplayBuffer(8)
    buffer.push([make_row(i) for i in range(8)], step=0)
    drawn = [row["id"] for row in buffer.sample(8, buffer_generator(SEED, 0, 0, 0))]
    assert sorted(drawn) == list(range(8))  # no row twice
    again = [row["id"] for row in buffer.sample(8, buffer_generator(SEED, 0, 0, 0))]
    assert again == drawn
    counts = np.bincount([buffer.sample(1, buffer_generator(SEED, s, 0, 0))[0]["id"] for s in range(1600)], minlength=8)
    assert counts.min() > 150 and counts.max() < 250  # 200 expected each
    with pytest.raises(ValueError, match="cannot draw 9 rows from a replay buffer holding 8"):
        buffer.sample(9, buffer_generator(SEED, 0, 0, 0))


def test_sampled_rows_make_a_training_batch():
    buffer = ReplayBuffer(4)
    buffer.push([make_row(i) for i in range(4)], step=0)
    rows = buffer.sample(2, buffer_generator(SEED, 0, 0, 0))
    batch = AnnotatedExamples(rows_table(rows), student_pad_id=0, teacher_pad_id=0).batch([0, 1])
    assert batch.row_ids == [str(row["id"]) for row in rows]
    assert batch.teacher.input_ids.shape == (2, 4) and batch.student.input_ids.shape == (2, 3)


def test_the_buffer_round_trips_through_parquet_row_for_row(tmp_path):
    buffer = ReplayBuffer(5)
    for step in range(3):
        buffer.push([make_row(2 * step), make_row(2 * step + 1)], step=step)
    path = tmp_path / buffer_file(0)
    buffer.write(path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # written atomically, nothing left over
    back = ReplayBuffer.read(path, capacity=5)
    assert back.rows() == buffer.rows() and back.steps() == buffer.steps() == [0, 1, 1, 2, 2]
    as_bytes = lambda rows: json.dumps(rows, ensure_ascii=False, sort_keys=True).encode()  # noqa: E731
    assert as_bytes(back.rows()) == as_bytes(buffer.rows())
    assert rows_table(back.rows()).equals(rows_table(buffer.rows()))
    assert back.capacity == 5 and back.full
    table = pq.read_table(path)
    assert table.column_names[-1] == "step" and table.schema.field("prompt_chars").type == pa.int32()
    empty = tmp_path / "empty.parquet"
    ReplayBuffer(3).write(empty)
    assert ReplayBuffer.read(empty, 3).empty


def test_a_foreign_or_broken_buffer_file_is_refused(tmp_path):
    rows = [make_row(i) for i in range(3)]
    write_generated_rows(tmp_path / "rows.parquet", rows, [0, 0, 1])
    assert read_generated_rows(tmp_path / "rows.parquet") == (rows_table(rows).to_pylist(), [0, 0, 1])
    with pytest.raises(MtaError, match="holds 3 generated rows, more than off_policy.buffer_size=2"):
        ReplayBuffer.read(tmp_path / "rows.parquet", capacity=2)
    pq.write_table(rows_table(rows), tmp_path / "annotations.parquet")  # no step, no version
    with pytest.raises(MtaError, match=f"not generated rows of annotate schema version {SCHEMA_VERSION}"):
        read_generated_rows(tmp_path / "annotations.parquet")
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "rows.parquet").read_bytes()[:100])
    with pytest.raises(MtaError, match="not a readable Parquet file"):
        read_generated_rows(tmp_path / "cut.parquet")
    with pytest.raises(MtaError, match="the generated rows are missing"):
        read_generated_rows(tmp_path / "absent.parquet")
    with pytest.raises(ValueError, match="3 rows but 2 steps"):
        write_generated_rows(tmp_path / "more.parquet", rows, [0, 1])
