"""A demo's report: ``results.md`` (and the terminal table), ``results.json``, ``summary.png``.

The parts every demo's report shares (``mta demo`` here, ``mta demo-embed`` in
:mod:`mta.embedding.demo`): the heading of results.md (:func:`report_heading`), the files
(:func:`write_report_files`), a run's training records (:func:`train_records`) and the pieces of
the picture (:func:`pyplot`, :func:`plot_training_losses`, :func:`bar_positions`,
:func:`save_figure`). Then the LLM demo's own table, notes and picture.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from mta import distributed
from mta.demo.inspect_students import inspect_lines
from mta.demo.settings import VARIANTS
from mta.evaluation.datasets import BENCHMARKS
from mta.evaluation.results import averages
from mta.files import atomic_path, atomic_write_text
from mta.models.weights import parameter_count
from mta.tables import markdown_table

RESULTS_MARKDOWN, RESULTS_JSON, SUMMARY_PICTURE = "results.md", "results.json", "summary.png"


# --------------------------------------------------------------------------- shared by the demos


def report_heading(title: str, precision: str, elapsed_seconds: float) -> list[str]:
    """The first lines of a demo's results.md: its title, then when, where, at what precision and
    in how long it ran."""
    return [
        f"# {title}",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · {platform.machine()}, "
        f"{distributed.available_cores()} cores, {precision} · whole demo {elapsed_seconds / 60:.1f} min",
        "",
    ]


def write_report_files(out_dir: str | Path, lines: Sequence[str], plot: Callable[[Path], None]) -> tuple[Path, Path]:
    """``lines`` as ``out_dir/results.md``, then ``plot(out_dir/summary.png)``; returns both paths."""
    out_dir = Path(out_dir)
    markdown = out_dir / RESULTS_MARKDOWN
    atomic_write_text(markdown, "\n".join(lines))
    picture = out_dir / SUMMARY_PICTURE
    plot(picture)
    return markdown, picture


def train_records(metrics: str | Path) -> list[dict]:
    """The training records (not the dev ones) of a run's ``metrics.jsonl``, in order."""
    records = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("split", "train") == "train"]


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_training_losses(
    axes, runs: Mapping[str, Sequence[dict]], *, fontsize: int, colors: Mapping[str, str] | None = None
) -> None:
    """One loss curve per run (``{label: train_records(...)}``) on ``axes``, in the run's colour
    (``colors``, the same in every panel). A run with one logged step is a point, not a curve, and
    the title says so."""
    single = all(len(train) < 2 for train in runs.values())
    for label, train in runs.items():
        axes.plot(
            [r["step"] for r in train],
            [r["loss"] for r in train],
            marker="o" if len(train) < 2 else ".",
            linestyle="none" if len(train) < 2 else "-",
            label=label,
            color=(colors or {}).get(label),
        )
    title = "training loss (each run's own objective)"
    if single:
        title += "\none logged step per run: no curve to draw"
    axes.set(title=title, xlabel="step", ylabel="loss")
    axes.legend(fontsize=fontsize)


def run_colors(labels: Sequence[str]) -> dict[str, str]:
    """One colour per run, the same in every panel of a picture (matplotlib's cycle, in order)."""
    return {label: f"C{index % 10}" for index, label in enumerate(labels)}


def bar_positions(series: int, groups: int) -> tuple[float, list[list[float]]]:
    """Grouped bars: their width and, per series, its bar's x in each of ``groups`` groups
    (group g centred on x = g)."""
    width = 0.8 / max(series, 1)
    return width, [[x + (i - (series - 1) / 2) * width for x in range(groups)] for i in range(series)]


def save_figure(figure, path: Path) -> None:
    """Lay ``figure`` out, write it as a PNG (atomically) and close it."""
    figure.tight_layout()
    with atomic_path(path) as partial:
        figure.savefig(partial, dpi=110, format="png")
    pyplot().close(figure)


# --------------------------------------------------------------------------- the LLM demo


BASE_VARIANT, MTA_VARIANT = "kd", "mta"  # the comparison that says what MTA adds to its base loss


# Above this Dolly-dev perplexity a student has not learnt the language (the pruned start is in
# the thousands, the teacher about 10): differences between such students are not findings.
UNTRAINED_PERPLEXITY = 1000


def perplexity_note(results: dict) -> str:
    """The sentence on Dolly-dev perplexity, from the figures: the teacher's and the start's, the
    lowest of the students, and base + MTA against the base loss alone ("" without perplexity) —
    a comparison only where it can mean something: not between students above
    ``UNTRAINED_PERPLEXITY``, nor in a quick run."""
    quick = results.get("settings", {}).get("demo", {}).get("name") == "quick"
    ppl = {
        label: run["perplexity"]["perplexity"]
        for label, run in results["checkpoints"].items()
        if (run.get("perplexity") or {}).get("perplexity") is not None
    }
    if not ppl:
        return ""
    labels = {v.name: v.label for v in VARIANTS}
    students = [v.label for v in VARIANTS if v.label in ppl]
    parts = [f"{label} {ppl[label]:.2f}" for label in ppl if label not in students]
    sentence = "Dolly-dev perplexity (teacher-forced, lower is better): "
    sentence += (", ".join(parts) + "; ") if parts else ""
    if students:
        best = min(students, key=ppl.get)
        sentence += f"the lowest of the students is {best} ({ppl[best]:.2f})"
    base, mta = labels.get(BASE_VARIANT), labels.get(MTA_VARIANT)
    untrained = [label for label in students if ppl[label] > UNTRAINED_PERPLEXITY]
    if untrained:
        sentence += (
            f". {', '.join(untrained)} {'is' if len(untrained) == 1 else 'are'} above {UNTRAINED_PERPLEXITY:,}: "
            "such students have not learnt the language yet, so no comparison between them is drawn"
        )
    elif quick:
        sentence += ". The quick run trains a few steps: its differences are not findings"
    elif base in ppl and mta in ppl:
        change = 100 * (ppl[mta] / ppl[base] - 1)
        word = "lower" if change < 0 else "higher"
        sentence += f"; {mta} against {base}: {ppl[mta]:.2f} vs {ppl[base]:.2f} ({abs(change):.1f} % {word})"
    return sentence.rstrip("; ") + "."


PLUMBING_CHECK = (
    "**A plumbing check, not a result.** The quick run trains each student a few steps on a few rows "
    "and evaluates one seed: it shows that every stage runs on this machine, not what MTA does. "
    "`make demo` trains longer; `make evidence` asks whether MTA helps."
)


def stage_lines(seconds: Mapping[str, float]) -> list[str]:
    """results.md's wall-time table: this session's seconds per stage (a stage reused from an
    earlier session counts only its check)."""
    if not seconds:
        return []
    body = [[stage, f"{value:.1f} s"] for stage, value in seconds.items()]
    body.append(["all stages", f"{sum(seconds.values()):.1f} s"])
    return [
        "Wall time of this session, per stage (results.json: stage_seconds):",
        "",
        *markdown_table(["stage", "wall time"], body),
        "",
    ]


def table(results: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: model, parameters, perplexity, each set's mean ± std, average, time."""
    first = next(iter(results["checkpoints"].values()))
    set_names = list(first["sets"])
    header = ["model", "parameters", "ppl Dolly dev", *(BENCHMARKS[s].title for s in set_names), "avg", "train time"]
    body = []
    for label, run in results["checkpoints"].items():
        perplexity = (run.get("perplexity") or {}).get("perplexity")
        seconds = results.get("training_seconds", {}).get(label)
        one_seed = len(next(iter(run["sets"].values()))["rougeL"]["per_seed"]) == 1
        cells = [
            label,
            f"{parameter_count(run['checkpoint']) / 1e6:.1f}M",
            "-" if perplexity is None else f"{perplexity:.2f}",
        ]
        for name in set_names:
            score = run["sets"][name]["rougeL"]
            cells.append(f"{score['mean']:.2f} ± {'—' if one_seed else format(score['std'], '.2f')}")
        cells.append(f"{averages({n: s['rougeL']['mean'] for n, s in run['sets'].items()})['avg']:.2f}")
        cells.append("-" if seconds is None else f"{seconds / 60:.1f} min")
        body.append(cells)
    return header, body


def _precision(results: dict) -> str:
    """``bf16`` (training and evaluation alike), ``train bf16, evaluate fp32``, or ``fp32`` for
    results written before the demo recorded it."""
    precision = results.get("precision") or {"train": "fp32", "evaluate": "fp32"}
    if precision["train"] == precision["evaluate"]:
        return precision["train"]
    return f"train {precision['train']}, evaluate {precision['evaluate']}"


def write_report(results: dict, out_dir: str | Path, elapsed_seconds: float) -> tuple[Path, Path]:
    """results.json, results.md and summary.png in ``out_dir``; returns the two last paths."""
    out_dir = Path(out_dir)
    header, body = table(results)
    demo = results["settings"]["demo"]
    lines = [
        *report_heading(f"mta demo ({demo['name']})", _precision(results), elapsed_seconds),
        *([PLUMBING_CHECK, ""] if demo["name"] == "quick" else []),
        *markdown_table(header, body),
        "",
        f"ROUGE-L: F x 100, max over references, mean ± population std over seeds "
        f"{', '.join(str(s) for s in demo['seeds'])}; rows per set: "
        + ", ".join(f"{BENCHMARKS[s].title} {n}" for s, n in demo["eval_limits"].items())
        + f"; at most {demo['max_new_tokens']} new tokens. Perplexity: teacher-forced, response "
        f"tokens incl. EOS, first {demo['perplexity_rows']} Dolly dev rows.",
        "",
        "teacher: the 30-layer model; pruned-start: its 10-layer copy every student starts from; "
        + "; ".join(f"{v.label}: {v.description}" for v in VARIANTS)
        + ".",
        "",
    ]
    note = perplexity_note(results)
    if note:
        lines += [note, ""]
    lines += inspect_lines(results)
    lines += stage_lines(results.get("stage_seconds") or {})
    atomic_write_text(out_dir / RESULTS_JSON, json.dumps(results, indent=2) + "\n")
    return write_report_files(out_dir, lines, lambda picture: plot_summary(results, picture))


def plot_summary(results: dict, path: Path) -> None:
    """Left: training loss of the three runs. Right: ROUGE-L per model and set, with std bars."""
    figure, (curves, bars) = pyplot().subplots(1, 2, figsize=(13, 4.8))
    labels = list(results["checkpoints"])
    colors = run_colors(labels)  # a run keeps its colour in both panels
    plot_training_losses(
        curves,
        {label: train_records(metrics) for label, metrics in results["metrics"].items()},
        fontsize=8,
        colors=colors,
    )

    set_names = list(next(iter(results["checkpoints"].values()))["sets"])
    seeds = len(results["settings"]["demo"]["seeds"])
    width, positions = bar_positions(len(labels), len(set_names))
    for label, at in zip(labels, positions, strict=True):
        scores = [results["checkpoints"][label]["sets"][s]["rougeL"] for s in set_names]
        spread = [s["std"] for s in scores] if seeds > 1 else None  # one seed: no spread to draw
        bars.bar(at, [s["mean"] for s in scores], width, yerr=spread, label=label, capsize=2, color=colors[label])
    bars.set_xticks(range(len(set_names)), [BENCHMARKS[s].title for s in set_names])
    title = "ROUGE-L (mean ± std over seeds)" if seeds > 1 else "ROUGE-L (one seed: no spread)"
    bars.set(title=title, ylabel="ROUGE-L")
    bars.legend(fontsize=8)
    save_figure(figure, path)
