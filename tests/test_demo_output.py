"""The demo's output does not mislead (issue 50): a missing data directory is reported before any
work; a quick run says it is a plumbing check; untrained perplexities yield no finding; a loss
panel with one point per run draws points, not curves; a run keeps its colour in every panel;
one seed draws no error bar; the SFT baseline's card says SFT and no card names a machine path."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import ModelCard
from matplotlib.colors import to_rgba

from mta.demo import report
from mta.demo.pipeline import require_dolly, run_demo
from mta.demo.settings import DemoSettings
from mta.errors import MtaError


def test_a_missing_data_directory_is_refused_before_any_work(tmp_path, monkeypatch):
    missing = tmp_path / "no-such-sets"
    with pytest.raises(MtaError, match=rf"--data-dir {missing}, which lacks .*dolly/train.jsonl.*another --data-dir"):
        run_demo(DemoSettings.quick(), tmp_path / "demo", data_dir=missing, teacher=tmp_path / "never-read")
    assert not (tmp_path / "demo").exists()  # nothing claimed, converted or pruned
    monkeypatch.setenv("MTA_DATA_DIR", str(missing))
    with pytest.raises(MtaError, match=r"\(\$MTA_DATA_DIR, else ./data\).*--data-dir DIR or set MTA_DATA_DIR"):
        run_demo(DemoSettings.quick(), tmp_path / "demo", teacher=tmp_path / "never-read")
    (missing / "dolly").mkdir(parents=True)
    for split in ("train", "dev"):
        (missing / "dolly" / f"{split}.jsonl").write_text("{}\n")
    require_dolly(missing, given=True)  # both files there: no error


def results_with(perplexities: dict[str, float], *, name: str = "full", seeds=(10, 20)) -> dict:
    runs = {
        label: {
            "checkpoint": "x",
            "sets": {"dolly": {"rougeL": {"mean": 10.0 + i, "std": 0.5, "per_seed": {str(s): 10.0 for s in seeds}}}},
            "perplexity": {"perplexity": value},
        }
        for i, (label, value) in enumerate(perplexities.items())
    }
    return {"checkpoints": runs, "settings": {"demo": {"name": name, "seeds": list(seeds)}}}


def test_untrained_perplexities_and_quick_runs_give_no_finding():
    trained = report.perplexity_note(results_with({"teacher": 9.1, "srkl": 20.0, "srkl+mta": 18.0}))
    assert "srkl+mta against srkl: 18.00 vs 20.00 (10.0 % lower)" in trained
    millions = report.perplexity_note(results_with({"teacher": 9.1, "srkl": 2.1e6, "srkl+mta": 1.03e7}))
    assert "% higher" not in millions and "% lower" not in millions
    assert "above 1,000" in millions and "no comparison" in millions
    quick = report.perplexity_note(results_with({"teacher": 9.1, "srkl": 20.0, "srkl+mta": 18.0}, name="quick"))
    assert "% lower" not in quick and "not findings" in quick


def test_the_quick_report_says_plumbing_check(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "table", lambda results: (["model"], [["teacher"]]))
    monkeypatch.setattr(report, "plot_summary", lambda results, path: path.write_bytes(b"png"))
    for name, expected in (("quick", True), ("full", False)):
        results = results_with({"teacher": 9.1}, name=name)
        results["settings"]["demo"] |= {"eval_limits": {"dolly": 8}, "max_new_tokens": 8, "perplexity_rows": 8}
        results["stage_seconds"] = {"teacher": 0.5, "evaluate": 2.0}
        markdown, _ = report.write_report(results, tmp_path, 1.0)
        text = markdown.read_text(encoding="utf-8")
        assert ("A plumbing check, not a result" in text) is expected
        assert "| evaluate | 2.0 s |" in text and "| all stages | 2.5 s |" in text


def test_the_picture_keeps_colours_draws_points_and_no_zero_error_bars(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(report, "save_figure", lambda figure, path: figures.append(figure))
    results = results_with({"teacher": 9.1, "pruned-start": 3e3, "srkl": 20.0, "srkl+mta": 18.0}, seeds=(10,))
    results["metrics"] = {}
    for label in ("srkl", "srkl+mta"):
        metrics = tmp_path / f"{label}.jsonl"
        metrics.write_text(json.dumps({"split": "train", "step": 4, "loss": 3.0}) + "\n")
        results["metrics"][label] = str(metrics)
    report.plot_summary(results, tmp_path / "summary.png")
    curves, bars = figures[0].axes
    colors = report.run_colors(list(results["checkpoints"]))
    for line in curves.get_lines():
        assert line.get_linestyle() == "None" and line.get_color() == colors[line.get_label()]
    assert "no curve" in curves.get_title()
    for container in bars.containers:
        assert container.errorbar is None  # one seed: no bar drawn as zero
        assert {patch.get_facecolor() for patch in container.patches} == {to_rgba(colors[container.get_label()])}
    assert "one seed" in bars.get_title()


def test_the_sft_card_says_sft_and_cards_name_no_machine_path(tmp_path):
    from mta.training.config.catalog import find_recipe
    from mta.training.config.loading import load_recipe
    from mta.training.lifecycle.model_card import model_card

    converted, pruned = tmp_path / "cache" / "SmolLM2-135M-Instruct", tmp_path / "student-init"
    converted.mkdir(parents=True)
    pruned.mkdir()
    (converted / "mta_source.json").write_text(json.dumps({"hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    (pruned / "mta_init.json").write_text(json.dumps({"source": str(converted)}))
    common = [f"student.path={pruned}", "student.tiny=null", f"data.train={tmp_path / 'ann' / 'train'}"]
    recipe = find_recipe("tiny").path
    distilled = model_card(load_recipe(recipe, [*common, f"teacher.path={converted}", "teacher.tiny=null"]))
    sft = model_card(
        load_recipe(recipe, [*common, "teacher=null", "loss.base=ce", "loss.dsa_weight=0", "loss.hra_weight=0"])
    )
    for card in (distilled, sft):
        assert str(tmp_path) not in card and "/cache/" not in card
        assert "`HuggingFaceTB/SmolLM2-135M-Instruct` (a local copy, local directory `student-init`)" in card
    assert "`HuggingFaceTB/SmolLM2-135M-Instruct` (a local copy, local directory `SmolLM2-135M-Instruct`)" in distilled
    assert "# tiny: distilled student (final)" in distilled and "knowledge-distillation" in distilled
    parsed = ModelCard(sft)
    assert "# tiny: SFT baseline student (final)" in sft and "knowledge-distillation" not in sft
    assert "sft" in parsed.data.tags and "fine-tuned on the reference responses" in sft


def test_every_place_states_the_same_measured_demo_times():
    """`mta demo --help`, its first line (both from MEASURED), `make help` and the README state
    each measured time word for word; a figure one minute off is found nowhere (the check can fail)."""
    from pathlib import Path

    from mta_cli.commands.demo import MEASURED, demo

    root = Path(__file__).resolve().parents[1]
    readme, makefile = (root / "README.md").read_text(), (root / "Makefile").read_text()
    assert set(MEASURED) == {"quick", "full"}
    for figure in MEASURED.values():
        assert figure in readme and figure in makefile, figure
        minutes = figure.split(" min", 1)[0].split()[-1]
        planted = figure.replace(f"{minutes} min", f"{float(minutes) + 1:g} min", 1)
        assert planted not in readme and planted not in makefile
    assert MEASURED["full"] in (demo.__doc__ or "")


@pytest.mark.parametrize(
    ("load", "now", "cores", "threads"),
    [
        (0.2, None, 2, 2),
        (1.4, None, 2, 1),
        (4.3, None, 2, 1),
        (2.6, None, 8, 5),
        (0.94, 0, 2, 2),  # the average lags a job that has just ended: nothing runs now
        (1.4, 1, 2, 1),
        (0.2, 3, 2, 2),  # a job just started: the average, lower, still decides
    ],
)
def test_idle_cores_leave_out_the_load_of_other_work(monkeypatch, load, now, cores, threads):
    from mta import distributed

    monkeypatch.setattr(distributed.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(distributed, "runnable_now", lambda: now)
    monkeypatch.setattr(distributed, "available_cores", lambda: cores)
    assert distributed.idle_cores() == threads


@pytest.mark.parametrize(
    ("text", "runnable"),
    [("0.94 0.80 0.70 1/345 12345\n", 0), ("3.10 2.00 1.00 4/201 77\n", 3), ("0.1 0.1\n", None), (None, None)],
)
def test_the_threads_runnable_now_are_read_from_proc_loadavg_less_the_reader(tmp_path, monkeypatch, text, runnable):
    from mta import distributed

    path = tmp_path / "loadavg"
    if text is not None:
        path.write_text(text)
    monkeypatch.setattr(distributed, "LOADAVG", path)
    assert distributed.runnable_now(readings=2, interval=0) == runnable
