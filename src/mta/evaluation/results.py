"""From predictions files to the numbers of results.json.

Per set: the mean over rows of each seed's file, then the mean and population std (ddof 0) over
seeds. Per checkpoint: ``avg4`` (Dolly, SelfInst, Vicuna, S-NI: the published figure, only when
all four ran), ``avg`` over every set run, and ``avg_ood`` over every set but Dolly (and its
other splits). ``differences``: each checkpoint against the first, paired by seed
(``differences_to_first``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from mta.evaluation.datasets import BENCHMARKS, Benchmark, EvalSet
from mta.evaluation.layout import FINGERPRINT, CheckpointPaths
from mta.evaluation.settings import EvalSettings
from mta.files import read_jsonl_lenient
from mta.scoring import has_rouge_tokens
from mta.versions import package_versions


def seed_statistics(records: Sequence[dict]) -> dict:
    """Scores of one predictions file (one line per row)."""
    n = len(records)
    return {
        "rougeL": sum(r["rougeL"] for r in records) / n,
        "exact_match": sum(r["exact_match"] for r in records) / n,
        "empty_predictions": sum(1 for r in records if not r["prediction"]),
        "unfinished": sum(1 for r in records if not r["finished"]),
        "mean_new_tokens": sum(r["new_tokens"] for r in records) / n,
    }


def mean_std(values: Sequence[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values)}


def set_summary(per_seed: Mapping[int, dict], prompts_truncated: int, rows: int) -> dict:
    """One checkpoint on one set over its seeds."""
    seeds = sorted(per_seed)
    return {
        "rows": rows,
        "prompts_truncated": prompts_truncated,
        "rougeL": {
            **mean_std([per_seed[s]["rougeL"] for s in seeds]),
            "per_seed": {str(s): per_seed[s]["rougeL"] for s in seeds},
        },
        "exact_match": {
            **mean_std([per_seed[s]["exact_match"] for s in seeds]),
            "per_seed": {str(s): per_seed[s]["exact_match"] for s in seeds},
        },
        "per_seed": {str(s): per_seed[s] for s in seeds},
    }


def averages(set_means: Mapping[str, float], benchmarks: Mapping[str, Benchmark] | None = None) -> dict:
    """avg4, avg and avg_ood of one checkpoint from its per-set mean ROUGE-L (or any per-set
    value: a seed's scores, a difference). ``benchmarks``: each set's ``Benchmark`` where it is
    not a built-in one (``dolly-dev``, a JSONL file: in avg, never in avg4)."""

    def benchmark(name: str) -> Benchmark:
        return (benchmarks or {}).get(name) or BENCHMARKS[name]

    avg4_sets = [name for name, b in BENCHMARKS.items() if b.in_avg4]
    ood = [v for name, v in set_means.items() if not benchmark(name).in_distribution]
    return {
        "avg4": statistics.fmean(set_means[n] for n in avg4_sets) if all(n in set_means for n in avg4_sets) else None,
        "avg": statistics.fmean(set_means.values()) if set_means else None,
        "avg_ood": statistics.fmean(ood) if ood else None,
    }


DIFFERENCE_SPREAD = (
    "each checkpoint minus the first, paired by seed: the mean over seeds of the per-seed differences "
    "(= the difference of the means) ± their population std (ddof 0) over seeds"
)


def differences_to_first(runs: Mapping[str, dict], benchmarks: Mapping[str, Benchmark] | None = None) -> dict:
    """Each checkpoint after the first against the first (``reference``), ROUGE-L paired by seed.

    Per set: the per-seed differences ``d_s = score_s(checkpoint) - score_s(first)``, their mean
    and population std over seeds; ``avg4`` / ``avg`` / ``avg_ood`` the same on each seed's
    average over the sets (None where the average is). With one seed the std is 0.
    """
    labels = list(runs)
    if len(labels) < 2:
        return {"reference": labels[0] if labels else None, "spread": DIFFERENCE_SPREAD, "checkpoints": {}}
    first = runs[labels[0]]
    reference = _per_seed_scores(first, benchmarks)
    found = {}
    for label in labels[1:]:
        scores = _per_seed_scores(runs[label], benchmarks)
        found[label] = {
            key: _paired(scores[key], reference[key]) if key in scores and key in reference else None
            for key in (*first["sets"], "avg4", "avg", "avg_ood")
        }
    return {"reference": labels[0], "spread": DIFFERENCE_SPREAD, "checkpoints": found}


def _per_seed_scores(run: dict, benchmarks: Mapping[str, Benchmark] | None) -> dict[str, dict[str, float]]:
    """``{set or average: {seed: ROUGE-L}}`` of one checkpoint; an average only where every seed has it."""
    sets = {name: dict(summary["rougeL"]["per_seed"]) for name, summary in run["sets"].items()}
    seeds = sorted(set.intersection(*(set(per_seed) for per_seed in sets.values())), key=int) if sets else []
    by_seed = {seed: averages({name: per_seed[seed] for name, per_seed in sets.items()}, benchmarks) for seed in seeds}
    scores = dict(sets)
    for key in ("avg4", "avg", "avg_ood"):
        if seeds and all(by_seed[seed][key] is not None for seed in seeds):
            scores[key] = {seed: by_seed[seed][key] for seed in seeds}
    return scores


def _paired(scores: Mapping[str, float], reference: Mapping[str, float]) -> dict | None:
    seeds = [seed for seed in scores if seed in reference]
    if not seeds:
        return None
    per_seed = {seed: scores[seed] - reference[seed] for seed in seeds}
    return {**mean_std(list(per_seed.values())), "per_seed": per_seed}


def checkpoint_results(
    checkpoint: str, paths: CheckpointPaths, eval_sets: Sequence[EvalSet], settings: EvalSettings
) -> dict:
    """One checkpoint's entry of results.json: every set over its seeds, averages, perplexity."""
    sets = {}
    for eval_set in eval_sets:
        records = {seed: read_jsonl_lenient(paths.predictions(eval_set.name, seed)) for seed in settings.seeds}
        # Truncation depends on the prompt alone: every seed's file counts the same rows.
        truncated = sum(1 for r in records[settings.seeds[0]] if r["prompt_truncated"])
        per_seed = {seed: seed_statistics(rows) for seed, rows in records.items()}
        sets[eval_set.name] = set_summary(per_seed, truncated, len(eval_set.rows))
    return {
        "checkpoint": checkpoint,
        # What the predictions were generated from (generation.json): the weights' fingerprint.
        "fingerprint": (paths.stored_manifest() or {}).get(FINGERPRINT),
        "sets": sets,
        **averages({name: s["rougeL"]["mean"] for name, s in sets.items()}, {s.name: s.benchmark for s in eval_sets}),
        "perplexity": paths.stored_perplexity() if settings.perplexity else None,
    }


def protocol(settings: EvalSettings) -> dict:
    """How the numbers were made, in words, for results.json."""
    return {
        "metric": "rouge_score RougeScorer(['rougeL'], use_stemmer=True) F x 100, max over references, mean over rows",
        "exact_match": "SQuAD normalisation without article removal, max over references",
        "sampling": settings.sampling_description(),
        "std": "population (ddof 0) over seeds",
        "avg4": "mean of Dolly, SelfInst, Vicuna, S-NI",
        "avg_ood": "mean of every set but Dolly",
        "differences": DIFFERENCE_SPREAD,
    }


def set_description(eval_set: EvalSet) -> dict:
    """A set's entry of results.json: its file, its rows, and the rows ROUGE-L cannot score."""
    return {
        "title": eval_set.benchmark.title,
        "in_distribution": eval_set.benchmark.in_distribution,
        "path": str(eval_set.path),
        **(eval_set.origin or {}),  # a Hub set: hub_id, revision (the commit), split, subset
        "rows": len(eval_set.rows),
        "rows_in_file": eval_set.rows_in_file,
        "references_without_rouge_tokens": sum(
            1 for row in eval_set.rows if not any(has_rouge_tokens(r) for r in row.references)
        ),
    }


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
    from mta.generation.vllm_engine import engine_name

    runs = {
        label: checkpoint_results(checkpoint, CheckpointPaths.of(out_dir, label), eval_sets, settings)
        for checkpoint, label in zip(checkpoints, labels, strict=True)
    }
    return {
        "protocol": protocol(settings),
        "settings": {
            **settings.model_dump(),
            "engine": engine_name(settings.engine),  # hf, or vLLM's distribution and version
            "dtype": dtype,
            "data_dir": str(data_dir),
        },
        "sets": {s.name: set_description(s) for s in eval_sets},
        "checkpoints": runs,
        "differences": differences_to_first(runs, {s.name: s.benchmark for s in eval_sets}),
        "versions": package_versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
