"""Predictions files: the journal record of a generated row, and the scored file made from them.

While a set runs, each rank appends one record per finished row to its journal (``mta.files.
Journal``); when the set is done, rank 0 merges the journals (and rows of an earlier predictions
file, e.g. from a run with a smaller --limit) into ``seed-<s>.jsonl`` with the scores, and drops
the journals. A record is reused only for the same row: same index, same prompt.
"""

from __future__ import annotations

from mta.evaluation.datasets import EvalRow, EvalSet
from mta.evaluation.layout import CheckpointPaths
from mta.files import atomic_write_jsonl, read_jsonl_lenient
from mta.generation.generator import Completion
from mta.scoring import exact_match, rouge_l


def journal_record(row: EvalRow, prediction: str, completion: Completion, prompt_truncated: bool) -> dict:
    """What a journal keeps of one generated row (everything but the scores)."""
    return {
        "index": row.index,
        "prompt": row.prompt,
        "prediction": prediction,
        "prompt_truncated": prompt_truncated,
        "new_tokens": completion.num_tokens,
        "finished": completion.finished,
    }


def scored_record(row: EvalRow, generated: dict) -> dict:
    """One line of a predictions file: the journal record, the references and the scores."""
    return {
        "index": row.index,
        "prompt": row.prompt,
        "prediction": generated["prediction"],
        "references": list(row.references),
        "rougeL": rouge_l(generated["prediction"], row.references),
        "exact_match": exact_match(generated["prediction"], row.references),
        "prompt_truncated": generated["prompt_truncated"],
        "new_tokens": generated["new_tokens"],
        "finished": generated["finished"],
    }


def _matches(record: dict, row: EvalRow) -> bool:
    return record.get("index") == row.index and record.get("prompt") == row.prompt


def is_complete(paths: CheckpointPaths, eval_set: EvalSet, seed: int) -> bool:
    """Whether the predictions file holds exactly this set's rows, with their references."""
    records = read_jsonl_lenient(paths.predictions(eval_set.name, seed))
    return len(records) == len(eval_set.rows) and all(
        _matches(r, row) and r.get("references") == list(row.references)
        for r, row in zip(records, eval_set.rows, strict=True)
    )


def finished_rows(paths: CheckpointPaths, eval_set: EvalSet, seed: int) -> dict[int, dict]:
    """Records of the rows already generated for this set and seed, by row index: from an
    earlier predictions file and from the journals of an interrupted run."""
    by_index = {row.index: row for row in eval_set.rows}
    done: dict[int, dict] = {}
    for source in [paths.predictions(eval_set.name, seed), *paths.journals(eval_set.name, seed)]:
        for record in read_jsonl_lenient(source):
            row = by_index.get(record.get("index"))
            if row is not None and _matches(record, row):
                done[row.index] = record
    return done


def write_predictions(paths: CheckpointPaths, eval_set: EvalSet, seed: int) -> None:
    """Merge what was generated into the scored predictions file, then drop the journals."""
    done = finished_rows(paths, eval_set, seed)
    missing = [row.index for row in eval_set.rows if row.index not in done]
    if missing:
        raise RuntimeError(f"{eval_set.name} seed {seed}: rows {missing[:5]} were not generated")
    records = [scored_record(row, done[row.index]) for row in eval_set.rows]
    atomic_write_jsonl(paths.predictions(eval_set.name, seed), records)
    for journal in paths.journals(eval_set.name, seed):
        journal.unlink(missing_ok=True)
