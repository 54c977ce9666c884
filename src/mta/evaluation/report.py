"""The comparison table: checkpoints as rows, sets as columns, ``mean ± std`` ROUGE-L (the
mean alone from a single seed).

``table_rows`` feeds both ``results.md`` (here) and the terminal table of ``mta evaluate``, so
they never disagree.
"""

from __future__ import annotations

from mta.evaluation.datasets import BENCHMARKS
from mta.tables import markdown_table


def table_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    """Header and body cells of the comparison table."""
    set_names = list(results["sets"])
    perplexity = results["settings"].get("perplexity")
    header = ["checkpoint", *(BENCHMARKS[s].title for s in set_names), "avg4", "avg", "avg w/o Dolly"]
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


def _score(score: dict) -> str:
    """``mean ± std`` over seeds; the mean alone from one seed, which has no spread to show."""
    if len(score.get("per_seed", {})) == 1:
        return f"{score['mean']:.2f}"
    return f"{score['mean']:.2f} ± {score['std']:.2f}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def results_markdown(results: dict) -> str:
    """results.md: a title, what the numbers are, and the table."""
    seeds = results["settings"]["seeds"]
    over = (
        f"one seed ({seeds[0]}), so no spread" if len(seeds) == 1
        else "mean ± population std over seeds " + ", ".join(str(s) for s in seeds)
    )
    note = f"ROUGE-L (F x 100, max over references), {over}; avg4 = Dolly, SelfInst, Vicuna, S-NI."
    return "\n".join(["# Evaluation", "", note, "", *markdown_table(*table_rows(results)), ""])
