"""Where annotate's rows come from: a JSONL file, or a table Hugging Face ``datasets`` reads.

- a JSONL file (any name not below): streamed line by line by :mod:`mta.data.rows`; a problem
  names its line (``FILE:17: ...``);
- a Parquet (``.parquet``) or CSV (``.csv``) file: read with ``datasets.load_dataset`` (which
  keeps an Arrow copy in the datasets cache, ``HF_DATASETS_CACHE``). CSV cells are read as text,
  as written: an empty cell is an empty string, ``NA`` is the two letters;
- a directory ``Dataset.save_to_disk`` wrote (one dataset: for a ``DatasetDict``, give one
  split's subdirectory): ``datasets.load_from_disk``.

A ``datasets`` row is turned into the JSON object a JSONL line would hold and parsed by the same
code (:func:`mta.data.rows.record_rows`), so the same content annotates to the same rows in any
container. Its ``id`` is its 0-based index in the table, and a problem names it (``FILE: row 17:
...``).

``fields`` (recipe ``data.fields``, ``mta annotate --field KEY=COLUMN``) maps other column names
onto the keys the row formats read (:data:`mta.data.rows.FIELD_NAMES`), for every kind of input:
``{"prompt": "question", "response": "answer"}`` reads column ``question`` as the prompt. A
``datasets`` input lacking a mapped column is refused before any work, naming its columns.

What the manifest records of the input (:meth:`InputSource.record`): its path, ``sha256`` and
``rows``, its ``format``, and the ``fields`` when there are any. A file's sha256 is its bytes'; a
``save_to_disk`` directory's is the sha256 of its checksum list (every file in it, by relative
path: :func:`mta.hashing.directory_checksums`).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any

from mta.data.prompts import ALPACA, PromptProblem, PromptStyle
from mta.data.rows import (
    InputSummary,
    Row,
    RowProblem,
    check_input_file,
    decode_line,
    field_problems,
    is_mapped_pair_file,
    is_pair_file,
    is_pair_record,
    jsonl_lines,
    map_fields,
    read_mapped_rows,
    read_rows,
    record_rows,
    summarize_input,
)
from mta.errors import MtaError
from mta.hashing import directory_checksums, file_sha256, json_sha256

JSONL = "jsonl"
PARQUET = "parquet"
CSV = "csv"
DATASET = "dataset"  # a save_to_disk directory
SUFFIXES = {".parquet": PARQUET, ".csv": CSV}  # any other file is JSONL
BATCH_ROWS = 1024  # rows converted from Arrow at a time


class InputSource:
    """One annotate input: its rows (sharded, prompts built under a style), identity and
    problem messages. Build one with :func:`open_source`."""

    format = JSONL

    def __init__(self, path: Path, fields: Mapping[str, str]):
        self.path = path
        self.fields = dict(fields)

    def summary(self) -> InputSummary:
        raise NotImplementedError

    def rows(self, *, shard: int = 0, num_shards: int = 1, style: PromptStyle = ALPACA) -> Iterator[Row]:
        """The rows whose id is ``shard`` modulo ``num_shards``, in input order."""
        raise NotImplementedError

    def is_pairs(self) -> bool:
        """Whether the rows are DistiLLM-2 pairs (the first row decides)."""
        raise NotImplementedError

    def records(self, *, shard: int = 0, num_shards: int = 1) -> Iterator[tuple[int, int, Any]]:
        """``(id, line, record)`` of the rows whose id is ``shard`` modulo ``num_shards``, in
        input order, before any row format is applied (``mta embed`` reads its own fields):
        the decoded object with ``fields`` mapped, or the ``RowProblem`` of a line that holds
        none. ``line`` is the JSONL line number, or the row's index for a ``datasets`` input."""
        raise NotImplementedError

    def first_problem(self, *, shard: int = 0, num_shards: int = 1, style: PromptStyle = ALPACA) -> RowProblem | None:
        """The shard's first unusable row, found before any expensive work starts."""
        rows = self.rows(shard=shard, num_shards=num_shards, style=style)
        return next((row for row in rows if isinstance(row, RowProblem)), None)

    def describe(self, problem: RowProblem) -> str:
        """``FILE:LINE: message`` (JSONL) or ``FILE: row INDEX: message``, with the mapping."""
        text = problem.describe(self.path)
        if self.fields:
            text += f" (columns read as: {_mapping(self.fields)})"
        return text

    def error(self, problem: RowProblem) -> MtaError:
        return MtaError(f"{self.describe(problem)} (fix the row, or pass --on-error skip to skip and count it)")

    def record(self, summary: InputSummary) -> dict[str, Any]:
        """The manifest's ``input``: path, sha256, rows, format (and fields, when mapped)."""
        record: dict[str, Any] = {
            "path": str(self.path.resolve()),
            "sha256": summary.sha256,
            "rows": summary.rows,
            "format": self.format,
        }
        if self.fields:
            record["fields"] = dict(sorted(self.fields.items()))
        return record


class JsonlSource(InputSource):
    format = JSONL

    def summary(self) -> InputSummary:
        return summarize_input(self.path)

    def rows(self, *, shard: int = 0, num_shards: int = 1, style: PromptStyle = ALPACA) -> Iterator[Row]:
        if not self.fields:
            return read_rows(self.path, shard=shard, num_shards=num_shards, style=style)
        return read_mapped_rows(self.path, self.fields, shard=shard, num_shards=num_shards, style=style)

    def is_pairs(self) -> bool:
        if not self.fields:
            return is_pair_file(self.path)
        return is_mapped_pair_file(self.path, self.fields)

    def records(self, *, shard: int = 0, num_shards: int = 1) -> Iterator[tuple[int, int, Any]]:
        for row_id, (line, raw) in enumerate(jsonl_lines(self.path)):
            if row_id % num_shards == shard:
                record = decode_line(raw)
                if isinstance(record, PromptProblem):  # rows' _Invalid: not a JSON object
                    yield row_id, line, RowProblem(row_id, line, record.reason, record.message)
                else:
                    yield row_id, line, map_fields(record, self.fields)


class DatasetsSource(InputSource):
    """A Parquet or CSV file, or a save_to_disk directory, read through ``datasets``."""

    def __init__(self, path: Path, format: str, fields: Mapping[str, str]):
        super().__init__(path, fields)
        self.format = format

    @cached_property
    def dataset(self) -> Any:
        """The table (``datasets.Dataset``, no output format), its mapped columns checked."""
        try:
            import datasets
        except ImportError as error:  # a dependency of mta; absent only in a broken install
            raise MtaError(f"reading {self.path} needs the `datasets` package: pip install datasets") from error
        try:
            with _quiet(datasets):
                if self.format == DATASET:
                    table = datasets.load_from_disk(str(self.path))
                elif self.format == CSV:
                    # Every column as text, as written: numbers stay strings, empty cells "".
                    features = datasets.Features({name: datasets.Value("string") for name in _csv_header(self.path)})
                    table = datasets.load_dataset(
                        "csv",
                        data_files=str(self.path),
                        split="train",
                        features=features,
                        na_filter=False,
                        keep_default_na=False,
                    )
                else:
                    table = datasets.load_dataset("parquet", data_files=str(self.path), split="train")
        except MtaError:
            raise
        except Exception as error:  # datasets and Arrow raise many kinds; all mean "not readable"
            raise MtaError(
                f"cannot read {self.path} as {_KIND[self.format]} ({type(error).__name__}: {error}); "
                "check the file, or convert it to JSONL"
            ) from error
        if isinstance(table, datasets.DatasetDict):  # load_from_disk of a DatasetDict: refused earlier
            raise MtaError(_dataset_dict_message(self.path, list(table)))
        table = table.with_format(None)
        missing = {key: column for key, column in self.fields.items() if column not in table.column_names}
        if missing:
            raise MtaError(
                f"{self.path} has no column {', '.join(repr(c) for c in missing.values())} (read as "
                f"{_mapping(missing)}); its columns are: {', '.join(table.column_names) or 'none'}. "
                "Name existing columns in data.fields / --field KEY=COLUMN"
            )
        return table

    def summary(self) -> InputSummary:
        if self.format == DATASET:
            digest = json_sha256(directory_checksums(self.path))
        else:
            digest = file_sha256(self.path)
        return InputSummary(sha256=digest, rows=len(self.dataset))

    def rows(self, *, shard: int = 0, num_shards: int = 1, style: PromptStyle = ALPACA) -> Iterator[Row]:
        return record_rows(self._records(shard, num_shards), pairs=self.is_pairs(), style=style)

    def _records(self, shard: int, num_shards: int) -> Iterator[tuple[int, Any]]:
        table = self.dataset
        selected = range(shard, len(table), num_shards)
        chosen = table if num_shards == 1 else table.select(selected)
        for start in range(0, len(chosen), BATCH_ROWS):
            columns = chosen[start : start + BATCH_ROWS]
            names = list(columns)
            for offset in range(len(columns[names[0]]) if names else 0):
                record = {name: columns[name][offset] for name in names}
                yield selected[start + offset], map_fields(record, self.fields)

    def is_pairs(self) -> bool:
        return len(self.dataset) > 0 and is_pair_record(map_fields(self.dataset[0], self.fields))

    def records(self, *, shard: int = 0, num_shards: int = 1) -> Iterator[tuple[int, int, Any]]:
        for index, record in self._records(shard, num_shards):
            yield index, index, record

    def describe(self, problem: RowProblem) -> str:
        text = f"{self.path}: row {problem.line}: {problem.message}"  # ``line`` holds the index
        if self.fields:
            text += f" (columns read as: {_mapping(self.fields)})"
        return text


_KIND = {PARQUET: "Parquet", CSV: "CSV", DATASET: "a datasets save_to_disk directory"}


def open_source(path: str | Path, fields: Mapping[str, str] | None = None) -> InputSource:
    """The input at ``path``, by what it is (see the module docstring); ``MtaError`` naming
    what to give when it is none of them, or when ``fields`` maps onto an unknown key."""
    path, fields = Path(path), dict(fields or {})
    problems = field_problems(fields)
    if problems:
        raise MtaError(f"field mapping {_mapping(fields)}: " + "; ".join(problems))
    if path.is_dir():
        from mta.store.layout import holds_artefact

        if not holds_artefact(path) and is_dataset_directory(path):
            if (path / "dataset_dict.json").is_file():
                raise MtaError(_dataset_dict_message(path, _splits(path)))
            return DatasetsSource(path, DATASET, fields)
    check_input_file(path)  # a directory here is refused, saying what it is and what to give
    format = SUFFIXES.get(path.suffix.lower())
    if format is not None:
        return DatasetsSource(path, format, fields)
    return JsonlSource(path, fields)


def is_dataset_directory(path: str | Path) -> bool:
    """Whether ``path`` is a directory ``save_to_disk`` wrote (a Dataset or a DatasetDict)."""
    path = Path(path)
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
    )


def input_identity(record: Mapping[str, Any]) -> Any:
    """What of the manifest's ``input`` decides the rows (the run key's part): the sha256 alone
    for a JSONL file read without a mapping (the key artefacts always had), else also its
    format and fields."""
    if record.get("format", JSONL) == JSONL and not record.get("fields"):
        return record["sha256"]
    return {key: record[key] for key in ("sha256", "format", "fields") if key in record}


def _mapping(fields: Mapping[str, str]) -> str:
    return ", ".join(f"{key}={column}" for key, column in sorted(fields.items()))


def _csv_header(path: Path) -> list[str]:
    with open(path, encoding="utf-8-sig", newline="") as handle:
        return next(csv.reader(handle), [])


def _splits(path: Path) -> list[str]:
    import json

    try:
        splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8")).get("splits")
    except (OSError, ValueError, AttributeError):
        splits = None
    if isinstance(splits, list) and all(isinstance(split, str) for split in splits):
        return splits
    return sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())


def _dataset_dict_message(path: Path, splits: list[str]) -> str:
    example = path / (splits[0] if splits else "train")
    return (
        f"{path} is a datasets DatasetDict (save_to_disk) with split(s) {', '.join(splits) or 'none'}; "
        f"give one split's directory, e.g. `mta annotate {example} -o OUT_DIR`"
    )


@contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """No progress bars from ``datasets`` while it loads (the caller reports progress)."""
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
