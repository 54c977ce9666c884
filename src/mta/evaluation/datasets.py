"""The evaluation sets of the MiniLLM protocol: names, where they live, and reading them.

A data directory has the layout of the public MiniLLM release, ``DIR/<set>/valid.jsonl``; S-NI and
UnNI may also sit in their ``11_`` bucket (``DIR/sinst/11_/valid.jsonl``), which wins when both
exist because it is the file the published scripts read. Beside the built-in sets a user may
name another split of one, ``<set>-<split>`` (``dolly-dev`` is ``DIR/dolly/dev.jsonl``, the
development split the paper recipes select checkpoints on), or any JSONL file of such rows, named
by its file stem (``--benchmarks dolly,path/to/mine.jsonl`` evaluates ``dolly`` and ``mine``), or a
Hugging Face Hub dataset id, named by its name (``--benchmarks acme/qa`` evaluates ``qa``: one split,
``test`` unless ``EvalSettings.split`` says otherwise, its columns mapped by ``EvalSettings.fields``,
read through :mod:`mta.data.sources`; an existing local path of that spelling wins).
Every row becomes an ``EvalRow`` whose ``index`` (its position in the file) keys the sampling
noise and the resume journal.

A row is ``prompt`` and / or ``instruction`` (+ ``input`` or ``context``) with ``output`` (the
reference, or a list of them), or a conversation (``messages``, ending with the assistant turn
that is the reference). Its prompt is built by ``mta.data.prompts`` (the one place prompts are
built, annotate's too) under the :class:`~mta.data.prompts.PromptStyle` given: ``alpaca`` by
default, ``chat`` with the evaluated checkpoint's own chat template, or ``none``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mta.data.prompts import ALPACA, PromptProblem, PromptStyle, conversation, split_conversation
from mta.data.sources import HubDataset
from mta.errors import MtaError

log = logging.getLogger(__name__)

DATA_DIR_ENV = "MTA_DATA_DIR"


@dataclass(frozen=True)
class Benchmark:
    name: str  # the name on the command line and in every output path
    title: str  # the column header of the published tables
    bucketed: bool = False  # also accepted under DIR/<name>/11_/
    cap: int | None = None  # the protocol evaluates at most this many rows
    in_avg4: bool = False  # one of the four sets of the published average
    in_distribution: bool = False  # the training distribution (Dolly)


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("dolly", "Dolly", in_avg4=True, in_distribution=True),
        Benchmark("self-inst", "SelfInst", in_avg4=True),
        Benchmark("vicuna", "Vicuna", in_avg4=True),
        Benchmark("sinst", "S-NI", bucketed=True, in_avg4=True),
        Benchmark("uinst", "UnNI", bucketed=True, cap=10_000),
    )
}
DEFAULT_BENCHMARKS: tuple[str, ...] = tuple(BENCHMARKS)


@dataclass(frozen=True)
class EvalRow:
    """One prompt and its references, as read from line ``line`` of a set file."""

    index: int
    line: int
    prompt: str
    references: tuple[str, ...]


@dataclass(frozen=True)
class EvalSet:
    benchmark: Benchmark
    path: Path  # a Hub set: its id
    rows: list[EvalRow]
    rows_in_file: int
    origin: dict | None = None  # a Hub set: hub_id, revision (the commit), split, subset

    @property
    def name(self) -> str:
        return self.benchmark.name


def default_data_dir() -> Path:
    """``$MTA_DATA_DIR``, else ``./data``."""
    return Path(os.environ.get(DATA_DIR_ENV, "data"))


def candidate_paths(data_dir: Path, benchmark: Benchmark, split: str = "valid") -> list[Path]:
    """The files looked for, in order of preference."""
    base = Path(data_dir) / benchmark.name
    plain = base / f"{split}.jsonl"
    return [base / "11_" / f"{split}.jsonl", plain] if benchmark.bucketed else [plain]


def find_set_file(data_dir: Path, benchmark: Benchmark, split: str = "valid") -> Path | None:
    return next((p for p in candidate_paths(data_dir, benchmark, split) if p.is_file()), None)


def is_file_spec(spec: str) -> bool:
    """Whether a ``--benchmarks`` item names a JSONL file rather than a set."""
    return spec.endswith(".jsonl") or "/" in spec or os.sep in spec or (spec not in BENCHMARKS and Path(spec).is_file())


def split_benchmark(spec: str) -> tuple[Benchmark, str] | None:
    """``<set>-<split>`` (``dolly-dev``: ``DIR/dolly/dev.jsonl``) as (the set, the split), or None."""
    name, _, split = spec.rpartition("-")
    if name in BENCHMARKS and split and split != "valid":
        return BENCHMARKS[name], split
    return None


def _requested_set(
    data_dir: Path, spec: str, hub: Callable[[str], HubDataset]
) -> tuple[Benchmark, list[Path | HubDataset]]:
    """A ``--benchmarks`` item as its set and the files looked for, in order of preference.

    A built-in name (its test file); ``<set>-<split>``, another split of a built-in set (named so:
    ``dolly-dev``; never in avg4); a JSONL file, named by its stem (out of distribution); or a Hub
    dataset id, named by its name (``hub`` makes its :class:`HubDataset`)."""
    from mta.models.hub import is_dataset_id

    if spec in BENCHMARKS:
        return BENCHMARKS[spec], candidate_paths(data_dir, BENCHMARKS[spec])
    if is_dataset_id(spec):
        name = spec.rpartition("/")[2]
        if name in BENCHMARKS:
            raise MtaError(
                f"--benchmarks {spec}: a Hub set is named by its name, and '{name}' is the built-in set of "
                "that name; evaluate the built-in set, or save the split as a JSONL file of another name"
            )
        return Benchmark(name, name), [hub(spec)]
    if is_file_spec(spec):
        path = Path(spec)
        if path.stem in BENCHMARKS:
            raise MtaError(
                f"--benchmarks {spec}: a file set is named by its file stem, and '{path.stem}' is the built-in "
                f"set of that name; rename the file (e.g. {path.stem}-mine.jsonl)"
            )
        return Benchmark(path.stem, path.stem), [path]
    split = split_benchmark(spec)
    if split is not None:
        base, split_name = split
        benchmark = Benchmark(
            spec,
            f"{base.title} ({split_name})",
            bucketed=base.bucketed,
            cap=base.cap,
            in_distribution=base.in_distribution,
        )
        return benchmark, candidate_paths(data_dir, base, split_name)
    raise MtaError(
        f"unknown benchmark '{spec}'; choose from {', '.join(BENCHMARKS)}, another split of one as "
        "<set>-<split> (dolly-dev: DIR/dolly/dev.jsonl), or give a path to a JSONL file (named by its stem)"
    )


def resolve_benchmarks(
    data_dir: Path,
    requested: Sequence[str] | None,
    *,
    split: str = "test",
    subset: str | None = None,
    revision: str | None = None,
) -> list[tuple[Benchmark, Path | HubDataset]]:
    """The (set, file) pairs to evaluate.

    ``requested=None`` means the default sets: a missing one is logged with the paths looked for
    and skipped. A set the user named is an error when its file is missing. Besides the built-in
    names, ``requested`` may hold ``<set>-<split>`` (``dolly-dev``) and JSONL paths (``_requested_set``).
    """
    names = list(requested) if requested is not None else list(DEFAULT_BENCHMARKS)
    hub = functools.partial(HubDataset, split=split, subset=subset, revision=revision)  # a Hub id's split
    sets = {spec: _requested_set(data_dir, spec, hub) for spec in dict.fromkeys(names)}
    by_name: dict[str, list[str]] = {}
    for spec, (benchmark, _) in sets.items():
        by_name.setdefault(benchmark.name, []).append(spec)
    clashes = {name: specs for name, specs in by_name.items() if len(specs) > 1}
    if clashes:
        raise MtaError(
            "two sets would share a name: "
            + "; ".join(f"{' and '.join(specs)} are both '{name}'" for name, specs in clashes.items())
            + ". Rename one of the files"
        )
    found: list[tuple[Benchmark, Path | HubDataset]] = []
    for spec, (benchmark, candidates) in sets.items():
        path = next((p for p in candidates if isinstance(p, HubDataset) or p.is_file()), None)
        if path is not None:
            found.append((benchmark, path))
            continue
        looked = " or ".join(str(p) for p in candidates)
        if requested is not None:
            fetch = (
                "check the path"
                if is_file_spec(spec)
                else f"Fetch it with `mta data download --data-dir {data_dir}`, or point --data-dir "
                f"(or ${DATA_DIR_ENV}) at a directory that has it."
            )
            raise MtaError(f"benchmark '{spec}' is missing: looked for {looked}. {fetch}")
        log.warning("skipping %s: looked for %s", spec, looked)
    if not found:
        raise MtaError(
            f"no evaluation set found under {data_dir}: expected e.g. {data_dir}/dolly/valid.jsonl. "
            f"Fetch the sets with `mta data download --data-dir {data_dir}` or set --data-dir / "
            f"${DATA_DIR_ENV}."
        )
    return found


def resolve_split_file(data_dir: Path, spec: str) -> Path:
    """A file for teacher-forced scoring: a set name (its test file), ``<set>-<split>`` such as
    ``dolly-dev`` (``DIR/dolly/dev.jsonl``), or a path to a JSONL file."""
    candidates: list[Path] = []
    if spec in BENCHMARKS:
        candidates = candidate_paths(data_dir, BENCHMARKS[spec])
    elif (split := split_benchmark(spec)) is not None:
        candidates = candidate_paths(data_dir, *split)
    candidates.append(Path(spec))
    for path in candidates:
        if path.is_file():
            return path
    raise MtaError(
        f"cannot find the perplexity set '{spec}': looked for "
        f"{' or '.join(str(p) for p in candidates)}. Give a set name (dolly), <set>-<split> "
        "(dolly-dev) or a JSONL path."
    )


def _parse_row(path: Path, line_number: int, text: str, index: int, style: PromptStyle = ALPACA) -> EvalRow:
    where = f"{path}:{line_number}"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as error:
        raise MtaError(
            f"{where}: not valid JSON ({error.msg} at column {error.colno}); fix or delete the line"
        ) from error
    except ValueError as error:  # a number past Python's int digit limit
        problem = str(error).split("; use sys.set_int_max_str_digits")[0]
        raise MtaError(f"{where}: unreadable JSON ({problem}); fix or delete the line") from error
    if not isinstance(row, dict):
        raise MtaError(f"{where}: expected a JSON object with 'prompt'/'instruction' and 'output'")
    return _parse_record(where, row, index, line_number, style)


def _parse_record(where: str, row: dict, index: int, line_number: int, style: PromptStyle) -> EvalRow:
    """One set row (a decoded JSON object, or a table's row) as an ``EvalRow``; ``where`` names
    it in an error (``FILE:LINE`` or ``SET: row I``)."""
    try:
        if "messages" in row:
            turns, reference = split_conversation(conversation(row["messages"], "messages"), "messages")
            return EvalRow(index=index, line=line_number, prompt=style.build(turns=turns), references=(reference,))
        prompt, instruction = row.get("prompt"), row.get("instruction")
        if prompt is None and not isinstance(instruction, str):
            raise MtaError(f"{where}: the row has neither a 'prompt' nor an 'instruction' string")
        if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
            raise MtaError(f"{where}: 'prompt' must be a non-empty string, got {json.dumps(prompt)[:80]}")
        context = row.get("input") or row.get("context")
        prompt = style.build(
            prompt=prompt,
            instruction=instruction if isinstance(instruction, str) else None,
            context=context if isinstance(context, str) else None,
        )
    except PromptProblem as problem:
        raise MtaError(f"{where}: {problem.message}") from None
    output = row.get("output")
    references = [output] if isinstance(output, str) else output
    if not isinstance(references, list) or not references or not all(isinstance(r, str) for r in references):
        raise MtaError(
            f"{where}: 'output' must be the reference answer (a string) or a non-empty list of "
            f"strings, got {json.dumps(output)[:80]}"
        )
    return EvalRow(index=index, line=line_number, prompt=prompt, references=tuple(references))


def load_rows(
    path: str | Path, *, cap: int | None = None, limit: int | None = None, style: PromptStyle = ALPACA
) -> tuple[list[EvalRow], int]:
    """Rows of a JSONL set file (blank lines ignored), the first ``min(cap, limit)`` of them,
    and the number of rows the file holds; prompts built under ``style``. Every row is
    validated, so a bad line far down the file fails now rather than after hours of generation."""
    path = Path(path)
    rows: list[EvalRow] = []
    with open(path, encoding="utf-8") as handle:
        for line_number, text in enumerate(handle, start=1):
            if text.strip():
                rows.append(_parse_row(path, line_number, text, len(rows), style))
    if not rows:
        raise MtaError(f"{path} holds no rows; re-fetch it (`mta data download`) or remove it")
    keep = min(n for n in (cap, limit, len(rows)) if n is not None)
    return rows[:keep], len(rows)


def load_hub_rows(
    reference: HubDataset,
    fields: dict[str, str] | None = None,
    *,
    cap: int | None = None,
    limit: int | None = None,
    style: PromptStyle = ALPACA,
) -> tuple[list[EvalRow], int, dict]:
    """Rows of one split of a Hub dataset, as :func:`load_rows` reads a file's (every row
    validated), the number it holds, and its origin (id, commit, split, subset)."""
    from mta.data.rows import RowProblem
    from mta.data.sources import HubSource, open_source

    source = open_source(reference, fields)
    assert isinstance(source, HubSource)
    rows: list[EvalRow] = []
    for index, _, record in source.records():
        where = f"{source.name}: row {index}"
        if isinstance(record, RowProblem):
            raise MtaError(f"{where}: {record.message}")
        if not isinstance(record, dict):
            raise MtaError(f"{where}: expected a row with 'prompt'/'instruction' and 'output' columns")
        rows.append(_parse_record(where, record, len(rows), index, style))
    if not rows:
        raise MtaError(f"{source.name} holds no rows; check --split")
    keep = min(n for n in (cap, limit, len(rows)) if n is not None)
    return rows[:keep], len(rows), source.identity()


def load_eval_set(
    benchmark: Benchmark,
    path: Path | HubDataset,
    limit: int | None = None,
    style: PromptStyle = ALPACA,
    fields: dict[str, str] | None = None,
) -> EvalSet:
    if isinstance(path, HubDataset):
        rows, in_file, origin = load_hub_rows(path, fields, cap=benchmark.cap, limit=limit, style=style)
        return EvalSet(benchmark=benchmark, path=Path(path.repo_id), rows=rows, rows_in_file=in_file, origin=origin)
    rows, in_file = load_rows(path, cap=benchmark.cap, limit=limit, style=style)
    return EvalSet(benchmark=benchmark, path=path, rows=rows, rows_in_file=in_file)
