"""The comparison table: checkpoints as rows, sets as columns, ``mean ± std`` ROUGE-L (the
mean alone from a single seed); then, with two checkpoints or more, each one's difference to the
first, paired by seed: ``+1.24 ± 0.31`` is the mean over seeds of the per-seed differences and
their population std over seeds (``results.differences_to_first``).

``table_rows`` feeds both ``results.md`` (here) and the terminal table of ``mta evaluate``, so
they never disagree.
"""

from __future__ import annotations

from mta.evaluation.datasets import BENCHMARKS, Benchmark
from mta.evaluation.results import differences_to_first
from mta.tables import markdown_table


def _title(results: dict, name: str) -> str:
    """A set's column header: recorded in results.json (built-in sets: their published title)."""
    recorded = results.get("sets", {}).get(name, {}).get("title")
    return recorded or (BENCHMARKS[name].title if name in BENCHMARKS else name)


def table_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    """Header and body cells of the comparison table."""
    set_names = list(results["sets"])
    perplexity = results["settings"].get("perplexity")
    header = ["checkpoint", *(_title(results, s) for s in set_names), "avg4", "avg", "avg w/o Dolly"]
    if perplexity:
        header.append(f"ppl ({perplexity})")
    body = []
    for label, run in results["checkpoints"].items():
        cells = [label]
        for name in set_names:
            cells.append(_score(run["sets"][name]["rougeL"]))
        cells += [_number(run[key]) for key in ("avg4", "avg", "avg_ood")]
        if perplexity:
            cells.append(_number(run["perplexity"]["perplexity"]) if run.get("perplexity") else "-")
        body.append(cells)
    return header, body


def differences(results: dict) -> dict:
    """results.json's ``differences``, or computed from its checkpoints (an older results.json)."""
    if results.get("differences") is not None:
        return results["differences"]
    benchmarks = {
        name: Benchmark(name, entry.get("title", name), in_distribution=entry.get("in_distribution", False))
        for name, entry in results.get("sets", {}).items()
        if name not in BENCHMARKS
    }
    return differences_to_first(results["checkpoints"], benchmarks)


def difference_rows(results: dict) -> tuple[list[str], list[list[str]]] | None:
    """Header and body of the table of each checkpoint minus the first (None with one checkpoint)."""
    found = differences(results)
    if not found["checkpoints"]:
        return None
    set_names = list(results["sets"])
    header = ["checkpoint", *(_title(results, s) for s in set_names), "avg4", "avg", "avg w/o Dolly"]
    body = [
        [label, *(_difference(cells.get(key)) for key in (*set_names, "avg4", "avg", "avg_ood"))]
        for label, cells in found["checkpoints"].items()
    ]
    return header, body


def _score(score: dict) -> str:
    """``mean ± std`` over seeds; the mean alone from one seed, which has no spread to show."""
    if len(score.get("per_seed", {})) == 1:
        return f"{score['mean']:.2f}"
    return f"{score['mean']:.2f} ± {score['std']:.2f}"


def _difference(difference: dict | None) -> str:
    """``+1.24 ± 0.31``: the signed mean difference ± the std over seeds (alone from one seed)."""
    if difference is None:
        return "-"
    if len(difference.get("per_seed", {})) == 1:
        return f"{difference['mean']:+.2f}"
    return f"{difference['mean']:+.2f} ± {difference['std']:.2f}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def results_markdown(results: dict) -> str:
    """results.md: a title, what the numbers are, the table, and the differences to the first."""
    seeds = results["settings"]["seeds"]
    over = (
        f"one seed ({seeds[0]}), so no spread"
        if len(seeds) == 1
        else "mean ± population std over seeds " + ", ".join(str(s) for s in seeds)
    )
    note = f"ROUGE-L (F x 100, max over references), {over}; avg4 = Dolly, SelfInst, Vicuna, S-NI."
    lines = ["# Evaluation", "", note, "", *markdown_table(*table_rows(results)), ""]
    rows = difference_rows(results)
    if rows is not None:
        reference = differences(results)["reference"]
        spread = (
            "one seed, so no spread"
            if len(seeds) == 1
            else "the mean over seeds of the per-seed differences (paired by seed; = the difference of the means) "
            "± their population std over seeds"
        )
        lines += [
            f"## Difference to {reference}",
            "",
            f"Each checkpoint's ROUGE-L minus {reference}'s: {spread}. The averages are differenced per seed too.",
            "",
            *markdown_table(*rows),
            "",
        ]
    return "\n".join(lines)
