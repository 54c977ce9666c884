"""`make evidence` end to end on a tiny teacher: every stage, the numbers against the files they
come from, the report, and a second run that redoes nothing (issue 33)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fixtures.instruct import example_instruct_dir
from mta.demo.evidence import (
    BASE,
    MTA,
    EvidencePaths,
    EvidenceSettings,
    plan_lines,
    read_back,
    run_evidence,
    run_label,
    timed_stage,
)
from mta.demo.evidence_budget import cap_from_lengths, fit_budget, generated_micro_batches
from mta.demo.evidence_report import (
    code_source,
    difference_table,
    mechanism_verdict,
    outcome_table,
    teacher_table,
    verdict,
    write_report,
)
from mta.errors import MtaError
from mta.evaluation.bootstrap import AVERAGE, bootstrap_differences

REPO = Path(__file__).resolve().parents[1]

SETTINGS = EvidenceSettings(
    name="test",
    student_layers=2,
    max_length=384,
    max_prompt_length=256,
    teacher_rows=8,
    teacher_pilot_lrs=(1e-3, 1e-6),
    teacher_pilot_steps=2,
    teacher_evals=1,
    train_steps=2,
    eval_interval=1,
    train_seeds=(1, 2),
    batch_size=4,
    dev_rows=4,
    select_rows=2,
    eval_rows=2,
    sampling_seeds=(10, 20),
    init_threshold=1.0,  # the published 0.0 samples only once the dev loss rises: here every micro batch
    cap_limit=6,
    cap_floor=2,
    planned_tokens=4,
    inspect_rows=4,
    eval_batch_size=4,
    engine="hf",
    replicates=200,
    test_sets=("dolly", "self-inst"),
)
OVERRIDES = (
    "train.warmup_steps=0",
    "train.num_sample_generations=0",
)


def _scores(out: Path, split: str, label: str, set_name: str) -> list[list[float]]:
    """[sampling seeds, rows] ROUGE-L read straight from the predictions files."""
    return [
        [json.loads(line)["rougeL"] for line in path.read_text().splitlines()]
        for path in sorted((out / "eval" / split / "predictions" / label / set_name).glob("seed-*.jsonl"))
    ]


@pytest.mark.slow
def test_evidence_runs_every_stage_reports_it_and_reuses_it(tmp_path, tiny_model_dir):
    torch.set_num_threads(1)
    out, data = tmp_path / "evidence", example_instruct_dir(tmp_path / "data")

    results = run_evidence(SETTINGS, out, data_dir=data, teacher=tiny_model_dir, recipe_overrides=OVERRIDES)

    labels = [run_label(v, s) for s in SETTINGS.train_seeds for v in (BASE, MTA)]
    assert list(results["runs"]) == labels
    for label in labels:
        run = results["runs"][label]
        # The chosen checkpoint is the run's best dev ROUGE-L among its evaluations (step 0 excluded).
        curve = [p for p in run["curve"] if p["step"] > 0]
        assert [p["step"] for p in curve] == [1, 2]
        assert run["dev_rouge_at_selection"] == max(p["rougeL"] for p in curve)
        assert run["chosen_step"] == next(p["step"] for p in curve if p["rougeL"] == run["dev_rouge_at_selection"])
        assert (out / "runs" / label / "best" / "config.json").exists()
        dev = np.mean(_scores(out, "dev", label, "dolly-dev"))
        assert run["dev_rouge"] == pytest.approx(dev)
        assert run["writes_text"] == (dev >= results["teacher"]["dev_rouge"] / 2)
        records = [json.loads(line) for line in (out / "runs" / label / "metrics.jsonl").read_text().splitlines()]
        dev_records = [r for r in records if r.get("split") == "dev"]
        assert [p["base_loss"] for p in run["curve"]] == [r["loss/base"] for r in dev_records]
        if run["variant"] == BASE.label:  # the base loss is the whole objective
            assert [p["loss"] for p in run["curve"]] == [p["base_loss"] for p in run["curve"]]
    # Every run starts from the same student (its step-0 dev base loss is the same), and a seed
    # changes the data order (the first logged training loss differs between seeds).
    for seed in SETTINGS.train_seeds:
        starts = [results["runs"][run_label(v, seed)]["curve"][0]["base_loss"] for v in (BASE, MTA)]
        assert starts[0] == pytest.approx(starts[1], rel=1e-5)

    def first_train_loss(label: str) -> float:
        records = [json.loads(line) for line in (out / "runs" / label / "metrics.jsonl").read_text().splitlines()]
        return next(r["loss"] for r in records if r.get("split", "train") == "train")

    assert first_train_loss(run_label(BASE, 1)) != pytest.approx(first_train_loss(run_label(BASE, 2)), rel=1e-6)
    # DistiLLM's sampling ran in every run: some micro batches were the student's own text.
    for label in labels:
        records = [json.loads(line) for line in (out / "runs" / label / "metrics.jsonl").read_text().splitlines()]
        assert sum(r.get("off_policy/generated", 0) for r in records if r.get("split") == "train") > 0, label

    # The teacher: the pilot's lr is the one of the lowest last dev loss, read from its runs' files.
    def last_dev_loss(run_dir: Path) -> float:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in records if r.get("split") == "dev"][-1]

    pilot = {lr: last_dev_loss(out / "teacher" / "pilot" / f"lr-{lr:g}") for lr in SETTINGS.teacher_pilot_lrs}
    fine_tune = results["teacher"]["fine_tune"]
    assert fine_tune["pilot"]["chosen_lr"] == min(pilot, key=pilot.get)
    teacher_best = out / "teacher" / "fine-tune" / "best"
    for label in labels:  # every run distils the fine-tuned teacher, from the pruned ORIGINAL model
        recipe = (out / "runs" / label / "final" / "recipe.yaml").read_text()
        assert str(teacher_best) in recipe and "mode: adaptive" in recipe
    from safetensors.torch import load_file

    def embedding(directory: Path) -> torch.Tensor:
        weights = load_file(str(next(directory.glob("*.safetensors"))))
        return next(v for k, v in weights.items() if "embed_tokens" in k)

    start = embedding(out / "student-init")
    assert torch.equal(start, embedding(tiny_model_dir)) and not torch.equal(start, embedding(teacher_best))
    # The token cap is the rule applied to the teacher's dev outputs as the predictions file holds them.
    lengths = [
        json.loads(line)["new_tokens"]
        for line in (out / "eval" / "token-cap" / "predictions" / "teacher" / "dolly-dev" / "seed-10.jsonl")
        .read_text()
        .splitlines()
    ]
    cap = results["token_cap"]
    assert cap["rule"] == min(
        SETTINGS.cap_limit, max(SETTINGS.cap_floor, 32 * int(np.ceil(np.quantile(lengths, 0.9) / 32)))
    )
    test_lengths = [
        json.loads(line)["new_tokens"]
        for path in (out / "eval" / "test" / "predictions").glob("*/*/seed-*.jsonl")
        for line in path.read_text().splitlines()
    ]
    assert test_lengths and max(test_lengths) <= cap["cap"]
    # Teacher agreement: the means and differences are agreement.json's rows, bootstrapped again.
    agreement = json.loads((out / "agreement.json").read_text())["sets"]
    for measure in ("fkl", "srkl", "top1"):
        arrays = {
            v.label: {
                name: np.array([[agreement[name][run_label(v, s)][measure]] for s in SETTINGS.train_seeds])
                for name in SETTINGS.test_sets
            }
            for v in (BASE, MTA)
        }
        again = bootstrap_differences(arrays[BASE.label], arrays[MTA.label], replicates=SETTINGS.replicates)
        found = results["agreement"][measure]
        for name in SETTINGS.test_sets:
            assert found["means"][MTA.label][name] == pytest.approx(arrays[MTA.label][name].mean())
            assert found["start"][name] == pytest.approx(np.mean(agreement[name]["pruned-start"][measure]))
        assert found["differences"][AVERAGE]["low"] == pytest.approx(again[AVERAGE].low)
    # Trajectory: mta inspect's values at the aligned pairs, per student.
    inspected = {s["label"]: s for s in json.loads((out / "inspect" / "results.json").read_text())["students"]}
    assert set(inspected) == {"pruned-start", *labels}
    for pair in inspected[run_label(MTA, 2)]["aligned"]:
        name = f"{pair['student']}->{pair['teacher']} {pair['granularity']}"
        values = [inspected[run_label(MTA, s)]["aligned"] for s in SETTINGS.train_seeds]
        expected = np.mean([next(p["cka"] for p in v if p["student"] == pair["student"]) for v in values])
        assert results["trajectory"]["cka"]["means"][MTA.label][name] == pytest.approx(expected)
    # MTA's terms are on in the MTA runs only; the teacher ran once, in the teacher stage.
    for variant in (BASE, MTA):
        records = (out / "runs" / run_label(variant, 1) / "metrics.jsonl").read_text()
        assert ('"loss/dsa"' in records) == (variant is MTA)
    assert (out / "teacher-cache" / "train" / ".mta" / "manifest.json").exists()

    # The means and the differences are the predictions files' numbers, bootstrapped again.
    arrays = {
        v.label: {
            name: np.array([_scores(out, "test", run_label(v, s), name) for s in SETTINGS.train_seeds])
            for name in SETTINGS.test_sets
        }
        for v in (BASE, MTA)
    }
    for variant, per_set in arrays.items():
        assert per_set["dolly"].shape == (2, 2, 2) and per_set["self-inst"].shape == (2, 2, 2)
        for name, values in per_set.items():
            assert results["means"][variant][name] == pytest.approx(values.mean())
    again = bootstrap_differences(arrays[BASE.label], arrays[MTA.label], replicates=SETTINGS.replicates)
    for name in [*SETTINGS.test_sets, AVERAGE]:
        assert results["differences"][name]["estimate"] == pytest.approx(again[name].estimate)
        for key in ("low", "high", "standard_error", "detectable"):
            assert results["differences"][name][key] == pytest.approx(getattr(again[name], key))
    stages = {"prepare", "teacher pilot", "teacher fine-tune", "token cap", "teacher cache", "evaluate test"}
    assert set(results["timings"]) >= stages | {"evaluate dev", "teacher agreement", "trajectory"} | {
        f"train {label}" for label in labels
    }
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert [session["commit"] for session in results["sessions"]] == [commit.strip() or None]

    markdown, picture = write_report(results, out, elapsed_seconds=1.0)
    text = markdown.read_text(encoding="utf-8")
    assert verdict(results["differences"]) in text
    tables = [difference_table(results), teacher_table(results), outcome_table(results["agreement"]["srkl"], ["dolly"])]
    for table in tables:
        for row in table[1][:1]:
            assert "| " + " | ".join(row) + " |" in text
    assert "Trajectory agreement" in text and mechanism_verdict(results) in text
    assert "(inspect/cka-phrase.png)" in text and (out / "inspect" / "cka-phrase.png").exists()
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "results.json").read_text())["differences"] == results["differences"]

    # A second run finds every stage complete: nothing is trained or timed again.
    def stamps() -> dict[str, int]:
        return {
            str(path.relative_to(out)): path.stat().st_mtime_ns
            for label in labels
            for path in (out / "runs" / label).glob("*/config.json")  # final/, best/
        }

    before = stamps()
    second = run_evidence(SETTINGS, out, data_dir=data, teacher=tiny_model_dir, recipe_overrides=OVERRIDES)
    assert second["timings"] == results["timings"]
    assert stamps() == before and len(before) == 2 * len(labels)
    assert second["differences"] == results["differences"]
    assert len(second["sessions"]) == 2 and "2 sessions" in code_source(second["sessions"])

    # The report reads back from the directory alone; other settings are refused, nothing touched.
    back = read_back(out)
    assert back["differences"] == results["differences"] and back["means"] == results["means"]
    with pytest.raises(MtaError, match="recipe_overrides, train_steps differ"):
        run_evidence(
            dataclasses.replace(SETTINGS, train_steps=3),
            out,
            data_dir=data,
            teacher=tiny_model_dir,
            recipe_overrides=(*OVERRIDES, "train.lr=1e-4"),
        )
    assert stamps() == before and read_back(out)["differences"] == results["differences"]


def test_the_mechanism_verdict_calls_for_a_bug_hunt_when_the_layers_did_not_move():
    def trajectory(low: float, high: float) -> dict:
        d = {AVERAGE: {"estimate": (low + high) / 2, "low": low, "high": high}}
        return {"trajectory": {"structure_agreement": {"differences": d}, "cka": {"differences": d}}}

    still = mechanism_verdict(trajectory(-0.01, 0.02))
    assert still.startswith("MTA's terms did not measurably move") and "bug hunt" in still
    assert mechanism_verdict(trajectory(0.01, 0.03)).startswith("MTA's terms moved the aligned layers towards")
    assert "away from" in mechanism_verdict(trajectory(-0.03, -0.01))
    mixed = trajectory(0.01, 0.03)
    mixed["trajectory"]["cka"] = {"differences": {AVERAGE: {"estimate": -0.02, "low": -0.03, "high": -0.01}}}
    assert "one measure towards the teacher's and one away" in mechanism_verdict(mixed)


def test_verdict_states_the_sign_plainly():
    def difference(estimate: float, low: float, high: float) -> dict:
        return {AVERAGE: {"estimate": estimate, "low": low, "high": high, "detectable": 1.5}}

    assert verdict(difference(1.0, 0.2, 1.8)).startswith("MTA helps")
    assert verdict(difference(-1.0, -1.8, -0.2)).startswith("MTA hurts")
    neither = verdict(difference(0.3, -0.5, 1.1))
    assert neither.startswith("No difference detected") and "1.50" in neither


def test_the_plan_names_every_run_and_fits_the_budget():
    settings = EvidenceSettings.full()
    assert len(settings.train_seeds) >= 3 and len(settings.runs()) == 2 * len(settings.train_seeds)
    assert settings.train_steps >= 512 and settings.batch_size == 8 and settings.eval_rows >= 200
    # Interleaved by seed, so a stopped run leaves both variants equally far.
    assert [v for v, _ in settings.runs()[:2]] == [BASE, MTA]
    text = "\n".join(plan_lines(settings, precision="bf16", vllm=True))
    assert f"{len(settings.runs())} runs of {settings.train_steps} steps" in text
    assert "ORIGINAL" in text and "adaptive" in text and "DOES NOT FIT" not in text
    # The budget is the development machine's, where auto means bf16 (the tests run fp32), with
    # the vLLM engine installed (make evidence installs it); cut as the plan says, it fits 8 hours.
    cut, cuts, fits = fit_budget(settings, precision="bf16", vllm=True)
    assert fits and sum(cut.estimated_seconds(vllm=True, precision="bf16").values()) <= 8 * 3600
    assert cut.train_seeds == settings.train_seeds and cut.train_steps == settings.train_steps
    # Selection passes fall on the runs' checkpoints; the step count is a whole number of them.
    assert settings.train_steps % settings.eval_interval == 0


def test_the_budget_cuts_the_cap_first_then_rows_never_seeds():
    over = dataclasses.replace(EvidenceSettings.full(), budget_hours=1.0)
    cut, cuts, fits = fit_budget(over, precision="bf16", vllm=False)
    assert not fits and cut.train_seeds == over.train_seeds
    kinds = [c.split(" ")[0] for c in cuts]  # "token" cuts, then "rows" cuts, none after a rows cut
    assert kinds == sorted(kinds, key=lambda k: k != "token") and "token" in kinds and "rows" in kinds
    assert cut.planned_cap() == over.cap_floor and cut.eval_rows == over.rows_floor
    roomy = dataclasses.replace(EvidenceSettings.full(), budget_hours=100.0)
    assert fit_budget(roomy, precision="bf16", vllm=False) == (roomy, [], True)


def test_a_design_over_its_budget_is_refused_before_anything_is_written(tmp_path):
    over = dataclasses.replace(SETTINGS, budget_hours=1e-6)
    with pytest.raises(MtaError, match="exceeds its budget"):
        run_evidence(over, tmp_path / "evidence", data_dir=tmp_path)
    assert not (tmp_path / "evidence").exists()


def test_the_worst_case_sampling_share_matches_a_step_by_step_count():
    settings = dataclasses.replace(EvidenceSettings.full(), init_threshold=0.05, threshold_step=0.3)
    tau, generated = settings.init_threshold, 0.0
    for step in range(settings.train_steps):  # τ raised at every evaluation after step 0
        if step and step % settings.eval_interval == 0:
            tau += settings.threshold_step
        generated += min(tau, 1.0)
    assert generated_micro_batches(settings) == pytest.approx(generated)


def test_the_token_cap_rounds_the_quantile_up_within_its_limits():
    lengths = [10, 20, 30, 40, 50, 60, 70, 80, 90, 300]
    assert (
        cap_from_lengths(lengths, quantile=0.9, limit=256, floor=64) == 128
    )  # its 0.9 quantile, 111, rounded up to 32
    assert cap_from_lengths([5] * 10, quantile=0.9, limit=256, floor=64) == 64
    assert cap_from_lengths([400] * 10, quantile=0.9, limit=256, floor=64) == 256
    with pytest.raises(ValueError):
        cap_from_lengths([], quantile=0.9, limit=256, floor=64)


def test_make_n_evidence_prints_the_plan():
    # A checkout without its own .venv (a git worktree) plans with the environment running the tests.
    venv = [] if (REPO / ".venv" / "bin" / "mta").exists() else [f"VENV={Path(sys.executable).parents[1]}"]
    made = subprocess.run(["make", "-n", "evidence", *venv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    printed = made.stdout + made.stderr
    assert "6 runs of 512 steps" in printed and "estimate:" in printed and "fine-tuned" in printed


def test_a_first_design_directory_is_refused_and_left_as_it_was(tmp_path):
    root = tmp_path / "evidence"
    root.mkdir()
    first = {"layout": 1, "train_steps": 128, "train_seeds": [1, 2, 3, 4]}
    (root / "demo.json").write_text(json.dumps(first))
    with pytest.raises(MtaError, match="layout"):
        run_evidence(SETTINGS, root, data_dir=tmp_path)
    with pytest.raises(MtaError, match="layout 1"):
        read_back(root)
    assert json.loads((root / "demo.json").read_text()) == first and sorted(p.name for p in root.iterdir()) == [
        "demo.json"
    ]


def test_a_stage_stopped_midway_keeps_its_time_and_a_reused_one_adds_none(tmp_path):
    paths = EvidencePaths(tmp_path)

    def stopped() -> None:
        time.sleep(0.05)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        timed_stage(paths, "train x", stopped, done=False)
    first = json.loads(paths.timings.read_text())["train x"]
    assert first >= 0.05
    assert timed_stage(paths, "train x", lambda: time.sleep(0.02) or "ran", done=False) == "ran"
    second = json.loads(paths.timings.read_text())["train x"]
    assert second >= first + 0.02
    timed_stage(paths, "train x", lambda: time.sleep(0.02), done=True)
    assert json.loads(paths.timings.read_text()) == {"train x": second}


def test_the_report_names_every_commit_its_sessions_ran():
    one = {"started": "2026-12-02T05:00:00Z", "commit": "a" * 40, "dirty": False}
    assert code_source([one]) == f"commit {'a' * 12} (1 session, the first started 2026-12-02T05:00:00Z)"
    other = {"started": "2026-12-02T07:00:00Z", "commit": "b" * 40, "dirty": True}
    text = code_source([one, dict(one, started="2026-12-02T06:00:00Z"), other])
    assert text.startswith(f"commit {'a' * 12}, {'b' * 12} with uncommitted changes (3 sessions")


@pytest.mark.parametrize(
    ("stop", "code", "says"),
    [
        (KeyboardInterrupt(), 130, "interrupted: every finished stage is kept in"),
        ("SIGTERM", 143, "stopped by SIGTERM after step 69: saved ckpt/step-69; every finished stage"),
        ("SIGUSR1", 75, "stopped by SIGUSR1 after step 69"),
    ],
)
def test_a_demo_stopped_midway_says_so_in_one_line_with_its_exit_code(tmp_path, capsys, stop, code, says):
    import typer

    from mta.training.lifecycle.stopping import RunStopped
    from mta_cli.results import run_demo_command

    def run(reporter):
        raise stop if isinstance(stop, BaseException) else RunStopped(stop, step=69, checkpoint=Path("ckpt/step-69"))

    def never(*args):
        raise AssertionError("no report for a stopped run")

    with pytest.raises(typer.Exit) as ended:
        run_demo_command("mta demo --evidence", 60.0, tmp_path, run, never, never)
    assert ended.value.exit_code == code
    stderr = " ".join(capsys.readouterr().err.split())
    assert says in stderr and "Traceback" not in stderr


def test_a_directory_of_other_settings_is_refused_naming_them_and_left_as_it_was(tmp_path):
    from mta.demo.pipeline import claim_demo_directory
    from mta.reporting import SilentReporter

    root = tmp_path / "evidence"
    claim_demo_directory(root, {"train_steps": 128, "seeds": (1, 2), "teacher": None}, SilentReporter(), restart=False)
    (root / "runs").mkdir()
    (root / "runs" / "kept.txt").write_text("hours of runs")
    stamp = (root / "demo.json").read_text()
    # The same settings continue (tuples and lists are one thing once written).
    claim_demo_directory(root, {"train_steps": 128, "seeds": [1, 2], "teacher": None}, SilentReporter(), restart=False)
    with pytest.raises(MtaError, match=r"holds a run of other settings \(teacher, train_steps differ"):
        claim_demo_directory(root, {"train_steps": 3, "seeds": (1, 2), "teacher": "t"}, SilentReporter(), restart=False)
    assert (root / "runs" / "kept.txt").read_text() == "hours of runs" and (root / "demo.json").read_text() == stamp
