"""The paper's table as make targets: `make -n` plans every row and the ablations, and every
planned `mta distill` command is a valid recipe with its overrides (validated offline)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from mta.training.config.catalog import find_recipe
from mta.training.config.loading import load_recipe
from mta.training.config.schema import LayerPair

REPO = Path(__file__).resolve().parents[1]
ROWS = [
    "gpt2-fdd",
    "gpt2-distillm",
    "gpt2-distillm2",
    "qwen-fdd",
    "qwen-distillm",
    "qwen-distillm2",
    "opt-fdd",
    "opt-distillm",
]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def plan(target: str, *variables: str) -> list[list[str]]:
    """The commands ``make -n TARGET`` prints (continuation lines joined), as argument lists;
    the install step is taken as done."""
    out = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", target, "MTA=mta", "MTA_DATA_DIR=/data", *variables],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [shlex.split(line) for line in out.replace("\\\n", " ").splitlines() if line.strip()]


def distill_runs(commands: list[list[str]]) -> list[tuple[str, list[str]]]:
    runs = []
    for words in commands:
        if words[:2] == ["mta", "distill"]:
            recipe = words[words.index("--recipe") + 1]
            assert words[words.index("--resume") + 1] == "auto"  # a re-run continues, never restarts
            runs.append((recipe, [w for w in words[2:] if "=" in w and not w.startswith("-")]))
    return runs


def recipe_of(name: str, overrides: list[str]):
    return load_recipe(find_recipe(name).path, overrides)


def overrides_dict(overrides: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in overrides)


def test_reproduce_all_plans_sixteen_valid_runs_two_per_row():
    commands = plan("reproduce-all")
    runs = distill_runs(commands)
    assert len(runs) == 16
    outputs = [overrides_dict(o)["output_dir"] for _, o in runs]
    assert len(set(outputs)) == 16
    for row in ROWS:
        base, mta = [(r, o) for r, o in runs if overrides_dict(o)["output_dir"].startswith(f"runs/{row}/")]
        assert base[0] == mta[0]  # the same recipe, the same start
        base_recipe, mta_recipe = recipe_of(*base), recipe_of(*mta)
        assert (base_recipe.loss.dsa_weight, base_recipe.loss.hra_weight) == (0.0, 0.0)
        assert mta_recipe.loss.dsa_weight > 0 and mta_recipe.loss.hra_weight > 0
        assert base_recipe.student == mta_recipe.student and base_recipe.seed == mta_recipe.seed
        assert mta_recipe.train.select_by == "rouge"
        # Both best/ checkpoints are evaluated, in one comparison, base first.
        evaluate = next(w for w in commands if w[:2] == ["mta", "evaluate"] and f"runs/{row}/base/best" in w)
        assert evaluate.index(f"runs/{row}/base/best") < evaluate.index(f"runs/{row}/mta/best")
    # DistiLLM-2's rows train on the pairs `mta generate` wrote, annotated.
    for row in ("gpt2-distillm2", "qwen-distillm2"):
        generate = next(w for w in commands if w[:2] == ["mta", "generate"] and f"runs/{row}/pairs/train.jsonl" in w)
        assert "--teacher" in generate and "--student" in generate
        assert any(w[:2] == ["mta", "annotate"] and w[2] == f"runs/{row}/pairs/train.jsonl" for w in commands)


def test_the_earlier_names_are_the_distillm_rows():
    for pair in ("gpt2", "qwen", "opt"):
        assert plan(f"reproduce-{pair}") == plan(f"reproduce-{pair}-distillm")


# What the authors' + MTA scripts set, per row (wind123mountain/MTA distillm-master/scripts/
# {gpt2,qwen1.5,opt}/{spanfdd,spandistillm}/*.sh, distillm-2-master/training_configs/*-span-*.yaml):
# base, FDD pairs and temperature, (lambda_DSA, lambda_HRA), the MTA map, lr, LoRA.
GPT2_MAP = [(6, 24, "word"), (9, 36, "phrase"), (12, 48, "phrase")]
QWEN_MAP = [(14, 14, "word")] + [(layer, layer, "phrase") for layer in (16, 18, 20, 22, 24)]
OPT_MAP = [(16, 20, "word"), (18, 23, "phrase"), (20, 26, "phrase"), (22, 29, "phrase"), (24, 32, "phrase")]
ROW_SETTINGS = {
    "gpt2-fdd": (
        "srkl",
        [(4, 16), (6, 24), (8, 32)],
        2.0,
        (2.0, 0.2),
        [(4, 16, "word"), (6, 24, "phrase"), (8, 32, "phrase")],
        1e-4,
        False,
    ),
    "gpt2": ("srkl", None, None, (2.0, 0.2), GPT2_MAP, 1e-4, False),
    "gpt2-distillm2": ("distillm2", None, None, (2.0, 0.2), GPT2_MAP, 1e-4, False),
    "qwen-fdd": (
        "srkl",
        [(4, 4), (8, 8), (16, 16)],
        2.0,
        (2.0, 0.2),
        [(4, 4, "word"), (8, 8, "phrase"), (16, 16, "phrase")],
        1e-4,
        False,
    ),
    "qwen": ("srkl", None, None, (2.0, 0.2), QWEN_MAP, 1e-4, False),
    "qwen-distillm2": ("distillm2", None, None, (2.0, 0.2), QWEN_MAP, 5e-5, False),
    "opt-fdd": ("srkl", [(16, 20), (18, 23), (20, 26), (22, 29), (24, 32)], 2.0, (2.0, 0.2), OPT_MAP, 5e-4, True),
    "opt": ("srkl", None, None, (3.0, 0.3), OPT_MAP, 5e-4, True),
}


@pytest.mark.parametrize("name", sorted(ROW_SETTINGS))
def test_each_rows_recipe_carries_the_authors_settings(name):
    base, fdd_pairs, fdd_temperature, weights, layers, lr, lora = ROW_SETTINGS[name]
    recipe = recipe_of(name, [])
    loss = recipe.loss
    assert loss.base == base and (loss.dsa_weight, loss.hra_weight) == weights
    assert loss.layers == [LayerPair(student=s, teacher=t, granularity=g) for s, t, g in layers]
    if fdd_pairs is None:
        assert loss.fdd_weight == 0
    else:
        assert loss.fdd_weight == 1.0 and loss.fdd_temperature == fdd_temperature
        assert [(p.student, p.teacher) for p in loss.fdd_layers] == fdd_pairs
        assert not loss.fdd_final_norm and loss.fdd_tokens == "all"  # raw states, every real token
    assert recipe.train.lr == lr and (recipe.student.lora is not None) == lora
    assert recipe.off_policy.mode == ("off" if base == "distillm2" else "adaptive")
    assert (recipe.data.max_length, recipe.data.max_prompt_length) == (256, 128)


def test_the_ablation_targets_plan_five_runs_beside_the_rows_two():
    runs = distill_runs(plan("ablation-gpt2"))
    assert len(runs) == 7
    ablations = {
        overrides_dict(o)["output_dir"].rsplit("/", 1)[-1]: recipe_of(r, o)
        for r, o in runs
        if "/ablation-gpt2-paper/" in overrides_dict(o)["output_dir"]
    }
    full = recipe_of("gpt2", [])
    assert sorted(ablations) == sorted(["hra-only", "dsa-only", "all-word", "all-phrase", "uniform-weights"])
    assert ablations["hra-only"].loss.dsa_weight == 0 and ablations["hra-only"].loss.hra_weight == 0.2
    assert ablations["dsa-only"].loss.hra_weight == 0 and ablations["dsa-only"].loss.dsa_weight == 2.0
    assert {p.granularity for p in ablations["all-word"].loss.layers} == {"word"}
    assert {p.granularity for p in ablations["all-phrase"].loss.layers} == {"phrase"}
    assert [(p.student, p.teacher) for p in ablations["all-word"].loss.layers] == [
        (p.student, p.teacher) for p in full.loss.layers
    ]
    assert ablations["uniform-weights"].loss.importance == "uniform"
    assert not any(recipe.loss.reference_code for recipe in ablations.values())
    # The authors' semantics on request: their loss code and span rule, uniform pair and token
    # weights in all five, beside a full run of their code, on annotations of their rule.
    commands = plan("ablation-gpt2", "ABLATION=reference")
    runs = {
        overrides_dict(o)["output_dir"].rsplit("/", 1)[-1]: recipe_of(r, o)
        for r, o in distill_runs(commands)
        if "/ablation-gpt2-reference/" in overrides_dict(o)["output_dir"]
    }
    assert sorted(runs) == sorted([*ablations, "full"])
    for name, recipe in runs.items():
        assert recipe.loss.reference_code and recipe.data.span_rule == "reference"
        assert recipe.loss.importance == ("attention" if name == "full" else "uniform")
        assert recipe.data.train == "runs/ablation-gpt2-reference/annotations/train"
    assert ["--span-rule", "reference"] == next(
        w for w in commands if w[:2] == ["mta", "annotate"] and "--span-rule" in w
    )[-4:-2]


def test_reproduce_all_runs_the_teacher_once_per_teacher_and_data_set_and_says_which_rows_load_it():
    commands = plan("reproduce-all")
    stages = [words for words in commands if words[:2] == ["mta", "teacher"]]
    caches = {words[words.index("-o") + 1]: words for words in stages}
    # GPT-2, Qwen and OPT on Dolly; GPT-2 and Qwen on their DistiLLM-2 pairs: five passes, eight rows.
    assert sorted(caches) == sorted(f"runs/{row}/teacher" for row in ROWS if not row.endswith("-fdd"))
    for row in ROWS:
        runs = [o for _, o in distill_runs(commands) if overrides_dict(o)["output_dir"].startswith(f"runs/{row}/")]
        read = {overrides_dict(o).get("teacher_cache.dir") for o in runs}
        assert read == ({None} if row.endswith("-fdd") else {f"runs/{row}/teacher"}), row
        said = next(" ".join(w) for w in commands if w[:1] == ["echo"] and w[1].startswith(f"reproduce-{row}:"))
        if row.endswith("-fdd"):
            assert "loads the teacher for every micro batch (FDD needs it online)" in said
        elif row.endswith("-distillm2"):
            assert "never loads the teacher" in said
        else:
            assert "loads the teacher for its generated micro batches only" in said
    # The cache each row reads is the one its stage built for the same recipe and rows.
    for words in stages:
        data = {w for w in words if w.startswith("data.")}
        readers = [o for _, o in distill_runs(commands) if f"teacher_cache.dir={words[words.index('-o') + 1]}" in o]
        assert len(readers) == 2 and all(data <= set(o) for o in readers)
    assert not [w for w in plan("reproduce-all", "TEACHER=online") if w[:2] == ["mta", "teacher"]]
    ablations = distill_runs(plan("ablation-gpt2"))
    paper = [o for _, o in ablations if "/ablation-gpt2-paper/" in overrides_dict(o)["output_dir"]]
    assert all(overrides_dict(o)["teacher_cache.dir"] == "runs/gpt2-distillm/teacher" for o in paper)
