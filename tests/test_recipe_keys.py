"""The recipe-key reference (`mta recipes keys`, docs/recipe-keys.md), generated from the schemas:
the committed file is what the schemas give today, every key a recipe resolves to has a row with
a description, the rows carry types, defaults, allowed values and the resume rules."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from mta.errors import MtaError
from mta.training.config.loading import load_recipe
from mta.training.config.reference import key_rows, reference_markdown, select_rows
from mta.training.config.resume_rules import MUTABLE_KEYS
from mta_cli.main import app

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "recipe-keys.md"
runner = CliRunner()


def test_the_committed_reference_is_what_the_schemas_give():
    assert REFERENCE.read_text(encoding="utf-8") == reference_markdown(), (
        "docs/recipe-keys.md is stale: regenerate it with `make docs` "
        "(mta recipes keys --markdown > docs/recipe-keys.md)"
    )


def _keys(mapping: dict, prefix: str = "") -> set[str]:
    keys = set()
    for name, value in mapping.items():
        keys.add(prefix + name)
        if isinstance(value, dict) and name != "deepspeed":  # the passthrough's keys are DeepSpeed's
            keys |= _keys(value, f"{prefix}{name}.")
    return keys


@pytest.mark.parametrize(("task", "recipe"), [("llm", "tiny.yaml"), ("embedding", "tiny-embed.yaml")])
def test_every_key_a_recipe_resolves_to_has_a_row_with_a_description(task, recipe):
    rows = {row.key: row for row in key_rows(task)}
    resolved = _keys(load_recipe(REPO / "recipes" / recipe).model_dump(mode="json"))
    unread = {"train.select_by", "train.teacher_zero3", "train.num_sample_generations", "train.save_generated"}
    if task == "embedding":  # the shared train: keys an embedding recipe does not read: no rows
        assert not unread & set(rows) and unread <= resolved
        resolved -= {f"train.{key}" for key in load_recipe(REPO / "recipes" / recipe).UNREAD_TRAIN_KEYS}
    else:
        assert unread <= set(rows)
    assert resolved <= set(rows), sorted(resolved - set(rows))
    assert all(row.description and "\n" not in row.description for row in rows.values()), [
        row.key for row in rows.values() if not row.description
    ]
    assert {key for key, row in rows.items() if row.resumable} == set(MUTABLE_KEYS) & set(rows)


def test_rows_carry_type_default_allowed_values_and_the_resume_rule():
    rows = {row.key: row for row in key_rows("llm")}
    lr, stage = rows["train.lr"], rows["train.zero_stage"]
    assert (lr.type, lr.default, lr.allowed, lr.resumable) == ("float", "0.0001", "> 0", True)
    assert (stage.type, stage.default, stage.allowed, stage.resumable) == ("int", "1", "0, 1, 2, 3", False)
    assert (rows["loss.skew_alpha"].allowed, rows["loss.jsd_beta"].allowed) == ("0 ≤ x ≤ 1", "0 ≤ x ≤ 1")
    assert (rows["loss.base"].default, rows["loss.base"].allowed.split(", ")[:2]) == ("srkl", ["ce", "fkl"])
    assert (rows["loss.layers"].type, rows["loss.layers"].allowed) == (
        "str | list[{student, teacher, granularity}]",
        "auto",
    )
    assert (rows["teacher"].type, rows["teacher"].default) == ("section | null", "null")
    assert (rows["student"].type, rows["student"].default, rows["loss"].default) == ("section", "required", "")
    assert (rows["train.betas"].type, rows["train.betas"].default) == ("[float, float]", "[0.9, 0.999]")
    assert (rows["train.max_steps"].type, rows["train.max_steps"].default) == ("int | null", "null")
    assert rows["train.report_to"].allowed == "tensorboard, wandb, mlflow"
    assert rows["data.fields"].type == "mapping str → str" and rows["deepspeed"].type == "mapping"
    embedding = {row.key: row for row in key_rows("embedding")}
    assert embedding["task"].default == "required" and embedding["loss.lasd_weight"].default == "1.0"
    assert "loss.dsa_weight" not in embedding and "loss.lasd_weight" not in rows
    assert [row.key for row in select_rows("train.asam", "embedding")] == [
        "train.asam",
        "train.asam.rho",
        "train.asam.eta",
        "train.asam.scope",
    ]
    assert {row.task for row in select_rows("train.lr")} == {"llm", "embedding"}
    with pytest.raises(MtaError, match=r"'trian' is no recipe key of either task; give a section \(data, "):
        select_rows("trian")


def test_the_command_prints_a_table_per_task_and_the_markdown():
    result = runner.invoke(app, ["recipes", "keys", "train.asam"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "task: llm" in result.output and "task: embedding" in result.output
    assert "train.asam.rho" in result.output and "train.lr " not in result.output
    result = runner.invoke(app, ["recipes", "keys", "loss", "--task", "embedding"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "loss.lasd_weight" in result.output and "task: llm" not in result.output
    result = runner.invoke(app, ["recipes", "keys", "--markdown"])
    assert result.exit_code == 0 and result.output == reference_markdown()
    assert runner.invoke(app, ["recipes", "keys", "--markdown", "train"]).exit_code == 2
