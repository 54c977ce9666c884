"""`make ablation-embed` (mta.embedding.ablation): the plan, never run here. Every planned run is a
valid TALAS recipe changing one thing of the full objective, three seeds each, the time estimate
within 30 minutes, dev and held-out texts apart, and the choices made on dev only."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mta.embedding.ablation import (
    FULL,
    VARIANTS,
    AblationSettings,
    copy_rows,
    estimated_seconds,
    plan_lines,
    planned_runs,
    summarise,
    table,
)
from mta.embedding.demo import START_LABEL, TALAS_RECIPE
from mta.training.config.loading import load_recipe

REPO = Path(__file__).resolve().parents[1]


def flat(mapping: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in mapping.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def test_each_run_is_a_talas_recipe_changing_one_thing_of_the_full_objective():
    settings = AblationSettings()
    runs = dict(planned_runs(settings, "runs/ablation-embed"))
    assert len(runs) == len(VARIANTS) * 3 and settings.seeds == (1, 2, 3)
    dumps = {
        label: flat(load_recipe(TALAS_RECIPE, overrides).model_dump(mode="json")) for label, overrides in runs.items()
    }
    full = dumps[f"{FULL}/seed-1"]
    assert full["train.asam"] is None and full["student.pooling"] == "mean" and full["loss.tamd_layers"] == 2
    assert full["train.max_steps"] * full["train.batch_size"] == settings.train_texts  # each text once
    expected = {
        "no-simcse": {"loss.simcse_weight": 0.0},
        "tamd-top1": {"loss.tamd_layers": 1},
        "lasd-detached": {"loss.lasd_detach": True},
        "lasd-0.1": {"loss.lasd_weight": 0.1},
        "cls-attention": {"student.pooling": "cls_attention"},
    }
    assert set(expected) | {FULL} == {variant.name for variant in VARIANTS}
    for name, changes in expected.items():
        dump = dumps[f"{name}/seed-1"]
        differs = {key for key in full if dump[key] != full[key]} - {"output_dir", "source"}
        assert differs == set(changes), name
        assert all(dump[key] == value for key, value in changes.items()), name
    outputs = {dump["output_dir"] for dump in dumps.values()}
    assert len(outputs) == len(runs)  # every run its own directory
    assert {dump["seed"] for label, dump in dumps.items() if label.startswith(FULL)} == {1, 2, 3}


def test_the_estimate_is_within_30_minutes_and_the_plan_says_what_runs():
    settings = AblationSettings()
    assert estimated_seconds(settings) <= 30 * 60
    text = "\n".join(plan_lines(settings))
    assert "18 runs" in text and "dev rows 200-399" in text and "held-out: Dolly dev rows 0-199" in text
    assert f"about {estimated_seconds(settings) / 60:.0f} min" in text


def test_dev_and_held_out_rows_are_apart(tmp_path):
    source = tmp_path / "dev.jsonl"
    source.write_text("".join(json.dumps({"instruction": f"row {i}"}) + "\n" for i in range(500)))
    copy_rows(source, tmp_path / "held-out.jsonl", 0, 200)
    copy_rows(source, tmp_path / "dev-split.jsonl", 200, 200)
    held = (tmp_path / "held-out.jsonl").read_text().splitlines()
    dev = (tmp_path / "dev-split.jsonl").read_text().splitlines()
    assert len(held) == len(dev) == 200 and not set(held) & set(dev)
    assert json.loads(dev[0])["instruction"] == "row 200"


def test_the_choices_are_made_on_dev_not_on_the_held_out_texts():
    settings = AblationSettings()

    def proxy(rho):
        return {"spearman": rho, "recall@1": rho / 2, "recall@10": rho}

    dev, held = {START_LABEL: proxy(0.3)}, {START_LABEL: proxy(0.35)}
    for variant in VARIANTS:
        for seed in settings.seeds:
            label = f"{variant.name}/seed-{seed}"
            better_on_dev = variant.name == "lasd-0.1"
            dev[label] = proxy(0.5 if better_on_dev else 0.4)
            held[label] = proxy(0.3 if better_on_dev else 0.45)  # ... and worse on held-out
    results = summarise({"dev": dev, "held-out": held}, settings)
    assert results["choices"]["LASD weight"]["chosen_on_dev"] == "lasd-0.1"
    assert results["choices"]["LASD weight"]["held_out_spearman"] == pytest.approx(0.3)
    assert results["choices"]["SimCSE"]["chosen_on_dev"] == FULL  # ties keep the full objective
    assert results["summary"]["lasd-0.1"]["held-out"]["spearman_vs_full"]["mean"] == pytest.approx(-0.15)
    header, body = table({**results, "variants": {v.name: {"factor": v.factor} for v in VARIANTS}})
    assert len(body) == len(VARIANTS) + 1 and all(len(row) == len(header) for row in body)


def test_the_script_prints_the_plan_and_runs_nothing(tmp_path):
    out = tmp_path / "ablation"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "ablation_embed.py"), "--plan", "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert "18 runs" in done.stdout and "min on a 2-core CPU" in done.stdout
    assert not out.exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_n_ablation_embed_names_the_script():
    def planned(*variables):
        return subprocess.run(
            [
                "make",
                "--no-print-directory",
                "-n",
                "-o",
                ".venv/.installed",
                "-o",
                ".venv/.installed-embed",
                "ablation-embed",
                *variables,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()

    assert planned()[-1] == "bench/ablation_embed.py"
    assert planned("PLAN=1")[-2:] == ["bench/ablation_embed.py", "--plan"]
