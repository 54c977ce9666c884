"""The evidence's report: ``results.md``, ``results.json`` and ``evidence.png`` (issues 33, 47).

``results.md`` holds, in order: when and from which commit, the teacher before and after its
fine-tune, the per-set and average ROUGE-L difference MTA − base with its 95 % interval and the
smallest difference the design detects at 80 % power, the sentence that says what that means, the
same for teacher agreement (fkl, srkl, top-1) and trajectory agreement (structure agreement, CKA
at the aligned pairs), the token cap, the "writes text" check, every run's choice and times,
every stage's wall time, the settings (fixed before the runs) and the bootstrap procedure.
The picture: every run's dev ROUGE-L and dev skew-reverse-KL curves (the base loss both variants
share), and the differences with their intervals.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any

from mta import distributed
from mta.demo.evidence import BASE, MTA, EvidenceSettings, plan_lines
from mta.demo.report import pyplot, save_figure
from mta.evaluation.bootstrap import AVERAGE
from mta.evaluation.datasets import BENCHMARKS
from mta.files import atomic_write_json, atomic_write_text
from mta.inspection.report import heatmap_name
from mta.tables import markdown_table
from mta.versions import source_commit

RESULTS_MARKDOWN, RESULTS_JSON, PICTURE = "results.md", "results.json", "evidence.png"
COLOURS = {BASE.label: "tab:blue", MTA.label: "tab:orange"}


def _title(name: str) -> str:
    return "average" if name == AVERAGE else BENCHMARKS[name].title if name in BENCHMARKS else name


def verdict(differences: dict[str, dict]) -> str:
    """The plain sentence on the average difference: its sign, whether its interval excludes 0,
    and what the design could have detected."""
    average = differences[AVERAGE]
    estimate, low, high, detectable = (average[k] for k in ("estimate", "low", "high", "detectable"))
    interval = f"{estimate:+.2f} ROUGE-L (95 % interval {low:+.2f} to {high:+.2f})"
    if low > 0:
        return f"MTA helps its base loss here: on average {interval}; the interval excludes 0."
    if high < 0:
        return f"MTA hurts its base loss here: on average {interval}; the interval excludes 0."
    return (
        f"No difference detected: on average MTA − base is {interval}, an interval that includes 0. "
        f"This design detects a difference of {detectable:.2f} ROUGE-L or more at 80 % power; a smaller "
        "gain (or loss) than that would go unseen."
    )


def difference_table(results: dict) -> tuple[list[str], list[list[str]]]:
    """Per set, then the average: teacher, base and MTA means, the difference, its interval, the
    detectable difference."""
    header = ["set", "teacher", BASE.label, MTA.label, "MTA − base", "95 % interval", "detectable (80 %)"]
    body = []
    teacher, means, differences = results["teacher"]["sets"], results["means"], results["differences"]
    for name in [*results["settings"]["test_sets"], AVERAGE]:
        if name == AVERAGE:
            cells = [sum(values.values()) / len(values) for values in (teacher, means[BASE.label], means[MTA.label])]
        else:
            cells = [teacher[name], means[BASE.label][name], means[MTA.label][name]]
        d = differences[name]
        body.append(
            [
                _title(name),
                *(f"{value:.2f}" for value in cells),
                f"{d['estimate']:+.2f}",
                f"{d['low']:+.2f} to {d['high']:+.2f}",
                f"{d['detectable']:.2f}",
            ]
        )
    return header, body


AGREEMENT_TITLES = {
    "fkl": "teacher-forced forward KL (teacher → student), nats per token, lower is closer",
    "srkl": "teacher-forced skew reverse KL (α 0.1), nats per token, lower is closer",
    "top1": "top-1 agreement with the teacher, share of response positions, higher is closer",
}
TRAJECTORY_TITLES = {
    "structure_agreement": "structure agreement (Pearson r of the span cosine matrices), higher is closer",
    "cka": "linear CKA of the aligned layers' span states, higher is closer",
}


def outcome_table(outcome: dict, keys: list[str], *, digits: int = 3) -> tuple[list[str], list[list[str]]]:
    """One measure's table: per set (or pair), then the average: the pruned start, base and MTA
    means, the difference, its interval and the detectable difference."""
    header = ["", "pruned start", BASE.label, MTA.label, "MTA − base", "95 % interval", "detectable (80 %)"]
    body = []
    means, start = outcome["means"], outcome["start"]
    for key in [*keys, AVERAGE]:
        if key == AVERAGE:
            cells = [sum(v[k] for k in keys) / len(keys) for v in (start, means[BASE.label], means[MTA.label])]
        else:
            cells = [start[key], means[BASE.label][key], means[MTA.label][key]]
        d = outcome["differences"][key]
        body.append(
            [
                _title(key),
                *(f"{value:.{digits}f}" for value in cells),
                f"{d['estimate']:+.{digits}f}",
                f"{d['low']:+.{digits}f} to {d['high']:+.{digits}f}",
                f"{d['detectable']:.{digits}f}",
            ]
        )
    return header, body


def teacher_table(results: dict) -> tuple[list[str], list[list[str]]]:
    """ROUGE-L of the teacher before (as shipped) and after its fine-tune, per set and on average."""
    sets = results["settings"]["test_sets"]
    before, after = results["teacher"]["original"], results["teacher"]["sets"]
    body = [[_title(n), f"{before[n]:.2f}", f"{after[n]:.2f}", f"{after[n] - before[n]:+.2f}"] for n in sets]
    mean_before, mean_after = (sum(v[n] for n in sets) / len(sets) for v in (before, after))
    body.append(["average", f"{mean_before:.2f}", f"{mean_after:.2f}", f"{mean_after - mean_before:+.2f}"])
    return ["set", "shipped", "fine-tuned", "change"], body


def mechanism_verdict(results: dict) -> str:
    """The plain sentence on the trajectory outcome: did MTA's terms move the aligned layers on
    held-out text (the average over pairs of structure agreement and of CKA)?"""
    moved = []
    for measure, name in (("structure_agreement", "structure agreement"), ("cka", "CKA")):
        d = results["trajectory"][measure]["differences"][AVERAGE]
        interval = f"{d['estimate']:+.3f} (95 % interval {d['low']:+.3f} to {d['high']:+.3f})"
        moved.append((d["low"] > 0, d["high"] < 0, f"{name} {interval}"))
    said = "; ".join(text for _, _, text in moved)
    up, down = any(u for u, _, _ in moved), any(d for _, d, _ in moved)
    if up and down:
        return (
            "MTA's terms moved the aligned layers on held-out text, one measure towards the teacher's and "
            f"one away: {said}."
        )
    if up:
        return f"MTA's terms moved the aligned layers towards the teacher's on held-out text: {said}."
    if down:
        return f"MTA's terms moved the aligned layers away from the teacher's on held-out text: {said}."
    return (
        f"MTA's terms did not measurably move the aligned layers on held-out text: {said}. Whatever "
        "ROUGE-L shows, the mechanism did not act where it aims to, so the next step is a bug hunt in how "
        "the terms reach those layers, not a retune."
    )


def mechanism_lines(results: dict) -> list[str]:
    """The agreement and trajectory sections of results.md."""
    sets = results["settings"]["test_sets"]
    lines = ["## Teacher agreement (held-out references, teacher-forced)", ""]
    for measure, title in AGREEMENT_TITLES.items():
        lines += [f"**{title}**", "", *markdown_table(*outcome_table(results["agreement"][measure], sets)), ""]
    trajectory = results["trajectory"]
    lines += [
        "## Trajectory agreement at the aligned layers (`mta inspect`, held-out Dolly test rows)",
        "",
        f"{trajectory['rows']} rows; CKA estimator {trajectory['estimator']}. One value per student and pair: "
        "the interval resamples the training seeds only.",
        "",
    ]
    for measure, title in TRAJECTORY_TITLES.items():
        pairs = list(trajectory[measure]["start"])
        lines += [f"**{title}**", "", *markdown_table(*outcome_table(trajectory[measure], pairs)), ""]
    lines += [
        mechanism_verdict(results),
        "",
        "Layer similarity of every student to the teacher (inspect/results.md has each pair's numbers):",
        "",
        *(f"![{g}-span CKA](inspect/{heatmap_name(g)})" for g in ("phrase", "word")),
        "",
    ]
    return lines


def _runs_table(results: dict) -> list[str]:
    header = [
        "run",
        "chosen step",
        "dev ROUGE-L at selection",
        "dev ROUGE-L (evaluated)",
        "writes text",
        "dev srkl, first → last",
        "dev objective, last",
        "train time",
    ]
    body = []
    for label, run in results["runs"].items():
        base = [point["base_loss"] for point in run["curve"] if point.get("base_loss") is not None]
        objective = [point["loss"] for point in run["curve"] if point["loss"] is not None]
        seconds = results["timings"].get(f"train {label}")
        body.append(
            [
                label,
                str(run["chosen_step"]),
                f"{run['dev_rouge_at_selection']:.2f}",
                f"{run['dev_rouge']:.2f}",
                "yes" if run["writes_text"] else "**no**",
                f"{base[0]:.3f} → {base[-1]:.3f}" if base else "-",
                f"{objective[-1]:.3f}" if objective else "-",
                f"{seconds / 60:.1f} min" if seconds is not None else "-",
            ]
        )
    return markdown_table(header, body)


def code_source(sessions: list[dict]) -> str:
    """Which code the stages ran: ``commit abc123 (2 sessions, the first 2026-12-02T05:40:00Z)``,
    naming every commit when the sessions ran different ones and uncommitted changes where a
    session had them."""
    commits = list(dict.fromkeys((s.get("commit") or "unknown", bool(s.get("dirty"))) for s in sessions))
    named = ", ".join(f"{sha[:12]}" + (" with uncommitted changes" if dirty else "") for sha, dirty in commits)
    count = f"{len(sessions)} session" + ("s" if len(sessions) != 1 else "")
    return f"commit {named} ({count}, the first started {sessions[0]['started']})" if sessions else "commit unknown"


def _report_commit(results: dict) -> str:
    """``; this report from commit X`` when the code writing it is not the stages' (only) commit."""
    now = source_commit()
    ran = {(s.get("commit"), bool(s.get("dirty"))) for s in results["sessions"]}
    if ran == {(now["commit"], bool(now["dirty"]))}:
        return ""
    sha = now["commit"] or "unknown"
    return f"; this report from commit {sha[:12]}" + (" with uncommitted changes" if now["dirty"] else "")


def markdown_lines(results: dict, elapsed_seconds: float | None) -> list[str]:
    """results.md's lines; ``elapsed_seconds``: the session that wrote it (None: a report read back)."""
    settings = EvidenceSettings.from_record(results["settings"])
    source = code_source(results["sessions"])
    timings = results["timings"]
    total = sum(timings.values())
    dev_teacher = results["teacher"]["dev_rouge"]
    writes = [label for label, run in results["runs"].items() if run["writes_text"]]
    fine_tune, cap = results["teacher"]["fine_tune"], results["token_cap"]
    lines = [
        f"# Does MTA help DistiLLM here? {BASE.label} against {MTA.label}",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · stages from {source}{_report_commit(results)} · "
        f"{platform.machine()}, "
        f"{distributed.available_cores()} cores, {results['precision']} · stages {total / 60:.1f} min in all"
        + (
            f" (the session that wrote this report: {elapsed_seconds / 60:.1f} min)"
            if elapsed_seconds is not None
            else ""
        ),
        "",
        "## The teacher, before and after its fine-tune (ROUGE-L)",
        "",
        *markdown_table(*teacher_table(results)),
        "",
        f"Fine-tuned at lr {fine_tune['pilot']['chosen_lr'] if fine_tune.get('pilot') else '?'} (the pilot's "
        f"lowest dev loss); checkpoint of step {fine_tune['chosen_step']} chosen by dev ROUGE-L "
        f"({fine_tune['dev_rouge_at_selection']:.2f}).",
        "",
        "## ROUGE-L",
        "",
        *markdown_table(*difference_table(results)),
        "",
        "ROUGE-L (F × 100), each variant's mean over its training seeds, the sampling seeds and the rows. "
        + verdict(results["differences"]),
        "",
        *mechanism_lines(results),
        "## The token cap",
        "",
        f"The fine-tuned teacher's {cap['outputs']} dev outputs: {settings.cap_quantile * 100:.0f} % quantile "
        f"{cap['lengths_quantile']:.0f} new tokens ({cap['reached_limit']} reached {settings.cap_limit}); "
        f"rule {cap['rule']}, used {cap['cap']}"
        + (f" after the budget's cuts ({'; '.join(cap['cuts'])})" if cap["cuts"] else "")
        + f"; {cap['eval_rows']} rows per test set.",
        "",
        "## Does the student write text?",
        "",
        f"The teacher's dev ROUGE-L is {dev_teacher:.2f} on the first {settings.select_rows} Dolly dev rows "
        f"(`mta evaluate`, seeds {list(settings.sampling_seeds)}); half of it is {dev_teacher / 2:.2f}. "
        f"{len(writes)} of the {len(results['runs'])} chosen checkpoints reach it.",
        "",
        *_runs_table(results),
        "",
        f"dev ROUGE-L at selection: one sample per row on the first {settings.select_rows} annotated dev rows "
        "(prompts of at most 128 tokens; the seed of `train.select_by: rouge`), the best of the run's "
        "evaluations, so biased upwards; evaluated: the chosen checkpoint under `mta evaluate`'s protocol "
        "and sampling seeds on the rows the teacher's figure uses. dev srkl: the skew reverse KL to the "
        "teacher on the annotated dev rows, the base loss both variants share (first and last evaluation); "
        "dev objective: the run's own loss (srkl + 2·DSA + 0.2·HRA for MTA).",
        "",
        "## Stages",
        "",
        *markdown_table(["stage", "wall time"], [[stage, f"{s / 60:.1f} min"] for stage, s in timings.items()]),
        "",
        "## Settings, fixed before the runs",
        "",
        "```",
        *plan_lines(settings, results["out_dir"], precision=results["precision"]),
        "```",
        "",
        "## How the interval is computed",
        "",
        "A variant's scores on a set are `[training seeds, sampling seeds, rows]`. One bootstrap replicate "
        "draws, with replacement, each variant's training seeds, then within each drawn run its sampling "
        "seeds, then the set's rows (one draw for both variants: they answer the same prompts); the "
        "difference of the means is recomputed. The 95 % interval is the estimate ± t(0.975, n_A + n_B − 2) "
        f"× the replicates' standard deviation ({settings.replicates} replicates); the smallest difference "
        "detectable at 80 % power is (t(0.975) + t(0.80)) × that standard deviation. The average is the "
        f"mean of the {len(settings.test_sets)} per-set differences. `mta.evaluation.bootstrap`; "
        "`tests/test_bootstrap.py` checks the coverage and the power on simulated data with a planted difference.",
        "",
    ]
    return lines


def plot(results: dict, path: Path) -> None:
    """Dev ROUGE-L and dev loss of every run against the step, then the differences."""
    plt = pyplot()
    figure, (rouge, loss, diff) = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in results["runs"].values():
        colour = COLOURS[run["variant"]]
        points = [p for p in run["curve"] if p["rougeL"] is not None and p["step"] > 0]
        rouge.plot([p["step"] for p in points], [p["rougeL"] for p in points], color=colour, alpha=0.7, marker=".")
        losses = [p for p in run["curve"] if p.get("base_loss") is not None]
        loss.plot([p["step"] for p in losses], [p["base_loss"] for p in losses], color=colour, alpha=0.7, marker=".")
    for variant in (BASE, MTA):
        rouge.plot([], [], color=COLOURS[variant.label], label=variant.label)
    rouge.axhline(
        results["teacher"]["dev_rouge"], color="grey", linestyle="--", label="teacher (evaluated, first dev rows)"
    )
    rouge.axhline(results["teacher"]["dev_rouge"] / 2, color="grey", linestyle=":", label="half the teacher")
    rouge.set(title="dev ROUGE-L (selection rows, 1 sample)", xlabel="step", ylabel="ROUGE-L")
    rouge.legend(fontsize=8)
    loss.set(title="dev skew reverse KL (the base loss of both)", xlabel="step", ylabel="loss")
    names = [*results["settings"]["test_sets"], AVERAGE]
    estimates = [results["differences"][n]["estimate"] for n in names]
    lows = [results["differences"][n]["estimate"] - results["differences"][n]["low"] for n in names]
    highs = [results["differences"][n]["high"] - results["differences"][n]["estimate"] for n in names]
    diff.errorbar(range(len(names)), estimates, yerr=[lows, highs], fmt="o", capsize=4, color="tab:orange")
    diff.axhline(0, color="black", linewidth=0.8)
    diff.set_xticks(range(len(names)), [_title(n) for n in names])
    diff.set(title="MTA − base, ROUGE-L (95 % interval)", ylabel="difference")
    save_figure(figure, path)


def write_report(
    results: dict[str, Any], out_dir: str | Path, elapsed_seconds: float | None = None
) -> tuple[Path, Path]:
    """results.json, results.md and evidence.png in ``out_dir``; returns the last two."""
    out_dir = Path(out_dir)
    atomic_write_json(out_dir / RESULTS_JSON, results)
    markdown = out_dir / RESULTS_MARKDOWN
    atomic_write_text(markdown, "\n".join(markdown_lines(results, elapsed_seconds)))
    picture = out_dir / PICTURE
    plot(results, picture)
    return markdown, picture


__all__ = [
    "code_source",
    "difference_table",
    "markdown_lines",
    "mechanism_lines",
    "mechanism_verdict",
    "outcome_table",
    "plot",
    "teacher_table",
    "verdict",
    "write_report",
]
