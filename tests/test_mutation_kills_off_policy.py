"""Edges of the off-policy sampling rules that mutation testing (bench/mutation.py) found unchecked.

The messages of refused states name the field at fault; the keyed streams are re-derived here from
``sampling_seed`` and the documented purposes; the replay buffer's Parquet files keep their extra
columns, their compression and their version check; a one-row buffer exists.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fixtures.generated_rows import make_row
from mta.errors import MtaError
from mta.generation import sampling_seed
from mta.training.config.schema import OffPolicySpec
from mta.training.off_policy.policy import (
    OffPolicyState,
    buffer_generator,
    generation_seeds,
    read_state,
    schedule_value,
    update_threshold,
)
from mta.training.off_policy.replay_buffer import (
    ROWS_METADATA,
    ReplayBuffer,
    read_generated_rows,
    rows_table,
    write_generated_rows,
)

SEED = 97


def test_unknown_schedules_and_sources_are_named():
    with pytest.raises(ValueError, match="unknown off_policy.schedule 'sideways'"):
        schedule_value("sideways", 0.5, 0, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unknown source 'teacher'; one of \('gold'"):
        OffPolicyState(0.0).count("teacher")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "payload, found",
    [({"format": "other/1"}, "'other/1'"), ({"threshold": 0.1}, "None"), ([1, 2], "'list'"), (None, "'NoneType'")],
)
def test_a_state_of_another_format_says_what_it_found(payload, found):
    with pytest.raises(ValueError, match=rf"\(found {found}\)$"):
        OffPolicyState.from_json(payload)


@pytest.mark.parametrize(
    "field, value, name",
    [
        ("threshold", "0.5", "threshold"),
        ("reference_loss", float("nan"), "reference_loss"),
        ("dev_evaluations", 1.5, "dev_evaluations"),
        ("threshold_raises", -2, "threshold_raises"),
    ],
)
def test_each_malformed_field_is_named_in_the_message(field, value, name):
    payload = OffPolicyState(0.5, 2.0).to_json() | {field: value}
    with pytest.raises(ValueError, match=rf"^{name} must be a"):
        OffPolicyState.from_json(payload)


def test_each_malformed_micro_batch_count_is_named():
    for source in ("gold", "generated", "buffer"):
        payload = OffPolicyState(0.5).to_json()
        payload["micro_batches"] = {"gold": 0, "generated": 0, "buffer": 0} | {source: -1}
        with pytest.raises(ValueError, match=rf"^micro_batches\.{source} must be a count"):
            OffPolicyState.from_json(payload)


def test_a_threshold_of_exactly_zero_or_one_reads_back():
    for threshold in (0.0, 1.0):
        state = OffPolicyState(threshold, 3.0)
        assert OffPolicyState.from_json(state.to_json()) == state


def test_the_raised_threshold_is_rounded_to_twelve_decimals():
    spec = OffPolicySpec(mode="adaptive", threshold_step=4e-13, loss_eps=0.0)
    state = update_threshold(update_threshold(OffPolicyState(0.25), spec, 1.0), spec, 2.0)
    assert state.threshold == 0.25 and state.threshold_raises == 1 and state.reference_loss == 2.0


def test_a_missing_state_file_is_named(tmp_path):
    with pytest.raises(MtaError, match=r"absent\.json: the off-policy sampling state is missing$"):
        read_state(tmp_path / "absent.json")


def test_the_keyed_streams_are_the_documented_keys():
    for step, micro_batch, rank in ((0, 0, 0), (3, 1, 2), (7, 5, 1)):
        key = sampling_seed(SEED, f"off-policy/buffer/rank-{rank}", step, micro_batch)
        want = np.random.default_rng(key).integers(0, 2**62, size=4)
        assert (buffer_generator(SEED, step, micro_batch, rank).integers(0, 2**62, size=4) == want).all()
    assert generation_seeds(SEED, 4, [2, "9"]) == [
        sampling_seed(SEED, "off-policy/generate", 4, 2),
        sampling_seed(SEED, "off-policy/generate", 4, 9),
    ]


def test_table_input_is_returned_as_a_table_and_schema_metadata_does_not_matter():
    table = rows_table([make_row(0), make_row(1)])
    assert rows_table(table) is table
    batch = table.to_batches()[0]
    as_table = rows_table(batch)
    assert isinstance(as_table, pa.Table) and as_table.equals(table)
    tagged = table.replace_schema_metadata({b"written-by": b"someone else"})
    assert rows_table(tagged).num_rows == 2


def test_extra_columns_are_written_with_their_values_and_counted(tmp_path):
    rows = [make_row(i) for i in range(3)]
    path = tmp_path / "generated.parquet"
    write_generated_rows(path, rows, [4, 4, 5], extra={"micro_batch": [0, 1, 1], "source": ["a", "b", "c"]})
    table = pq.read_table(path)
    assert table.column_names[-3:] == ["step", "micro_batch", "source"]
    assert table.column("micro_batch").to_pylist() == [0, 1, 1]
    assert table.column("source").to_pylist() == ["a", "b", "c"]
    assert table.schema.metadata[b"mta.schema_version"] == ROWS_METADATA[b"mta.schema_version"]
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
    with pytest.raises(ValueError, match="^3 rows but 2 values of source$"):
        write_generated_rows(tmp_path / "short.parquet", rows, [0, 0, 0], extra={"source": ["a", "b"]})
    assert not (tmp_path / "short.parquet").exists()


def write_with_version(path, version: bytes | None) -> None:
    rows = [make_row(0)]
    write_generated_rows(path, rows, [0])
    table = pq.read_table(path)
    metadata = dict(table.schema.metadata)
    if version is None:
        del metadata[b"mta.schema_version"]
    else:
        metadata[b"mta.schema_version"] = version
    pq.write_table(table.replace_schema_metadata(metadata), path)


def test_a_rows_file_of_another_version_is_refused_even_with_the_right_columns(tmp_path):
    write_with_version(tmp_path / "old.parquet", b"0")
    with pytest.raises(MtaError, match=r"found version 0, columns"):
        read_generated_rows(tmp_path / "old.parquet")
    write_with_version(tmp_path / "none.parquet", None)
    with pytest.raises(MtaError, match=r"found version \?, columns"):
        read_generated_rows(tmp_path / "none.parquet")
    write_with_version(tmp_path / "bytes.parquet", b"\xff1")
    with pytest.raises(MtaError, match="found version \ufffd1, columns"):
        read_generated_rows(tmp_path / "bytes.parquet")


def test_a_one_row_buffer_keeps_the_newest_row(tmp_path):
    buffer = ReplayBuffer(1)
    buffer.push([make_row(0), make_row(1)], step=2)
    assert [row["id"] for row in buffer.rows()] == [1] and buffer.full
    assert buffer.sample(1, buffer_generator(SEED, 0, 0, 0))[0]["id"] == 1
    buffer.write(tmp_path / "one.parquet")
    assert json.dumps(ReplayBuffer.read(tmp_path / "one.parquet", 1).rows()) == json.dumps(buffer.rows())
