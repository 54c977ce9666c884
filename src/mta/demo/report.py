"""The demo's table (``results.md``, the terminal) and picture (``summary.png``)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from safetensors import safe_open

from mta import distributed
from mta.demo.settings import VARIANTS
from mta.files import atomic_path, atomic_write_text
from mta.tables import markdown_table
from mta.evaluation.datasets import BENCHMARKS
from mta.evaluation.results import averages

BASE_VARIANT, MTA_VARIANT = "kd", "mta"  # the comparison that says what MTA adds to its base loss


def perplexity_note(results: dict) -> str:
    """The sentence on Dolly-dev perplexity, from the figures: the teacher's and the start's, the
    lowest of the students, and base + MTA against the base loss alone ("" without perplexity)."""
    ppl = {
        label: run["perplexity"]["perplexity"]
        for label, run in results["checkpoints"].items() if (run.get("perplexity") or {}).get("perplexity") is not None
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
    if base in ppl and mta in ppl:
        change = 100 * (ppl[mta] / ppl[base] - 1)
        word = "lower" if change < 0 else "higher"
        sentence += (f"; {mta} against {base}: {ppl[mta]:.2f} vs {ppl[base]:.2f} "
                     f"({abs(change):.1f} % {word})")
    return sentence.rstrip("; ") + "."


def parameter_count(model_dir: str | Path) -> int:
    """Parameters stored in a checkpoint's safetensors files, read from their headers only."""
    total = 0
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            for name in handle.keys():
                shape = handle.get_slice(name).get_shape()
                count = 1
                for size in shape:
                    count *= size
                total += count
    return total


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
        f"# mta demo ({demo['name']})",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · {platform.machine()}, "
        f"{distributed.available_cores()} cores, {_precision(results)} · whole demo {elapsed_seconds / 60:.1f} min",
        "",
        *markdown_table(header, body),
        "",
        f"ROUGE-L: F x 100, max over references, mean ± population std over seeds "
        f"{', '.join(str(s) for s in demo['seeds'])}; rows per set: "
        + ", ".join(f"{BENCHMARKS[s].title} {n}" for s, n in demo["eval_limits"].items())
        + f"; at most {demo['max_new_tokens']} new tokens. Perplexity: teacher-forced, response "
        f"tokens incl. EOS, first {demo['perplexity_rows']} Dolly dev rows.",
        "",
        "teacher: the 30-layer model; pruned-start: its 10-layer copy every student starts from; "
        + "; ".join(f"{v.label}: {v.description}" for v in VARIANTS) + ".",
        "",
    ]
    note = perplexity_note(results)
    if note:
        lines += [note, ""]
    markdown = out_dir / "results.md"
    atomic_write_text(markdown, "\n".join(lines))
    atomic_write_text(out_dir / "results.json", json.dumps(results, indent=2) + "\n")
    picture = out_dir / "summary.png"
    plot_summary(results, picture)
    return markdown, picture


def plot_summary(results: dict, path: Path) -> None:
    """Left: training loss of the three runs. Right: ROUGE-L per model and set, with std bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, bars) = plt.subplots(1, 2, figsize=(13, 4.8))
    for label, metrics in results["metrics"].items():
        records = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
        train = [r for r in records if r.get("split", "train") == "train"]
        curves.plot([r["step"] for r in train], [r["loss"] for r in train], marker=".", label=label)
    curves.set(title="training loss (each run's own objective)", xlabel="step", ylabel="loss")
    curves.legend(fontsize=8)

    labels = list(results["checkpoints"])
    set_names = list(next(iter(results["checkpoints"].values()))["sets"])
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        scores = [results["checkpoints"][label]["sets"][s]["rougeL"] for s in set_names]
        positions = [x + (i - (len(labels) - 1) / 2) * width for x in range(len(set_names))]
        bars.bar(positions, [s["mean"] for s in scores], width, yerr=[s["std"] for s in scores], label=label, capsize=2)
    bars.set_xticks(range(len(set_names)), [BENCHMARKS[s].title for s in set_names])
    bars.set(title="ROUGE-L (mean ± std over seeds)", ylabel="ROUGE-L")
    bars.legend(fontsize=8)
    figure.tight_layout()
    with atomic_path(path) as partial:
        figure.savefig(partial, dpi=110, format="png")
    plt.close(figure)
