"""Plan, then build (issue 45): ``mta distill --dry-run`` prints the plan the run builds from, and
the restructured run behaves as the run before it (the golden baselines of ``tests/golden.py``,
recorded from the code before the refactor)."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re

import pytest

import golden
from mta.training.config.loading import load_recipe
from mta.training.dry_run import plan_run

pytestmark = pytest.mark.usefixtures("one_thread")


def _differences(recorded, now, where="plan") -> list[str]:
    """Where ``now`` differs from ``recorded`` on the keys ``recorded`` has (a key the plan gained
    since is not a difference); floats to a relative 1e-5."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        return [
            line
            for key, value in recorded.items()
            for line in (_differences(value, now[key], f"{where}.{key}") if key in now else [f"{where}.{key} is gone"])
        ]
    if isinstance(recorded, list) and isinstance(now, list) and len(recorded) == len(now):
        return [
            line
            for i, (a, b) in enumerate(zip(recorded, now, strict=True))
            for line in _differences(a, b, f"{where}[{i}]")
        ]
    if isinstance(recorded, float) and isinstance(now, float):
        return [] if math.isclose(recorded, now, rel_tol=1e-5, abs_tol=1e-7) else [f"{where}: {recorded} -> {now}"]
    return [] if recorded == now else [f"{where}: {recorded!r} -> {now!r}"]


def _sourceless(plan):
    """``plan`` without where its models' configs were read."""
    models = {role: getattr(plan, role) for role in ("student", "teacher")}
    return dataclasses.replace(
        plan, **{role: dataclasses.replace(m, config_source="") for role, m in models.items() if m is not None}
    )


def test_the_comparison_sees_a_changed_value_a_lost_key_and_ignores_a_new_one():
    recorded = {"a": 1.0, "b": {"c": [1, 2]}, "d": "x"}
    assert _differences(recorded, {**recorded, "new": 3}) == []
    assert _differences(recorded, {**recorded, "a": 1.01}) == ["plan.a: 1.0 -> 1.01"]
    assert _differences(recorded, {"a": 1.0, "b": {"c": [1, 3]}}) == ["plan.b.c[1]: 2 -> 3", "plan.d is gone"]


def test_every_shipped_recipe_plans_as_recorded_before_the_refactor(monkeypatch):
    for name, value in golden.PLAN_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    for name in golden.UNSET_FOR_PLANS:
        monkeypatch.delenv(name, raising=False)
    recorded = json.loads((golden.GOLDEN / "dry-run-plans.json").read_text(encoding="utf-8"))
    paths = golden.shipped_recipe_paths()
    assert sorted(path.stem for path in paths) == sorted(recorded), "a shipped recipe without a recorded plan"
    for path in paths:
        assert _differences(recorded[path.stem], golden.recorded_plan(path), path.stem) == []


@pytest.mark.parametrize("name", sorted(golden.TINY_RUNS))
def test_a_tiny_run_logs_the_recorded_metrics_and_was_built_from_its_dry_run_plan(tmp_path, monkeypatch, name):
    """The run's metrics equal the recorded ones to float tolerance; the plan the run was built
    from is the plan ``--dry-run`` prints for the same recipe (once its tiny models exist)."""
    from mta.training import trainer

    built = []
    real = trainer.Trainer

    class Recording(real):
        def __init__(self, run, *args, **kwargs):
            built.append(run.plan)
            super().__init__(run, *args, **kwargs)

    monkeypatch.setattr(trainer, "Trainer", Recording)
    records = golden.tiny_run_metrics(name, tmp_path / name)
    recorded = json.loads((golden.GOLDEN / f"{name}-metrics.json").read_text(encoding="utf-8"))
    assert len(records) == len(recorded)
    assert _differences(recorded, records, name) == []

    recipe = load_recipe(
        golden.REPO / "recipes" / "tiny.yaml", [*golden.TINY_RUNS[name], f"output_dir={tmp_path / name}"]
    )
    # Equal but for where each config was read: the built tiny model's directory, or its description.
    assert [_sourceless(plan) for plan in built] == [_sourceless(plan_run(recipe))]
    assert built[0].off_policy == ("adaptive" if "off-policy" in name else "off")
    assert built[0].teacher_source == "online"


def test_a_run_plans_from_the_models_it_loaded_a_dry_run_from_their_stand_ins(tmp_path):
    """A recipe's ``<role>.config`` stands in for its model offline; the run plans from the
    model it loaded (a tiny model here in place of the JSON of a 10-layer SmolLM2)."""
    from mta.training.dry_run import tiny_config
    from mta.training.llm.plan import plan_llm_run

    recipe = load_recipe(
        golden.REPO / "recipes" / "tiny.yaml",
        [f"output_dir={tmp_path}", "student.config=configs/smollm2-135m-10layers.json"],
    )
    assert plan_run(recipe).student.num_layers == 10
    loaded = {"student": (tiny_config(recipe.student.tiny), "runs/x/models/student-abc")}
    plan = plan_llm_run(recipe, 1, loaded)
    assert (plan.student.num_layers, plan.student.hidden_size) == (4, 32)
    assert plan.student.config_source == "runs/x/models/student-abc"
    assert [(p.student, p.teacher) for p in plan.layers] == [(2, 2), (3, 3), (4, 4)]


def test_golden_paths_are_portable(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert golden.portable(str(golden.REPO / "recipes" / "x.yaml")) == "<repo>/recipes/x.yaml"
    assert golden.portable([str(tmp_path / "a")]) == ["<cwd>/a"]


def test_the_dry_run_prints_what_the_run_builds_from(tmp_path):
    """The plan's FDD and SRA pairs, the teacher's side and the off-policy settings are printed,
    not only held."""
    from rich.console import Console

    from mta_cli.dry_run_tables import render_plan

    overrides = [
        f"output_dir={tmp_path}",
        "loss.fdd_weight=1",
        "off_policy.mode=adaptive",
        "off_policy.max_new_tokens=9",
    ]
    plan = plan_run(load_recipe(golden.REPO / "recipes" / "tiny.yaml", overrides))
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render_plan(plan))
    text = console.export_text()
    assert [(p.student, p.teacher) for p in plan.fdd_layers] == [(1, 1), (2, 2), (3, 3)]
    assert "FDD layer pairs" in text and "SRA layer pairs" not in text
    assert re.search(r"teacher's side from +│ online", text)
    assert "adaptive, up to 9 new tokens" in text
