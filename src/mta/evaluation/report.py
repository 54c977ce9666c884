"""The comparison table: checkpoints as rows, sets as columns, ``mean ± std`` ROUGE-L.

One list of rows feeds both ``results.md`` and the rich table in the terminal, so they never
disagree.
"""

from __future__ import annotations

from rich.table import Table

from mta.evaluation.datasets import BENCHMARKS


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
            score = run["sets"][name]["rougeL"]
            cells.append(f"{score['mean']:.2f} ± {score['std']:.2f}")
        cells += [_number(run[key]) for key in ("avg4", "avg", "avg_ood")]
        if perplexity:
            cells.append(_number(run["perplexity"]["perplexity"]) if run.get("perplexity") else "-")
        body.append(cells)
    return header, body


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown_table(results: dict) -> str:
    header, body = table_rows(results)
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
        *("| " + " | ".join(row) + " |" for row in body),
    ]
    seeds = ", ".join(str(s) for s in results["settings"]["seeds"])
    note = (
        f"ROUGE-L (F x 100, max over references), mean ± population std over seeds {seeds}; "
        "avg4 = Dolly, SelfInst, Vicuna, S-NI."
    )
    return "\n".join(["# Evaluation", "", note, "", *lines, ""])


def rich_table(results: dict) -> Table:
    header, body = table_rows(results)
    table = Table(title="ROUGE-L (mean ± std over seeds)")
    for i, column in enumerate(header):
        if i == 0:
            table.add_column(column, overflow="fold", min_width=12)
        else:
            table.add_column(column, justify="right", no_wrap=True)
    for row in body:
        table.add_row(*row)
    return table
