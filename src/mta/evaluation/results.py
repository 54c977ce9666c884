"""From predictions files to the numbers of results.json.

Per set: the mean over rows of each seed's file, then the mean and population std (ddof 0) over
seeds. Per checkpoint: ``avg4`` (Dolly, SelfInst, Vicuna, S-NI: the published figure, only when
all four ran), ``avg`` over every set run, and ``avg_ood`` over every set but Dolly.
"""

from __future__ import annotations

import statistics
from typing import Mapping, Sequence

from mta.evaluation.datasets import BENCHMARKS


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


def averages(set_means: Mapping[str, float]) -> dict:
    """avg4, avg and avg_ood of one checkpoint from its per-set mean ROUGE-L."""
    avg4_sets = [name for name, b in BENCHMARKS.items() if b.in_avg4]
    ood = [v for name, v in set_means.items() if not BENCHMARKS[name].in_distribution]
    return {
        "avg4": statistics.fmean(set_means[n] for n in avg4_sets) if all(n in set_means for n in avg4_sets) else None,
        "avg": statistics.fmean(set_means.values()) if set_means else None,
        "avg_ood": statistics.fmean(ood) if ood else None,
    }
