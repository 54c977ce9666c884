"""The inspection's files: ``results.md``, one heatmap per granularity, and ``results.json`` last.

Each file is written atomically (``mta.files``), and ``results.json`` only after the others: its
presence means the set is complete, and a run killed at any point leaves the previous
``results.json`` (or none), never a partial one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mta.files import atomic_path, atomic_write_json, atomic_write_text, make_output_directory
from mta.inspection.layer_map import layer_map_yaml
from mta.tables import markdown_table

RESULTS_JSON, RESULTS_MARKDOWN = "results.json", "results.md"


def heatmap_name(granularity: str) -> str:
    return f"cka-{granularity}.png"


def _number(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def aligned_rows(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The table of the aligned pairs (every student): header and rows of strings."""
    header = ["student", "pair", "CKA", "structure r", "DSA", "HRA (1 − cos)", "1 − R²"]
    rows = []
    for student in results["students"]:
        for pair in student["aligned"]:
            rows.append(
                [
                    student["label"],
                    f"{pair['student']} → {pair['teacher']} {pair['granularity']}",
                    _number(pair["cka"]),
                    _number(pair["structure_agreement"]),
                    _number(pair["dsa"], 4),
                    _number(pair["hra"], 4),
                    _number(pair["relative_residual"]),
                ]
            )
    return header, rows


def markdown_lines(results: Mapping[str, Any]) -> list[str]:
    rows = results["rows"]
    estimator = results["estimator"]
    lines = [
        "# mta inspect",
        "",
        f"Teacher `{results['teacher']['path'] or results['teacher'].get('teacher_cache')}` "
        f"({results['teacher']['fingerprint'] or 'from its cache'}); "
        f"{rows['count']} rows of `{rows['data']}` (ids {rows['ids'][0]}…{rows['ids'][-1]}; {rows['held_out']}).",
        f"CKA: linear, {estimator} estimator (both are in results.json), float64 sums over the items; "
        "layer 0 is the embeddings. Spans pooled as MTA pools them (each layer's attention importance).",
        f"Layer map: {results['layer_map_source']}. The linear fit: least squares with a bias on the first "
        f"{rows['fit']} rows, measured on the other {rows['measure']}.",
        "",
        *[f"- {note}" for note in results["notes"]],
        "",
        "## At the aligned layers",
        "",
        *markdown_table(*aligned_rows(results)),
        "",
        "CKA: the pair's span CKA. structure r: mean over rows of the Pearson correlation between the "
        "two span cosine matrices (what DSA matches; 1 = same geometry). DSA: the loss's value. HRA: "
        "the loss's 1 − cos after the best linear map, on the held-out half; 1 − R²: that map's "
        "relative squared residual.",
        "",
        "## Suggested layer maps",
        "",
    ]
    for student in results["students"]:
        layer_map = student["layer_map"]
        lines += [
            f"### {student['label']}",
            "",
            f"The recipe's map (total CKA {_number(layer_map['recipe_total'])}):",
            "",
            "```yaml",
            layer_map_yaml(layer_map["recipe"], layer_map["recipe_cka"]),
            "```",
            "",
            f"Suggested: the same student layers, monotone teacher layers of highest total span CKA "
            f"({_number(layer_map['suggested_total'])}):",
            "",
            "```yaml",
            layer_map_yaml(layer_map["suggested"], layer_map["suggested_cka"]),
            "```",
            "",
        ]
    lines += ["## Heatmaps", ""]
    for granularity in results["granularities"]:
        lines += [f"![{granularity}]({heatmap_name(granularity)})", ""]
    return lines


def plot_heatmaps(results: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per granularity: every student side by side on one colour scale (the recipe's map
    as circles, the suggested one as crosses), then each later student minus the first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    estimator = results["estimator"]
    students = results["students"]
    teacher_layers = results["teacher"]["layers"]
    written = []
    for granularity in results["granularities"]:
        matrices = [_array(s["cka"][granularity][estimator]) for s in students]
        differences = [(s["label"], m - matrices[0]) for s, m in zip(students[1:], matrices[1:], strict=True)]
        panels = len(matrices) + len(differences)
        figure, axes = plt.subplots(
            1, panels, figsize=(max(3.6 * panels + 0.8, 6.0), 4.4), squeeze=False, layout="constrained"
        )
        finite = np.concatenate([m[np.isfinite(m)] for m in matrices]) if matrices else np.array([0.0])
        low = min(0.0, float(finite.min())) if finite.size else 0.0
        image = None
        for axis, student, matrix in zip(axes[0], students, matrices, strict=False):
            image = axis.imshow(matrix, vmin=low, vmax=1.0, cmap="viridis", aspect="auto", origin="lower")
            _draw_maps(axis, student, granularity, teacher_layers)
            axis.set(title=student["label"], xlabel="teacher layer", ylabel="student layer")
            _ticks(axis, teacher_layers, len(matrix))
        if image is not None:
            figure.colorbar(image, ax=list(axes[0][: len(matrices)]), shrink=0.8, label=f"linear CKA ({estimator})")
        if differences:
            reach = max(float(np.nanmax(np.abs(d))) if np.isfinite(d).any() else 0.0 for _, d in differences) or 1e-6
            for axis, (label, difference) in zip(axes[0][len(matrices) :], differences, strict=True):
                shown = axis.imshow(difference, vmin=-reach, vmax=reach, cmap="RdBu_r", aspect="auto", origin="lower")
                axis.set(title=f"{label} − {students[0]['label']}", xlabel="teacher layer", ylabel="student layer")
                _ticks(axis, teacher_layers, len(difference))
            figure.colorbar(shown, ax=list(axes[0][len(matrices) :]), shrink=0.8, label="CKA difference")
        figure.suptitle(
            f"{granularity}: linear CKA of student × teacher layers\n○ the recipe's map, × the suggested one"
        )
        path = out_dir / heatmap_name(granularity)
        with atomic_path(path) as partial:
            figure.savefig(partial, dpi=100, format="png")
        plt.close(figure)
        written.append(path)
    return written


def _array(matrix: Sequence[Sequence[float | None]]) -> np.ndarray:
    return np.array([[np.nan if v is None else v for v in row] for row in matrix], dtype=np.float64)


def _ticks(axis: Any, teacher_layers: Sequence[int], student_count: int) -> None:
    step = max(1, len(teacher_layers) // 8)
    axis.set_xticks(range(0, len(teacher_layers), step), [str(t) for t in teacher_layers[::step]])
    axis.set_yticks(range(0, student_count, max(1, student_count // 8)))


def _draw_maps(axis: Any, student: Mapping[str, Any], granularity: str, teacher_layers: Sequence[int]) -> None:
    layer_map = student["layer_map"]
    for pairs, style in (
        (layer_map["recipe"], {"marker": "o", "facecolors": "none", "edgecolors": "white"}),
        (layer_map["suggested"], {"marker": "x", "c": "red"}),
    ):
        points = [(teacher_layers.index(t), s) for s, t, g in pairs if g == granularity]
        if points:
            xs, ys = zip(*points, strict=True)
            axis.scatter(xs, ys, s=70, **style)


def write_inspection(results: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """results.md and the heatmaps, then results.json; returns their paths."""
    out_dir = Path(out_dir)
    make_output_directory(out_dir)
    markdown = out_dir / RESULTS_MARKDOWN
    atomic_write_text(markdown, "\n".join(markdown_lines(results)) + "\n")
    pictures = plot_heatmaps(results, out_dir)
    path = out_dir / RESULTS_JSON
    atomic_write_json(path, results)
    return {"results.json": path, "results.md": markdown, **{p.name: p for p in pictures}}


__all__ = ["RESULTS_JSON", "RESULTS_MARKDOWN", "aligned_rows", "heatmap_name", "markdown_lines", "write_inspection"]
