"""`make ablation-embed` (mta.embedding.ablation): the plan, never run here. Every planned run is a
valid TALAS recipe changing one thing of the full objective (or a reference: the plain cosine, the
author's code), three seeds each at two budgets, the time estimate within 30 minutes, dev and
held-out texts apart, and the choices made on dev only."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mta.embedding.ablation import (
    AUTHOR,
    COSINE,
    DEV_CHOICE,
    FACTORS,
    FULL,
    LONG_VARIANTS,
    VARIANTS,
    AblationSettings,
    copy_rows,
    dev_choice_variant,
    estimated_seconds,
    plan_lines,
    planned_runs,
    run_label,
    summarise,
    table,
    variant_runs,
)
from mta.embedding.demo import START_LABEL, TALAS_RECIPE
from mta.training.config.loading import load_recipe

REPO = Path(__file__).resolve().parents[1]


def flat(mapping: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in mapping.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def dumps_of(runs) -> dict[str, dict]:
    return {label: flat(load_recipe(TALAS_RECIPE, overrides).model_dump(mode="json")) for label, overrides in runs}


def changed(dump: dict, full: dict) -> set[str]:
    return {key for key in full if dump[key] != full[key]} - {"output_dir", "source"}


def test_each_run_is_a_talas_recipe_changing_one_thing_of_the_full_objective():
    settings = AblationSettings()
    runs = planned_runs(settings, "runs/ablation-embed")
    assert len(runs) == (len(VARIANTS) + len(LONG_VARIANTS)) * 3 and settings.seeds == (1, 2, 3)
    dumps = dumps_of(runs)
    full = dumps[run_label(24, FULL, 1)]
    assert full["train.asam"] is None and full["student.pooling"] == "mean" and full["loss.tamd_layers"] == 2
    assert full["train.max_steps"] == 24 and dumps[run_label(96, FULL, 1)]["train.max_steps"] == 96
    assert settings.long_steps * settings.batch_size == settings.train_texts  # each text at most once
    expected = {
        "no-simcse": {"loss.simcse_weight": 0.0},
        "tamd-top1": {"loss.tamd_layers": 1},
        "lasd-detached": {"loss.lasd_detach": True},
        "lasd-0.1": {"loss.lasd_weight": 0.1},
        "cls-attention": {"student.pooling": "cls_attention"},
        COSINE: {"loss.simcse_weight": 0.0, "loss.lasd_weight": 0.0, "loss.tamd_weight": 1.0, "loss.tamd_layers": 1},
        AUTHOR: {"loss.reference_code": True, "student.pooling": "cls_attention"},
    }
    assert set(expected) | {FULL} == {variant.name for variant in VARIANTS}
    for name, changes in expected.items():
        dump = dumps[run_label(24, name, 1)]
        assert changed(dump, full) == set(changes), name
        assert all(dump[key] == value for key, value in changes.items()), name
    for name in LONG_VARIANTS:  # the long budget: the same recipe, four times the steps
        assert changed(dumps[run_label(96, name, 2)], dumps[run_label(24, name, 2)]) == {
            "train.max_steps",
            "train.log_interval",
            "train.save_interval",
            "train.eval_interval",
        }
    outputs = {dump["output_dir"] for dump in dumps.values()}
    assert len(outputs) == len(runs)  # every run its own directory
    assert {dump["seed"] for label, dump in dumps.items() if f"/{FULL}/" in label} == {1, 2, 3}


def test_the_estimate_is_within_30_minutes_and_the_plan_says_what_runs():
    settings = AblationSettings()
    assert estimated_seconds(settings) <= 30 * 60
    text = "\n".join(plan_lines(settings))
    assert "36 runs" in text and "dev rows 200-399" in text and "held-out: Dolly dev rows 0-199" in text
    assert "24 steps (demo-embed's budget)" in text and "96 steps: cosine, talas, author-code and dev-choice" in text
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


def proxy(rho: float) -> dict:
    return {"spearman": rho, "recall@1": rho / 2, "recall@10": rho}


def simulated(settings: AblationSettings, better_on_dev: set[str]) -> dict:
    """Dev and held-out scores where ``better_on_dev`` win on dev and lose on held-out."""
    dev, held = {START_LABEL: proxy(0.3)}, {START_LABEL: proxy(0.35)}
    names = [(24, v.name) for v in VARIANTS] + [(96, name) for name in (*LONG_VARIANTS, DEV_CHOICE)]
    for steps, name in names:
        for seed in settings.seeds:
            label = run_label(steps, name, seed)
            dev[label] = proxy(0.5 if name in better_on_dev else 0.4)
            held[label] = proxy((0.3 if name in better_on_dev else 0.45) + (0.1 if name == COSINE else 0.0))
    return {"dev": dev, "held-out": held}


def test_the_choices_are_made_on_dev_not_on_the_held_out_texts():
    settings = AblationSettings()
    results = summarise(simulated(settings, {"lasd-0.1"}), settings, dev_choice=True)
    assert results["choices"]["LASD weight"]["chosen_on_dev"] == "lasd-0.1"
    assert results["choices"]["LASD weight"]["held_out_spearman"] == pytest.approx(0.3)
    assert results["choices"]["SimCSE"]["chosen_on_dev"] == FULL  # ties keep the full objective
    short = results["summary"]["24-steps"]
    assert short["lasd-0.1"]["held-out"]["spearman_vs_talas"]["mean"] == pytest.approx(-0.15)
    assert short[FULL]["held-out"]["spearman_vs_cosine"]["mean"] == pytest.approx(-0.1)
    assert set(results["summary"]["96-steps"]) == {*LONG_VARIANTS, DEV_CHOICE}
    header, body = table({**results, "variants": {v.name: {"factor": v.factor} for v in VARIANTS}})
    assert len(body) == len(VARIANTS) + len(LONG_VARIANTS) + 2 and all(len(row) == len(header) for row in body)
    chosen_column = {row[1]: row[-1] for row in body if row[0] == "24"}
    assert chosen_column["lasd-0.1"] == "yes" and chosen_column["no-simcse"] == "no" and chosen_column[COSINE] == "-"


def test_the_dev_choice_combines_every_part_dev_chose_and_is_left_out_when_that_is_talas():
    settings = AblationSettings()
    results = summarise(simulated(settings, {"lasd-0.1", "tamd-top1"}), settings)
    choice = dev_choice_variant(results["choices"])
    assert choice is not None and set(choice.overrides) == {"loss.lasd_weight=0.1", "loss.tamd_layers=1"}
    dump = dumps_of(variant_runs(choice, 96, settings, Path("runs/ablation-embed")))[run_label(96, DEV_CHOICE, 1)]
    assert dump["loss.lasd_weight"] == 0.1 and dump["loss.tamd_layers"] == 1 and dump["train.max_steps"] == 96
    assert dev_choice_variant(summarise(simulated(settings, set()), settings)["choices"]) is None
    assert {variant.factor for variant in FACTORS} == set(results["choices"])


def test_the_script_prints_the_plan_and_runs_nothing(tmp_path):
    out = tmp_path / "ablation"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "ablation_embed.py"), "--plan", "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert "36 runs" in done.stdout and "min on a 2-core CPU" in done.stdout
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
