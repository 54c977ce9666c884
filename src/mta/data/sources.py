"""Where annotate's rows come from: a JSONL file (streamed by :mod:`mta.data.rows`, problems
named by line), a Parquet or CSV file or a ``save_to_disk`` directory (``datasets``; CSV cells as
text), a Hub dataset id (:class:`HubDataset`, read at one commit through the Hugging Face cache; a
local path of the same spelling wins) or an in-memory ``datasets.Dataset``. A ``datasets`` row
becomes the JSON object a JSONL line would hold and is parsed by the same code, so the same content
annotates to the same rows. ``fields`` maps other column names onto the row formats' keys. What the
manifest records of the input (:meth:`InputSource.record`): ARCHITECTURE.md, "1. annotate".
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from mta.data.prompts import ALPACA, PromptProblem, PromptStyle
from mta.data.rows import (
    SKIP_HINT,
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
from mta.hashing import directory_checksums, file_sha256, json_sha256, records_sha256

JSONL = "jsonl"
PARQUET = "parquet"
CSV = "csv"
DATASET = "dataset"  # a save_to_disk directory
HUB = "hub"  # a Hugging Face Hub dataset id
IN_MEMORY = "in-memory"  # a datasets.Dataset handed to the Python API
DEFAULT_SPLIT = "train"
SUFFIXES = {".parquet": PARQUET, ".csv": CSV}  # any other file is JSONL
BATCH_ROWS = 1024  # rows converted from Arrow at a time


class InputSource:
    """One annotate input: its rows (sharded, prompts built under a style), identity and
    problem messages. Build one with :func:`open_source`."""

    format = JSONL

    def __init__(self, path: Path, fields: Mapping[str, str]):
        self.path = path
        self.fields = dict(fields)

    @property
    def name(self) -> str:
        """How messages name the input."""
        return str(self.path)

    @property
    def label(self) -> str:
        """How a progress bar names it: the file's name."""
        return self.path.name

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

    def error(self, problem: RowProblem, skip_hint: str | None = None) -> MtaError:
        """The row's problem and its fix; ``skip_hint``: how the calling command skips bad rows
        (default ``mta.data.rows.SKIP_HINT``, ``--on-error skip``)."""
        return MtaError(f"{self.describe(problem)} (fix the row, or {skip_hint or SKIP_HINT})")

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

    def load(self, datasets: Any) -> Any:
        """The table as ``datasets`` reads it (``datasets.Dataset``, or a ``DatasetDict``)."""
        if self.format == DATASET:
            return datasets.load_from_disk(str(self.path))
        if self.format == CSV:
            # Every column as text, as written: numbers stay strings, empty cells "".
            features = datasets.Features({name: datasets.Value("string") for name in _csv_header(self.path)})
            return datasets.load_dataset(
                "csv",
                data_files=str(self.path),
                split="train",
                features=features,
                na_filter=False,
                keep_default_na=False,
            )
        return datasets.load_dataset("parquet", data_files=str(self.path), split="train")

    @cached_property
    def dataset(self) -> Any:
        """The table (``datasets.Dataset``, no output format), its mapped columns checked."""
        try:
            import datasets
        except ImportError as error:  # a dependency of mta; absent only in a broken install
            raise MtaError(f"reading {self.name} needs the `datasets` package: pip install datasets") from error
        try:
            with _quiet(datasets):
                table = self.load(datasets)
        except MtaError:
            raise
        except Exception as error:  # datasets and Arrow raise many kinds; all mean "not readable"
            raise MtaError(self.unreadable(error)) from error
        if isinstance(table, datasets.DatasetDict):  # load_from_disk of a DatasetDict: refused earlier
            raise MtaError(_dataset_dict_message(self.path, list(table)))
        table = table.with_format(None)
        missing = {key: column for key, column in self.fields.items() if column not in table.column_names}
        if missing:
            raise MtaError(
                f"{self.name} has no column {', '.join(repr(c) for c in missing.values())} (read as "
                f"{_mapping(missing)}); its columns are: {', '.join(table.column_names) or 'none'}. "
                "Name existing columns in data.fields / --field KEY=COLUMN"
            )
        return table

    def unreadable(self, error: Exception) -> str:
        return (
            f"cannot read {self.path} as {_KIND[self.format]} ({type(error).__name__}: {error}); "
            "check the file, or convert it to JSONL"
        )

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
        text = f"{self.name}: row {problem.line}: {problem.message}"  # ``line`` holds the index
        if self.fields:
            text += f" (columns read as: {_mapping(self.fields)})"
        return text


@dataclass(frozen=True)
class HubDataset:
    """A Hugging Face Hub dataset as an input: ``repo_id`` (``owner/name``), one ``split``, a
    ``subset`` (``datasets``' config name; None: the default) and a ``revision`` (a branch, tag
    or commit; None: the default branch). ``mta annotate ID --split S --subset C --revision R``."""

    repo_id: str
    split: str = DEFAULT_SPLIT
    subset: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        subset = f", subset {self.subset}" if self.subset else ""
        return f"{self.repo_id} (split {self.split}{subset})"


class HubSource(DatasetsSource):
    """One split of a Hub dataset at one commit, read with ``datasets`` from its cached snapshot."""

    def __init__(self, reference: HubDataset, fields: Mapping[str, str]):
        from mta.models.hub import dataset_snapshot

        snapshot, commit = dataset_snapshot(reference.repo_id, reference.revision)
        super().__init__(snapshot, HUB, fields)
        self.reference, self.commit = reference, commit

    @property
    def name(self) -> str:
        return str(self.reference)

    @property
    def label(self) -> str:
        return f"{self.reference.repo_id}:{self.reference.split}"

    def load(self, datasets: Any) -> Any:
        self._check_cached_copy()
        check_snapshot_data_files(self.path)  # only files inside the snapshot are read
        return datasets.load_dataset(str(self.path), name=self.reference.subset, split=self.reference.split)

    def _check_cached_copy(self) -> None:
        """Refuse a snapshot with a file whose blob is gone (a cache cleaned by hand, a download
        cut short) naming the file and the download that restores it, before ``datasets`` fails on
        it in words that would blame the split."""
        for path in sorted(self.path.rglob("*")):
            if path.is_symlink() and not path.exists():
                raise MtaError(
                    f"{self.name} at commit {self.commit[:12]}: the Hugging Face cache's copy is incomplete: "
                    f"{path} links to {os.readlink(path)}, which is missing. Download it again where the Hub is "
                    f"reachable (`hf download --repo-type dataset {self.reference.repo_id} --revision {self.commit}`)"
                )

    def unreadable(self, error: Exception) -> str:
        return (
            f"cannot read {self.name} at commit {self.commit[:12]} ({type(error).__name__}: {error}); "
            "check the split (--split, data.train_split / data.dev_split) and subset (--subset, data.subset)"
        )

    def identity(self) -> dict[str, Any]:
        return {
            "hub_id": self.reference.repo_id,
            "revision": self.commit,
            "split": self.reference.split,
            "subset": self.reference.subset,
        }

    def summary(self) -> InputSummary:
        return InputSummary(sha256=json_sha256(self.identity()), rows=len(self.dataset))

    def record(self, summary: InputSummary) -> dict[str, Any]:
        """The id, the commit, the split and subset in place of a path."""
        record = super().record(summary)
        record["path"] = self.reference.repo_id
        return {**record, **self.identity()}


DATASET_CARDS = ("README.md", ".huggingface.yaml")  # where `datasets` reads `configs[].data_files`


def _data_file_paths(value: Any) -> Iterator[str]:
    """Every path a ``data_files`` value names: a string, a list of them, ``{split: ...}``, or a
    list of ``{split, path}`` entries."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _data_file_paths(item.get("path") if isinstance(item, dict) else item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _data_file_paths(item)
    elif value is not None:
        yield str(value)


def check_snapshot_data_files(snapshot: Path) -> None:
    """Refuse a Hub dataset whose card points ``datasets`` at files outside its snapshot: every
    ``configs[].data_files`` path (``README.md``'s front matter, ``.huggingface.yaml``) must be a
    relative path inside it (no absolute path, no ``..``, no ``~``, no URL), so a dataset's card
    can never pull local files into the annotations that the manifest credits to its commit."""
    import yaml

    for name in DATASET_CARDS:
        path = snapshot / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if name == "README.md":
            if not text.startswith("---"):
                continue
            text = text.split("---", 2)[1] if text.count("---") >= 2 else ""
        try:
            card = yaml.safe_load(text)
        except yaml.YAMLError:
            continue  # `datasets` fails on it too, naming it
        configs = card.get("configs") if isinstance(card, dict) else None
        for config in configs if isinstance(configs, list) else []:
            if not isinstance(config, dict):
                continue
            for entry in _data_file_paths(config.get("data_files")):
                parts = Path(entry).parts
                if Path(entry).is_absolute() or ".." in parts or entry.startswith("~") or "://" in entry:
                    raise MtaError(
                        f"{path}: configs[{config.get('config_name', '?')}].data_files names {entry!r}, outside the "
                        "dataset's snapshot; mta reads only the dataset's own files, so it is refused (nothing "
                        "was read). Use a dataset whose card names its own files"
                    )


class InMemorySource(DatasetsSource):
    """A ``datasets.Dataset`` the caller holds (the Python API): nothing on disk names it."""

    def __init__(self, table: Any, fields: Mapping[str, str]):
        super().__init__(Path("<datasets.Dataset>"), IN_MEMORY, fields)
        self.table = table

    @property
    def name(self) -> str:
        return "the in-memory datasets.Dataset"

    @property
    def label(self) -> str:
        return "datasets.Dataset"

    def load(self, datasets: Any) -> Any:
        return self.table

    def summary(self) -> InputSummary:
        table = self.dataset
        batches = (table[start : start + BATCH_ROWS] for start in range(0, len(table), BATCH_ROWS))
        return InputSummary(sha256=records_sha256(batches), rows=len(table))

    def record(self, summary: InputSummary) -> dict[str, Any]:
        record = super().record(summary)
        record["path"] = self.name
        return record


_KIND = {PARQUET: "Parquet", CSV: "CSV", DATASET: "a datasets save_to_disk directory"}


def input_reference(
    text: str | Path, *, split: str | None = None, subset: str | None = None, revision: str | None = None
) -> Path | HubDataset:
    """What a command line or recipe names: a local path when one exists (or when ``text`` is no
    Hub dataset id), else the Hub dataset ``text`` with ``split`` (default ``train``), ``subset``
    and ``revision``. Those three apply to Hub ids only: given with a local path, an ``MtaError``."""
    from mta.models.hub import is_dataset_id

    if is_dataset_id(text):
        return HubDataset(str(text), split or DEFAULT_SPLIT, subset, revision)
    options = (("split", split), ("subset", subset), ("revision", revision))
    given = [f"{name} {value}" for name, value in options if value]
    if given:
        raise MtaError(
            f"{text} is a local path; {', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to a Hugging Face "
            "Hub dataset id (owner/name) only: drop it, or give the file of that split"
        )
    return Path(text)


def open_source(path: str | Path | HubDataset | Any, fields: Mapping[str, str] | None = None) -> InputSource:
    """The input at ``path``, by what it is (see the module docstring): a path, a
    :class:`HubDataset`, or an in-memory ``datasets.Dataset``; ``MtaError`` naming what to give
    when it is none of them, or when ``fields`` maps onto an unknown key."""
    fields = dict(fields or {})
    problems = field_problems(fields)
    if problems:
        raise MtaError(f"field mapping {_mapping(fields)}: " + "; ".join(problems))
    if isinstance(path, HubDataset):
        return HubSource(path, fields)
    if not isinstance(path, (str, Path)):
        if _is_dataset_object(path):
            return InMemorySource(path, fields)
        raise MtaError(f"an input must be a path, a HubDataset or a datasets.Dataset, not {type(path).__name__}")
    path = Path(path)
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


def _is_dataset_object(value: Any) -> bool:
    """Whether ``value`` is a ``datasets.Dataset`` (a ``DatasetDict`` is refused: give one split)."""
    import datasets

    if isinstance(value, datasets.DatasetDict):
        raise MtaError(f"a datasets.DatasetDict with splits {', '.join(value)}: give one split, e.g. dataset['train']")
    return isinstance(value, datasets.Dataset)


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
