"""`mta generate`: DistiLLM-2's training pairs, one teacher and one student response per prompt.

Sampling goes through the one engine (``HFGenerator``), keyed per row; each model tokenises and
cuts the prompt as evaluation does, and one model is in memory at a time (the teacher answers
every pending row, then the student). Under torchrun the rows are split over the ranks, each
journalling its own. The output, the journal and resuming: ARCHITECTURE.md, "1c. generate".
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from mta import distributed
from mta.data.rows import INVALID_TEXT, Example, RowProblem, field_problems
from mta.data.sources import HubDataset, InputSource, input_identity, open_source
from mta.dtypes import DTYPES, dtype_name, resolve_dtype
from mta.errors import MtaError
from mta.evaluation.models_under_test import check_checkpoint, loaded_checkpoint
from mta.files import (
    Journal,
    LockHeld,
    atomic_write_json,
    atomic_write_jsonl,
    disk_full_is_reported,
    exclusive_lock,
    make_output_directory,
    read_jsonl_lenient,
)
from mta.generation.generator import Generator, HFGenerator
from mta.generation.sampling import SamplingParams, sampling_seed
from mta.generation.vllm_engine import ENGINE_KEY, UNRECORDED, engine_name, vllm_generation
from mta.models.weights import checkpoint_fingerprint
from mta.reporting import Reporter, SilentReporter
from mta.scoring import completion_text
from mta.store.manifests import MAX_SKIPPED_EXAMPLES

SIDES = ("teacher", "student")
# What each side's response is called in the output, as DPO-style trainers read it.
FIELDS = {"teacher": "chosen", "student": "rejected"}
JOURNAL_FORMAT = 1
# Keys of the claim that name where a model was found: the fingerprints stand for the models,
# so a moved directory still resumes its journal.
_LOCATIONS = ("teacher", "student", "data")


def pair_seed(seed: int, side: str, row: int) -> int:
    """The random stream of ``side``'s response to input row ``row`` (step 0)."""
    return sampling_seed(seed, f"generate/{side}", 0, row)


@dataclass(frozen=True)
class PairSettings:
    """How the pairs are sampled, batched and loaded. The defaults are DistiLLM-2's sampling
    (temperature 0.8, top_p 0.95, top_k 0) with evaluation's lengths (256 prompt tokens, 256
    new tokens).

    limit: only the input rows whose id is below it (the first N rows).
    on_error: "fail" stops at the first bad row (naming file:line); "skip" counts it and goes on.
    overwrite: replace an existing output file (and an unfinished journal of other settings).
    fields: ``{format key: input column}`` (``--field KEY=COLUMN``), as annotate's.
    engine: ``hf`` or ``vllm`` (:mod:`mta.generation.vllm_engine`); a journal of the other is refused.
    """

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 0
    max_new_tokens: int = 256
    max_prompt_length: int = 256
    batch_size: int = 16
    seed: int = 42
    limit: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    on_error: Literal["fail", "skip"] = "fail"
    overwrite: bool = False
    fields: tuple[tuple[str, str], ...] = ()  # a dict is accepted
    engine: Literal["hf", "vllm"] = "hf"

    def __post_init__(self) -> None:
        fields = dict(self.fields)  # a mapping, or (key, column) pairs
        if field_problems(fields):
            raise MtaError("fields: " + "; ".join(field_problems(fields)))
        object.__setattr__(self, "fields", tuple(sorted(fields.items())))
        try:
            self.sampling()
        except ValueError as error:
            raise MtaError(f"invalid sampling option: {error}") from None
        for name in ("max_prompt_length", "batch_size"):
            if getattr(self, name) < 1:
                raise MtaError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise MtaError(f"limit must be at least 1 (or unset for every row), got {self.limit}")
        if self.on_error not in ("fail", "skip"):
            raise MtaError(f"on_error must be 'fail' or 'skip', got '{self.on_error}'")
        if self.engine not in ("hf", "vllm"):
            raise MtaError(f"engine must be 'hf' or 'vllm', got '{self.engine}'")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise MtaError(f"unknown dtype '{self.dtype}'; choose from auto, {', '.join(DTYPES)}")

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, max_new_tokens=self.max_new_tokens
        )


@dataclass(frozen=True)
class PairsOutcome:
    """What a run wrote. Counts are over the whole input (every rank), per side where keyed."""

    path: Path
    rows: int  # pairs written
    skipped: int  # bad input rows skipped (on_error skip)
    skipped_examples: list[str] = field(default_factory=list)  # "file:line: what is wrong", the first few
    resumed: dict[str, int] = field(default_factory=dict)  # responses taken from an earlier run's journal
    prompts_truncated: dict[str, int] = field(default_factory=dict)  # prompts over max_prompt_length
    unfinished: dict[str, int] = field(default_factory=dict)  # responses cut at max_new_tokens


@dataclass(frozen=True)
class PairsPaths:
    """The files of one output ``PAIRS.jsonl``: the output, its journal, the ranks' locks."""

    output: Path

    @property
    def journal_dir(self) -> Path:
        return self.output.with_name(self.output.name + ".journal")

    @property
    def settings(self) -> Path:
        return self.journal_dir / "settings.json"

    def journal(self, rank: int) -> Path:
        return self.journal_dir / f"rank-{rank:05d}.jsonl"

    def journals(self) -> list[Path]:
        return sorted(self.journal_dir.glob("rank-*.jsonl"))

    def lock(self, rank: int) -> Path:
        return self.output.with_name(f".{self.output.name}.rank-{rank:05d}.lock")


def generate_pairs(
    teacher: str | Path,
    student: str | Path,
    data: str | Path | HubDataset | Any,
    output: str | Path,
    settings: PairSettings | None = None,
    reporter: Reporter | None = None,
) -> PairsOutcome:
    """Sample a teacher and a student response to every prompt of ``data`` into ``output``.

    ``teacher``, ``student``: model directories (with their tokenizer) or hub names. ``data``: a
    path, a :class:`~mta.data.sources.HubDataset` or a ``datasets.Dataset``. Everything is
    checked before a model loads; an unfinished run of the same settings is resumed. Under
    torchrun every rank calls this with the same arguments and gets the same outcome; rank 0
    writes the file.
    """
    settings = settings or PairSettings()
    reporter = reporter or SilentReporter()
    teacher, student = str(teacher), str(student)
    source, paths = open_source(data, dict(settings.fields)), PairsPaths(Path(output))
    check_output(paths, settings.overwrite)
    for checkpoint in dict.fromkeys((teacher, student)):  # the same model as both: checked once
        check_checkpoint(checkpoint)
    rows, problems = read_prompts(source, settings.limit)
    if problems and settings.on_error == "fail":
        raise source.error(problems[0])
    if not rows and not problems:
        raise MtaError(f"{source.name} holds no rows; give a JSONL file with one prompt per line")
    device = distributed.resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    claim = describe_run(teacher, student, source, settings, dtype)
    fresh = not check_journal(paths, claim, settings.overwrite)
    make_output_directory(paths.output.parent, "the directory of -o")  # read-only or full: before any model loads
    models = {"teacher": teacher, "student": student}
    with distributed.joined_process_group():
        rank, world = distributed.rank(), distributed.world_size()
        with rank_lock(paths, rank) as unsupported:
            if unsupported and distributed.is_main():
                reporter.message(f"{unsupported}: make sure no other `mta generate` writes {paths.output}")
            distributed.barrier()  # every rank has read the claim before rank 0 replaces it
            if distributed.is_main():
                claim_journal(paths, claim, fresh)
            distributed.barrier()
            done = finished_responses(paths, rows)
            resumed = {side: len(done[side]) for side in SIDES}
            if distributed.is_main() and any(resumed.values()):
                reporter.message(
                    f"resuming {paths.journal_dir}: {resumed['teacher']} teacher and {resumed['student']} "
                    f"student responses of {len(rows)} rows are already there"
                )
            distributed.barrier()  # every rank has read the journals before any of them grows
            journal_path = paths.journal(rank)
            with (
                disk_full_is_reported(journal_path),
                Journal(journal_path, inside=paths.output.parent) as journal,
            ):
                for side in SIDES:
                    pending = [row for row in rows if row.id not in done[side]]
                    mine = pending[rank::world]
                    if mine:
                        _generate_side(side, models[side], mine, settings, device, dtype, journal, reporter)
        distributed.barrier()  # every journal is complete and every lock released
        outcome = None
        if distributed.is_main():
            with disk_full_is_reported(paths.output):
                outcome = write_output(paths, rows, problems, source, resumed)
        outcome = distributed.broadcast_from_main(outcome)
    if problems and distributed.is_main():
        reporter.message(f"skipped {len(problems)} bad input row(s), e.g. {source.describe(problems[0])}")
    return outcome


# --------------------------------------------------------------------------- input and claim


def read_prompts(source: InputSource, limit: int | None = None) -> tuple[list[Example], list[RowProblem]]:
    """The usable rows of ``source`` with id below ``limit``, and the unusable ones (a row whose
    prompt is empty is one: a model cannot continue nothing)."""
    rows: list[Example] = []
    problems: list[RowProblem] = []
    for row in source.rows():
        if limit is not None and row.id >= limit:
            break
        if isinstance(row, Example) and not row.prompt:
            row = RowProblem(row.id, row.line, INVALID_TEXT, "the prompt is empty: there is nothing to answer")
        (rows if isinstance(row, Example) else problems).append(row)
    return rows, problems


def describe_run(
    teacher: str, student: str, source: InputSource, settings: PairSettings, dtype: torch.dtype
) -> dict[str, Any]:
    """What every response depends on besides its row: the claim a journal is kept under. The
    input is its sha256 (a JSONL file read as it is: the claim journals always had), or with its
    format and fields (:func:`mta.data.sources.input_identity`); a Hub dataset is also named by
    its id, commit and split."""

    def location(name: str) -> str:
        path = Path(name)
        return str(path.resolve()) if path.exists() else name

    summary = source.summary()
    record = source.record(summary)
    identity = input_identity(record)
    fingerprints = {name: checkpoint_fingerprint(name)[0] for name in dict.fromkeys((teacher, student))}  # hashed once
    return {
        "format": JOURNAL_FORMAT,
        "teacher": location(teacher),
        "teacher_fingerprint": fingerprints[teacher],
        "student": location(student),
        "student_fingerprint": fingerprints[student],
        "data": location(str(record["path"])),
        "data_sha256": summary.sha256,
        **({} if isinstance(identity, str) else {"data_input": identity}),
        **{key: record[key] for key in ("hub_id", "revision", "split", "subset") if key in record},
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": settings.top_k,
        "max_new_tokens": settings.max_new_tokens,
        "max_prompt_length": settings.max_prompt_length,
        "seed": settings.seed,
        "dtype": dtype_name(dtype),
        "sampling": settings.sampling().describe(settings.engine)
        + "; row key sampling_seed(seed, 'generate/<teacher|student>', 0, row id)",
        ENGINE_KEY: engine_name(settings.engine),  # responses of two engines never share a journal
    }


def check_output(paths: PairsPaths, overwrite: bool) -> None:
    output = paths.output
    if output.is_dir():
        raise MtaError(f"-o {output} is a directory; give the JSONL file to write, e.g. {output / 'pairs.jsonl'}")
    if output.exists() and not overwrite:
        raise MtaError(f"{output} already exists; pass --overwrite to replace it, or write to another -o")


def check_journal(paths: PairsPaths, claim: dict[str, Any], overwrite: bool) -> bool:
    """Whether an unfinished run of these settings left a journal to resume (False: none, or
    one of other settings that ``overwrite`` discards); refuse one of other settings."""
    if not paths.settings.exists():
        return False
    try:
        previous = json.loads(paths.settings.read_text(encoding="utf-8"))
        if not isinstance(previous, dict):
            raise ValueError("not an object")
    except ValueError as error:
        if overwrite:
            return False
        raise MtaError(
            f"{paths.settings} is not readable JSON ({error}), so what made the rows of {paths.journal_dir} "
            f"cannot be told; remove {paths.journal_dir} to start over, pass --overwrite, or write to another -o"
        ) from None
    changed = [
        f"{key}: {previous.get(key, UNRECORDED.get(key))!r} -> {value!r}"
        for key, value in claim.items()
        if key not in _LOCATIONS and previous.get(key, UNRECORDED.get(key)) != value
    ]
    if not changed:
        return True
    if overwrite:
        return False
    raise MtaError(
        f"{paths.journal_dir} holds the responses of an unfinished run with other settings "
        f"({'; '.join(changed)}); remove {paths.journal_dir} to start over (or pass --overwrite), "
        "write to another -o, or rerun with the settings it records to resume it"
    )


def claim_journal(paths: PairsPaths, claim: dict[str, Any], fresh: bool) -> None:
    """Rank 0: start an empty journal under ``claim`` (``fresh``) or keep the one there."""
    if not fresh and paths.settings.exists():
        return
    if paths.journal_dir.exists():
        shutil.rmtree(paths.journal_dir)
    paths.journal_dir.mkdir(parents=True)
    with disk_full_is_reported(paths.settings):
        atomic_write_json(paths.settings, claim)


@contextmanager
def rank_lock(paths: PairsPaths, rank: int) -> Iterator[str | None]:
    """``exclusive_lock`` on this rank's lock file (yields why locking is unsupported, or None);
    a second writer of the same output and rank is one ``MtaError`` naming it."""
    path = paths.lock(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive_lock(path, wait_s=0) as unsupported:
            yield unsupported
    except LockHeld as held:
        raise MtaError(
            f"another `mta generate` ({held.holder}) is writing {paths.output}; wait for it to "
            "finish, or write to another -o"
        ) from None


# --------------------------------------------------------------------------- journal


def finished_responses(paths: PairsPaths, rows: Sequence[Example]) -> dict[str, dict[int, dict]]:
    """``{side: {row id: journal record}}`` of the responses already in the journal (a record
    counts only for its own row: same id, same prompt; the first of duplicates wins)."""
    by_id = {row.id: row for row in rows}
    done: dict[str, dict[int, dict]] = {side: {} for side in SIDES}
    for journal in paths.journals():
        for record in read_jsonl_lenient(journal):
            side, row = record.get("side"), by_id.get(record.get("id"))
            if (
                side in done
                and row is not None
                and record.get("prompt") == row.prompt
                and isinstance(record.get("text"), str)
            ):
                done[side].setdefault(row.id, record)
    return done


@contextmanager
def _side_generator(
    checkpoint: str, settings: PairSettings, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[Generator, Any]]:
    """``(generator, tokenizer)`` of one model on the chosen engine; the model (or the vLLM
    worker) is released on exit."""
    if settings.engine == "vllm":
        from mta.models.tokenizers import load_tokenizer

        tokenizer = load_tokenizer(checkpoint)
        length = settings.max_prompt_length + settings.max_new_tokens
        with vllm_generation(
            checkpoint, tokenizer, settings.sampling(), dtype=dtype, device=device, max_model_len=length
        ) as generator:
            yield generator, tokenizer
        return
    with loaded_checkpoint(checkpoint, device, dtype) as (model, tokenizer):
        yield HFGenerator(model, tokenizer, settings.sampling(), batch_size=settings.batch_size), tokenizer
        del model  # so that leaving the context really frees the weights


def _generate_side(
    side: str,
    checkpoint: str,
    rows: Sequence[Example],
    settings: PairSettings,
    device: torch.device,
    dtype: torch.dtype,
    journal: Journal,
    reporter: Reporter,
) -> None:
    """``side``'s response to each of ``rows``, journalled batch by batch as they finish."""
    with _side_generator(checkpoint, settings, device, dtype) as (generator, tokenizer):
        prompts = [tokenizer(row.prompt, add_special_tokens=False)["input_ids"] for row in rows]
        # Evaluation's rule (mta.evaluation.runner): a longer prompt keeps its first tokens.
        truncated = [len(p) > settings.max_prompt_length for p in prompts]
        prompts = [p[: settings.max_prompt_length] for p in prompts]
        seeds = [pair_seed(settings.seed, side, row.id) for row in rows]
        reporter.start(f"{side} · {checkpoint}", len(rows), unit="rows")
        try:
            for completions in generator.generate(prompts, seeds):
                journal.append(
                    {
                        "id": rows[c.position].id,
                        "side": side,
                        "prompt": rows[c.position].prompt,
                        "text": completion_text(tokenizer, c.token_ids),
                        "new_tokens": c.num_tokens,
                        "finished": c.finished,
                        "prompt_truncated": truncated[c.position],
                    }
                    for c in completions
                )
                reporter.advance(len(completions), tokens=sum(c.num_tokens for c in completions))
        finally:
            reporter.stop()
        del generator


def write_output(
    paths: PairsPaths,
    rows: Sequence[Example],
    problems: Sequence[RowProblem],
    source: InputSource,
    resumed: dict[str, int],
) -> PairsOutcome:
    """Rank 0: the pairs in input order, written atomically; then the journal is removed."""
    done = finished_responses(paths, rows)
    missing = {side: [row.id for row in rows if row.id not in done[side]] for side in SIDES}
    if any(missing.values()):
        raise RuntimeError(f"rows without a response after generation: {missing}")
    pairs = [
        {"id": row.id, "prompt": row.prompt, **{FIELDS[side]: done[side][row.id]["text"] for side in SIDES}}
        for row in rows
    ]
    atomic_write_jsonl(paths.output, pairs)
    shutil.rmtree(paths.journal_dir, ignore_errors=True)
    return PairsOutcome(
        path=paths.output,
        rows=len(pairs),
        skipped=len(problems),
        skipped_examples=[source.describe(p) for p in problems[:MAX_SKIPPED_EXAMPLES]],
        resumed=dict(resumed),
        prompts_truncated={s: sum(bool(r.get("prompt_truncated")) for r in done[s].values()) for s in SIDES},
        unfinished={s: sum(not r.get("finished", True) for r in done[s].values()) for s in SIDES},
    )


__all__ = ["PairSettings", "PairsOutcome", "PairsPaths", "describe_run", "generate_pairs", "pair_seed", "read_prompts"]
