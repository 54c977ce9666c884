"""The replay buffer of DistiLLM's adaptive sampling, and generated rows as Parquet files.

``ReplayBuffer``: a rank's FIFO of generated rows (the annotate artefact's columns, spans
included), pushed as each generated micro batch is settled and drawn from uniformly without
replacement (with ``policy.buffer_generator``'s keyed stream). It is saved with each checkpoint
as one Parquet file per rank (``buffer_file``): the annotate columns plus ``step``, the schema
version in the file's metadata (``write_generated_rows`` / ``read_generated_rows``, which also
write ``train.save_generated``'s ``OUT/generated/`` files). ``agreed_buffer_flags`` gives
``policy.decide`` the flags every rank agrees on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mta import distributed
from mta.data.artefact_schema import COLUMNS, SCHEMA, SCHEMA_VERSION
from mta.errors import MtaError
from mta.files import atomic_path

STEP_COLUMN = "step"
ROWS_SCHEMA = SCHEMA.append(pa.field(STEP_COLUMN, pa.int64()))
ROWS_METADATA = {b"mta.rows": b"generated", b"mta.schema_version": str(SCHEMA_VERSION).encode()}

# The suggested name inside a checkpoint directory (the checkpoint's owner decides where it goes).
BUFFER_FILE = "replay_buffer-rank-{rank:05d}.parquet"  # one per rank


def buffer_file(rank: int) -> str:
    """The file name of rank ``rank``'s replay buffer in a checkpoint."""
    return BUFFER_FILE.format(rank=rank)


Rows: TypeAlias = Sequence[Mapping[str, Any]] | pa.RecordBatch | pa.Table


def rows_table(rows: Rows) -> pa.Table:
    """Rows (mappings of exactly the annotate artefact's columns, or a record batch / table of
    its schema, as ``mta.data.online_spans`` returns them) as an Arrow table of that schema, the
    table ``batching.AnnotatedExamples`` reads. ``ValueError`` names a row or a schema whose
    columns differ; Arrow refuses a value of the wrong type."""
    if isinstance(rows, (pa.RecordBatch, pa.Table)):
        if not rows.schema.equals(SCHEMA, check_metadata=False):
            raise ValueError(f"generated rows must have the annotate schema; got columns {rows.schema.names}")
        return pa.Table.from_batches([rows]) if isinstance(rows, pa.RecordBatch) else rows
    for position, row in enumerate(rows):
        if set(row) != set(COLUMNS):
            missing, extra = sorted(set(COLUMNS) - set(row)), sorted(set(row) - set(COLUMNS))
            raise ValueError(
                f"generated row {position} does not have the annotate columns: missing {missing}, unexpected {extra}"
            )
    return pa.Table.from_pylist([dict(row) for row in rows], schema=SCHEMA)


def write_generated_rows(
    path: str | Path, rows: Rows, steps: Sequence[int], extra: Mapping[str, Sequence[Any]] | None = None
) -> None:
    """Write generated ``rows`` with the ``step`` each was generated at as one Parquet file
    (annotate columns + ``step``, the schema version in its metadata), atomically. ``extra``:
    more columns, one value per row (``OUT/generated/`` adds ``micro_batch`` and ``source``;
    ``read_generated_rows`` reads only files without them)."""
    table = rows_table(rows)
    if len(steps) != table.num_rows:
        raise ValueError(f"{table.num_rows} rows but {len(steps)} steps")
    table = table.append_column(pa.field(STEP_COLUMN, pa.int64()), pa.array(steps, pa.int64()))
    for name, values in (extra or {}).items():
        if len(values) != table.num_rows:
            raise ValueError(f"{table.num_rows} rows but {len(values)} values of {name}")
        table = table.append_column(name, pa.array(list(values)))
    with atomic_path(path) as temporary:
        pq.write_table(table.replace_schema_metadata(ROWS_METADATA), temporary, compression="zstd")


def read_generated_rows(path: str | Path) -> tuple[list[dict[str, Any]], list[int]]:
    """``(rows, steps)`` as ``write_generated_rows`` wrote them; ``MtaError`` naming the file otherwise."""
    try:
        table = pq.read_table(path)
    except FileNotFoundError as error:
        raise MtaError(f"{path}: the generated rows are missing") from error
    except (pa.ArrowException, OSError) as error:
        raise MtaError(f"{path}: not a readable Parquet file ({error}): it is corrupt or truncated") from error
    metadata = table.schema.metadata or {}
    version = metadata.get(b"mta.schema_version", b"?").decode(errors="replace")
    if version != str(SCHEMA_VERSION) or not table.schema.equals(ROWS_SCHEMA, check_metadata=False):
        raise MtaError(
            f"{path}: not generated rows of annotate schema version {SCHEMA_VERSION} (found version "
            f"{version}, columns {table.column_names}); it was written by another mta version"
        )
    steps = table.column(STEP_COLUMN).to_pylist()
    return table.drop_columns([STEP_COLUMN]).to_pylist(), steps


class ReplayBuffer:
    """A rank's FIFO buffer of generated rows (annotate columns), ``capacity`` rows at most.

    ``push`` appends a micro batch's rows (the oldest fall out when full), ``sample`` draws rows
    uniformly without replacement, ``write`` / ``read`` keep it in a Parquet file (oldest first).
    Rows are stored as Arrow gives them back, so a row read from the file equals the row pushed.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a replay buffer holds at least 1 row, got capacity {capacity}")
        self.capacity = capacity
        self._rows: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._steps: deque[int] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def full(self) -> bool:
        return len(self._rows) == self.capacity

    @property
    def empty(self) -> bool:
        return not self._rows

    def push(self, rows: Rows, step: int) -> None:
        """Append ``rows`` generated at ``step``, evicting the oldest rows past ``capacity``.
        The rows are checked against the annotate schema first (nothing is added on an error)."""
        checked = rows_table(rows).to_pylist()
        self._rows.extend(checked)
        self._steps.extend([int(step)] * len(checked))

    def rows(self) -> list[dict[str, Any]]:
        """The rows, oldest first."""
        return list(self._rows)

    def steps(self) -> list[int]:
        """The step each row was generated at, oldest first."""
        return list(self._steps)

    def sample(self, count: int, generator: np.random.Generator) -> list[dict[str, Any]]:
        """``count`` distinct rows drawn uniformly (as the published ``random.sample``) with
        ``generator`` (``buffer_generator``); ``ValueError`` if the buffer holds fewer. The rows
        are the buffer's own objects: build a batch from them (``rows_table``), do not edit them."""
        if count > len(self._rows):
            raise ValueError(f"cannot draw {count} rows from a replay buffer holding {len(self._rows)}")
        picked = generator.choice(len(self._rows), size=count, replace=False)
        return [self._rows[int(index)] for index in picked]

    def write(self, path: str | Path) -> None:
        """Save the rows and their steps (oldest first) to ``path`` (``write_generated_rows``)."""
        write_generated_rows(path, self.rows(), self.steps())

    @classmethod
    def read(cls, path: str | Path, capacity: int) -> ReplayBuffer:
        """The buffer ``write`` saved; ``MtaError`` if it holds more than ``capacity`` rows."""
        rows, steps = read_generated_rows(path)
        if len(rows) > capacity:
            raise MtaError(f"{path} holds {len(rows)} generated rows, more than off_policy.buffer_size={capacity}")
        buffer = cls(capacity)
        buffer._rows.extend(rows)
        buffer._steps.extend(steps)
        return buffer


# --------------------------------------------------------------------------- agreement over ranks


def agreed_buffer_flags(buffer: ReplayBuffer) -> tuple[bool, bool]:
    """``(buffer_full, buffer_empty)`` for ``decide``, the same on every rank: full on every
    rank, empty on some rank (two all-reduces; the local answer without a process group).

    Ranks push the same number of rows only while no generated row is dropped, so the flags are
    agreed rather than assumed. A buffer never shrinks: once agreed full it stays full.
    """
    return distributed.all_ranks_agree(buffer.full), not distributed.all_ranks_agree(not buffer.empty)
