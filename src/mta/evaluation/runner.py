"""The whole evaluation: checkpoints x sets x seeds, resumable, shardable under torchrun.

Output layout under ``out_dir``::

    predictions/<label>/generation.json          the settings the predictions were made with
    predictions/<label>/<set>/seed-<s>.jsonl     one line per row: prompt, prediction, references, scores
    predictions/<label>/perplexity.json          teacher-forced perplexity (with --perplexity)
    results.json, results.md

Resume works per row: finished rows go to a journal (``seed-<s>.rank<r>.journal.jsonl``) as
each batch ends, and the complete file replaces the journals atomically. Because each row's
sampling noise is keyed by (seed, set, row), a resumed or re-sharded run draws the same noise
as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from mta.errors import MtaError
from mta.versions import package_versions
from mta.evaluation.models_under_test import (
    check_checkpoint,
    checkpoint_names,
    loaded_checkpoint,
)
from mta.distributed import resolve_device
from mta.dtypes import dtype_name, resolve_dtype
from mta.evaluation.datasets import (
    DEFAULT_BENCHMARKS,
    EvalRow,
    EvalSet,
    default_data_dir,
    load_eval_set,
    load_rows,
    resolve_benchmarks,
    resolve_split_file,
)
from mta import distributed
from mta.files import Journal, atomic_write_json, atomic_write_jsonl, atomic_write_text, read_jsonl_lenient
from mta.generation.generator import Generator, HFGenerator
from mta.evaluation.perplexity import encode_for_scoring, perplexity_result, response_nll
from mta.evaluation.report import markdown_table
from mta.evaluation.results import averages, seed_statistics, set_summary
from mta.generation.sampling import row_seed
from mta.scoring import exact_match, has_rouge_tokens, rouge_l

log = logging.getLogger(__name__)

SAMPLING = "per-row Gumbel-max sampling: top_k 0, top_p 1.0, temperature 1.0"


class EvalSettings(BaseModel):
    """What `mta evaluate` does; the defaults are the MiniLLM protocol (METHOD section 6)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    benchmarks: list[str] | None = Field(None, description="None: every default set present")
    seeds: list[int] = Field(default_factory=lambda: [10, 20, 30, 40, 50], min_length=1)
    max_prompt_length: int = Field(256, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    batch_size: int = Field(16, ge=1)
    limit: int | None = Field(None, ge=1, description="first N rows of every set")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    device: str = "auto"
    perplexity: str | None = Field(None, description="set for teacher-forced perplexity, e.g. dolly-dev")
    perplexity_limit: int | None = Field(None, ge=1)
    perplexity_batch_size: int = Field(8, ge=1)

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError("seeds must be distinct")
        return seeds


class Progress(Protocol):
    """What the runner reports while it works (the CLI draws it as a rich progress bar)."""

    def start(self, description: str, total_rows: int) -> None: ...

    def advance(self, rows: int, tokens: int) -> None: ...

    def stop(self) -> None: ...


class _Silent:
    def start(self, description: str, total_rows: int) -> None:
        pass

    def advance(self, rows: int, tokens: int) -> None:
        pass

    def stop(self) -> None:
        pass


@dataclass(frozen=True)
class CheckpointPaths:
    root: Path

    @property
    def manifest(self) -> Path:
        return self.root / "generation.json"

    @property
    def perplexity(self) -> Path:
        return self.root / "perplexity.json"

    def predictions(self, set_name: str, seed: int) -> Path:
        return self.root / set_name / f"seed-{seed}.jsonl"

    def journal(self, set_name: str, seed: int, rank: int) -> Path:
        return self.root / set_name / f"seed-{seed}.rank{rank}.journal.jsonl"

    def journals(self, set_name: str, seed: int) -> list[Path]:
        return sorted((self.root / set_name).glob(f"seed-{seed}.rank*.journal.jsonl"))


def evaluate_checkpoints(
    checkpoints: Sequence[str | Path],
    names: Sequence[str] | None = None,
    data_dir: str | Path | None = None,
    out_dir: str | Path = "eval",
    settings: EvalSettings | None = None,
    progress: Progress | None = None,
) -> dict:
    """Generate, score and compare ``checkpoints``; returns what results.json holds.

    Every input is checked before the first model loads. One model is in memory at a time.
    Under torchrun every rank must call this with the same arguments; rank 0 writes results.
    """
    settings = settings or EvalSettings()
    progress = progress or _Silent()
    checkpoints = [str(c) for c in checkpoints]
    if not checkpoints:
        raise MtaError("give at least one checkpoint to evaluate")
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    out_dir = Path(out_dir)
    labels = checkpoint_names(checkpoints, names)
    for checkpoint in checkpoints:
        check_checkpoint(checkpoint)
    eval_sets = [load_eval_set(b, p, settings.limit) for b, p in resolve_benchmarks(data_dir, settings.benchmarks)]
    perplexity = None
    if settings.perplexity:
        path = resolve_split_file(data_dir, settings.perplexity)
        perplexity = PerplexitySet(settings.perplexity, path, load_rows(path, limit=settings.perplexity_limit)[0])

    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    with distributed.joined_process_group():
        for checkpoint, label in zip(checkpoints, labels):
            paths = CheckpointPaths(out_dir / "predictions" / label)
            _claim_directory(paths, checkpoint, settings, dtype)
            _evaluate_checkpoint(checkpoint, label, paths, eval_sets, perplexity, settings, device, dtype, progress)
        distributed.barrier()
        results = collect_results(out_dir, checkpoints, labels, eval_sets, settings, data_dir, dtype_name(dtype))
        if distributed.is_main():
            _log_truncated_prompts(results, settings.max_prompt_length)
            atomic_write_json(out_dir / "results.json", results)
            atomic_write_text(out_dir / "results.md", markdown_table(results))
        distributed.barrier()
        return results


def _evaluate_checkpoint(
    checkpoint: str,
    label: str,
    paths: CheckpointPaths,
    eval_sets: Sequence[EvalSet],
    perplexity: PerplexitySet | None,
    settings: EvalSettings,
    device: torch.device,
    dtype: torch.dtype,
    progress: Progress,
) -> None:
    """Generate what this checkpoint's directory lacks; load the model only when something does."""
    todo = [(s, seed) for s in eval_sets for seed in settings.seeds if not _is_complete(paths, s, seed)]
    wants_perplexity = perplexity is not None and not _perplexity_is_current(paths, perplexity, settings)
    if not todo and not wants_perplexity:
        log.info("%s: every predictions file is complete, nothing to generate", label)
        return
    with loaded_checkpoint(checkpoint, device, dtype) as (model, tokenizer):
        generator = HFGenerator(model, tokenizer, batch_size=settings.batch_size, max_new_tokens=settings.max_new_tokens)
        for eval_set, seed in todo:
            _generate_set(generator, tokenizer, eval_set, seed, paths, settings, progress, label)
        if wants_perplexity:
            _write_perplexity(model, tokenizer, perplexity, paths, settings, progress, label)
        del model, generator  # so that leaving the context really frees the weights


def _log_truncated_prompts(results: dict, limit: int) -> None:
    for label, run in results["checkpoints"].items():
        for name, summary in run["sets"].items():
            if summary["prompts_truncated"]:
                log.warning(
                    "%s: %d of %d %s prompts exceed %d tokens and keep their first %d, as the protocol does",
                    label, summary["prompts_truncated"], summary["rows"], name, limit, limit,
                )


def _claim_directory(paths: CheckpointPaths, checkpoint: str, settings: EvalSettings, dtype: torch.dtype) -> None:
    """Record what generated this directory's predictions; refuse to mix in other settings."""
    source = Path(checkpoint)
    manifest = {
        "checkpoint": str(source.resolve()) if source.exists() else checkpoint,
        "max_prompt_length": settings.max_prompt_length,
        "max_new_tokens": settings.max_new_tokens,
        "dtype": dtype_name(dtype),
        "sampling": SAMPLING,
    }
    if paths.manifest.exists():
        previous = json.loads(paths.manifest.read_text(encoding="utf-8"))
        changed = [f"{k}: {previous.get(k)!r} -> {v!r}" for k, v in manifest.items() if previous.get(k) != v]
        if changed:
            raise MtaError(
                f"{paths.root} holds predictions made with other settings ({'; '.join(changed)}). "
                "Write to another -o, give this checkpoint another --names label, or delete that directory."
            )
        return
    distributed.barrier()  # every rank has read the absent manifest before rank 0 writes it
    if distributed.is_main():
        atomic_write_json(paths.manifest, manifest)
    distributed.barrier()


def _matches(record: dict, row: EvalRow) -> bool:
    return record.get("index") == row.index and record.get("prompt") == row.prompt


def _is_complete(paths: CheckpointPaths, eval_set: EvalSet, seed: int) -> bool:
    records = read_jsonl_lenient(paths.predictions(eval_set.name, seed))
    return len(records) == len(eval_set.rows) and all(
        _matches(r, row) and r.get("references") == list(row.references) for r, row in zip(records, eval_set.rows)
    )


def _finished_rows(paths: CheckpointPaths, eval_set: EvalSet, seed: int) -> dict[int, dict]:
    """Rows already generated for this set and seed: from an earlier predictions file (e.g. a
    run with a smaller --limit) and from the journals of an interrupted run."""
    by_index = {row.index: row for row in eval_set.rows}
    done: dict[int, dict] = {}
    sources = [paths.predictions(eval_set.name, seed), *paths.journals(eval_set.name, seed)]
    for source in sources:
        for record in read_jsonl_lenient(source):
            row = by_index.get(record.get("index"))
            if row is not None and _matches(record, row):
                done[row.index] = record
    return done


def _generate_set(
    generator: Generator,
    tokenizer,
    eval_set: EvalSet,
    seed: int,
    paths: CheckpointPaths,
    settings: EvalSettings,
    progress: Progress,
    label: str,
) -> None:
    done = _finished_rows(paths, eval_set, seed)
    pending = [row for row in eval_set.rows if row.index not in done]
    distributed.barrier()  # every rank splits the same pending list before any journal grows
    mine = pending[distributed.rank() :: distributed.world_size()]
    prompts = [tokenizer(row.prompt, add_special_tokens=False)["input_ids"] for row in mine]
    truncated = [len(p) > settings.max_prompt_length for p in prompts]
    prompts = [p[: settings.max_prompt_length] for p in prompts]
    seeds = [row_seed(seed, eval_set.name, row.index) for row in mine]
    if mine:
        progress.start(f"{label} · {eval_set.name} · seed {seed}", len(mine))
        with Journal(paths.journal(eval_set.name, seed, distributed.rank())) as journal:
            for completions in generator.generate(prompts, seeds):
                journal.append(
                    {
                        "index": mine[c.position].index,
                        "prompt": mine[c.position].prompt,
                        "prediction": tokenizer.decode(c.token_ids, skip_special_tokens=True).strip(),
                        "prompt_truncated": truncated[c.position],
                        "new_tokens": c.num_tokens,
                        "finished": c.finished,
                    }
                    for c in completions
                )
                progress.advance(len(completions), sum(c.num_tokens for c in completions))
        progress.stop()
    distributed.barrier()
    if distributed.is_main():
        _write_predictions(paths, eval_set, seed)
    distributed.barrier()


def _write_predictions(paths: CheckpointPaths, eval_set: EvalSet, seed: int) -> None:
    """Merge what was generated into the scored predictions file, then drop the journals."""
    done = _finished_rows(paths, eval_set, seed)
    missing = [row.index for row in eval_set.rows if row.index not in done]
    if missing:
        raise RuntimeError(f"{eval_set.name} seed {seed}: rows {missing[:5]} were not generated")
    records = []
    for row in eval_set.rows:
        record = done[row.index]
        records.append(
            {
                "index": row.index,
                "prompt": row.prompt,
                "prediction": record["prediction"],
                "references": list(row.references),
                "rougeL": rouge_l(record["prediction"], row.references),
                "exact_match": exact_match(record["prediction"], row.references),
                "prompt_truncated": record["prompt_truncated"],
                "new_tokens": record["new_tokens"],
                "finished": record["finished"],
            }
        )
    atomic_write_jsonl(paths.predictions(eval_set.name, seed), records)
    for journal in paths.journals(eval_set.name, seed):
        journal.unlink(missing_ok=True)


@dataclass(frozen=True)
class PerplexitySet:
    spec: str  # as the user wrote it, e.g. dolly-dev
    path: Path
    rows: list[EvalRow]


def _perplexity_key(perplexity: PerplexitySet, settings: EvalSettings) -> dict:
    """What a stored perplexity depends on: reuse it only when all of this matches."""
    return {
        "set": perplexity.spec,
        "path": str(perplexity.path.resolve()),
        "rows": len(perplexity.rows),
        "max_prompt_length": settings.max_prompt_length,
        "max_response_length": settings.max_new_tokens,
    }


def _perplexity_is_current(paths: CheckpointPaths, perplexity: PerplexitySet, settings: EvalSettings) -> bool:
    if not paths.perplexity.exists():
        return False
    stored = json.loads(paths.perplexity.read_text(encoding="utf-8"))
    return all(stored.get(k) == v for k, v in _perplexity_key(perplexity, settings).items())


def _write_perplexity(model, tokenizer, perplexity: PerplexitySet, paths, settings, progress, label) -> None:
    """Each rank scores its share; the sums are reduced and rank 0 writes perplexity.json."""
    mine = perplexity.rows[distributed.rank() :: distributed.world_size()]
    encoded = [
        encode_for_scoring(
            tokenizer, row.prompt, row.references[0],
            max_prompt_length=settings.max_prompt_length, max_response_length=settings.max_new_tokens,
        )
        for row in mine
    ]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    progress.start(f"{label} · perplexity {perplexity.spec}", len(mine))
    total, tokens = response_nll(
        model, [e[0] for e in encoded], pad_id, settings.perplexity_batch_size,
        on_batch=lambda n: progress.advance(n, 0),
    )
    progress.stop()
    total, tokens, prompts_cut, responses_cut = distributed.sum_over_ranks(
        [total, tokens, sum(e[1] for e in encoded), sum(e[2] for e in encoded)]
    )
    result = perplexity_result(total, int(tokens), len(perplexity.rows), int(prompts_cut), int(responses_cut))
    if distributed.is_main():
        atomic_write_json(paths.perplexity, {**_perplexity_key(perplexity, settings), **result.to_dict()})
    distributed.barrier()


def collect_results(
    out_dir: Path,
    checkpoints: Sequence[str],
    labels: Sequence[str],
    eval_sets: Sequence[EvalSet],
    settings: EvalSettings,
    data_dir: Path,
    dtype: str,
) -> dict:
    """results.json, computed from the predictions files alone."""
    runs = {}
    for checkpoint, label in zip(checkpoints, labels):
        paths = CheckpointPaths(out_dir / "predictions" / label)
        set_results = {}
        for eval_set in eval_sets:
            per_seed, truncated = {}, 0
            for seed in settings.seeds:
                records = read_jsonl_lenient(paths.predictions(eval_set.name, seed))
                per_seed[seed] = seed_statistics(records)
                truncated = sum(1 for r in records if r["prompt_truncated"])
            set_results[eval_set.name] = set_summary(per_seed, truncated, len(eval_set.rows))
        perplexity = None
        if settings.perplexity and paths.perplexity.exists():
            perplexity = json.loads(paths.perplexity.read_text(encoding="utf-8"))
        runs[label] = {
            "checkpoint": checkpoint,
            "sets": set_results,
            **averages({name: s["rougeL"]["mean"] for name, s in set_results.items()}),
            "perplexity": perplexity,
        }
    return {
        "protocol": {
            "metric": "rouge_score RougeScorer(['rougeL'], use_stemmer=True) F x 100, max over references, mean over rows",
            "exact_match": "SQuAD normalisation without article removal, max over references",
            "sampling": SAMPLING,
            "std": "population (ddof 0) over seeds",
            "avg4": "mean of Dolly, SelfInst, Vicuna, S-NI",
            "avg_ood": "mean of every set but Dolly",
        },
        "settings": {**settings.model_dump(), "dtype": dtype, "data_dir": str(data_dir)},
        "sets": {
            s.name: {
                "path": str(s.path),
                "rows": len(s.rows),
                "rows_in_file": s.rows_in_file,
                "references_without_rouge_tokens": sum(
                    1 for row in s.rows if not any(has_rouge_tokens(r) for r in row.references)
                ),
            }
            for s in eval_sets
        },
        "checkpoints": runs,
        "versions": package_versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


__all__ = ["EvalSettings", "Progress", "evaluate_checkpoints", "collect_results", "DEFAULT_BENCHMARKS"]
