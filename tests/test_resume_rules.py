"""Resume rules: a resumed recipe may change the keys in MUTABLE_KEYS and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import MINIMAL_RECIPE
from mta.errors import MtaError
from mta.training.config.loading import load_recipe, recipe_to_yaml
from mta.training.config.resume_rules import (
    ABSENT,
    MUTABLE_KEYS,
    Change,
    check_resume,
    check_resume_length,
    read_saved_recipe,
    resume_changes,
)

MINIMAL = MINIMAL_RECIPE.format(teacher="teacher-model", student="student-model")


@pytest.fixture
def recipe_path(tmp_path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(MINIMAL, encoding="utf-8")
    return path


@pytest.fixture
def checkpoint(tmp_path, recipe_path) -> Path:
    """A checkpoint directory holding the resolved recipe of the first run, as the trainer saves it."""
    directory = tmp_path / "runs" / "checkpoints" / "step-5"
    directory.mkdir(parents=True)
    (directory / "recipe.yaml").write_text(recipe_to_yaml(load_recipe(recipe_path)), encoding="utf-8")
    return directory


def saved(checkpoint: Path) -> dict:
    return yaml.safe_load((checkpoint / "recipe.yaml").read_text(encoding="utf-8"))


def test_the_same_recipe_resumes_without_changes(checkpoint, recipe_path):
    changes = check_resume(checkpoint, load_recipe(recipe_path))
    assert changes.applied == [] and changes.refused == []


@pytest.mark.parametrize(
    "override, key, old, new",
    [
        ("train.lr=5e-5", "train.lr", 1e-4, 5e-5),
        ("train.projector_lr=1e-4", "train.projector_lr", 5e-4, 1e-4),
        ("train.max_steps=40", "train.max_steps", 10, 40),
        ("train.log_interval=1", "train.log_interval", 10, 1),
        ("train.eval_interval=5", "train.eval_interval", 100, 5),
        ("train.save_interval=5", "train.save_interval", 500, 5),
        ("train.keep_checkpoints=4", "train.keep_checkpoints", 2, 4),
        ("train.num_sample_generations=0", "train.num_sample_generations", 2, 0),
        ("train.sample_max_new_tokens=16", "train.sample_max_new_tokens", 48, 16),
        ("train.teacher_zero3=true", "train.teacher_zero3", False, True),
        ("loss.chunk_size=16", "loss.chunk_size", 128, 16),
        ("data.train=/elsewhere/train.jsonl", "data.train", "train.jsonl", "/elsewhere/train.jsonl"),
        ("data.dev=dev.jsonl", "data.dev", None, "dev.jsonl"),
        ("output_dir=/moved/run", "output_dir", "runs/minimal", "/moved/run"),
        ("student.config=configs/s.json", "student.config", None, "configs/s.json"),
        ("name=renamed", "name", "minimal", "renamed"),
    ],
)
def test_mutable_keys_apply_and_are_logged(checkpoint, recipe_path, override, key, old, new):
    changes = check_resume(checkpoint, load_recipe(recipe_path, [override]))
    assert changes.refused == []
    assert changes.applied == [Change(key, old, new)]
    (line,) = changes.log_lines()
    assert line.startswith(f"resume changes {key}: ") and MUTABLE_KEYS[key] in line


def test_switching_from_max_steps_to_epochs_changes_both_lengths(checkpoint, recipe_path):
    changes = check_resume(checkpoint, load_recipe(recipe_path, ["train.max_steps=null", "train.epochs=2"]))
    assert changes.applied == [Change("train.epochs", None, 2.0), Change("train.max_steps", 10, None)]
    assert "re-planned for the new total" in changes.log_lines()[0]


def test_the_source_may_differ(checkpoint, tmp_path):
    moved = tmp_path / "moved.yaml"
    moved.write_text(MINIMAL, encoding="utf-8")
    (change,) = check_resume(checkpoint, load_recipe(moved)).applied
    assert change.key == "source" and change.new == str(moved)


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.batch_size=8", "train.batch_size"),
        ("train.micro_batch_size=4", "train.micro_batch_size"),
        ("train.zero_stage=3", "train.zero_stage"),
        ("train.precision=bf16", "train.precision"),
        ("seed=1", "seed"),
        ("student.path=other", "student.path"),
        ("teacher.tokenizer=tok", "teacher.tokenizer"),
        ("loss.base=rkl", "loss.base"),
        ("loss.dsa_weight=1.0", "loss.dsa_weight"),
        ("data.max_length=512", "data.max_length"),
        ("train.warmup_steps=3", "train.warmup_steps"),
        ("train.schedule=linear", "train.schedule"),
        ("deepspeed.zero_optimization.overlap_comm=true", "deepspeed.zero_optimization"),
    ],
)
def test_immutable_keys_are_refused_naming_old_and_new(checkpoint, recipe_path, override, key):
    changes = resume_changes(saved(checkpoint), load_recipe(recipe_path, [override]))
    assert [change.key for change in changes.refused] == [key] and changes.applied == []
    with pytest.raises(MtaError) as caught:
        changes.raise_if_refused(checkpoint)
    message = str(caught.value)
    assert message.startswith(f"{checkpoint}: cannot resume with this recipe")
    assert f"\n  {key}: " in message and " → " in message
    assert "--overwrite" in message and "another output_dir" in message


def test_one_message_names_every_refused_key_and_how_to_put_it_back(checkpoint, recipe_path):
    recipe = load_recipe(recipe_path, ["train.batch_size=8", "train.zero_stage=3", "train.lr=1e-5"])
    with pytest.raises(MtaError) as caught:
        check_resume(checkpoint, recipe)
    message = str(caught.value)
    assert "\n  train.batch_size: 4 → 8\n  train.zero_stage: 1 → 3\n" in message
    assert "put the old values back (override train.batch_size=4 train.zero_stage=1)" in message
    assert "train.lr:" not in message.split("A resume may change only")[0]  # applicable, not refused
    assert "A resume may change only name, source, output_dir" in message


def test_a_key_the_new_recipe_adds_is_to_be_removed(checkpoint, recipe_path):
    recipe = load_recipe(recipe_path, ["deepspeed.wall_clock_breakdown=true"])
    with pytest.raises(MtaError) as caught:
        check_resume(checkpoint, recipe)
    assert "deepspeed.wall_clock_breakdown: (not set) → true" in str(caught.value)
    assert "remove deepspeed.wall_clock_breakdown from the recipe" in str(caught.value)


def test_lists_are_compared_whole(checkpoint, recipe_path):
    layers = "loss.layers=[[2, 4, word], [4, 8, phrase]]"
    first = load_recipe(recipe_path, [layers])
    (checkpoint / "recipe.yaml").write_text(recipe_to_yaml(first), encoding="utf-8")
    changes = resume_changes(saved(checkpoint), load_recipe(recipe_path, [layers, "loss.layers.1.1=7"]))
    (change,) = changes.refused
    assert change.key == "loss.layers"
    assert change.old == first.model_dump(mode="json")["loss"]["layers"]
    assert change.new[1] == {"student": 4, "teacher": 7, "granularity": "phrase"}
    assert resume_changes(saved(checkpoint), load_recipe(recipe_path, [layers])).refused == []


def test_a_key_an_older_checkpoint_lacks_counts_as_its_default(checkpoint, recipe_path):
    older = saved(checkpoint)
    del older["train"]["keep_checkpoints"], older["loss"]  # written before those keys existed
    (checkpoint / "recipe.yaml").write_text(yaml.safe_dump(older), encoding="utf-8")
    assert check_resume(checkpoint, load_recipe(recipe_path, ["loss.base=srkl"])).applied == []
    changes = check_resume(checkpoint, load_recipe(recipe_path, ["loss.base=srkl", "train.keep_checkpoints=5"]))
    assert changes.applied == [Change("train.keep_checkpoints", 2, 5)]
    # The file's loss.base (fkl) differs from the default the older run trained with (srkl).
    refused = resume_changes(older, load_recipe(recipe_path)).refused
    assert refused == [Change("loss.base", "srkl", "fkl")]


def test_an_older_recipe_the_schema_now_refuses_is_still_compared(checkpoint, recipe_path):
    older = saved(checkpoint)
    older["train"]["retired_option"] = 3  # a key a later mta dropped
    older["deepspeed"] = {"zero_optimization": True}  # refused today, accepted by an older mta
    changes = resume_changes(older, load_recipe(recipe_path))
    assert changes.applied == [Change("train.retired_option", 3, ABSENT)]
    assert changes.refused == [Change("deepspeed.zero_optimization", True, ABSENT)]
    assert "no longer a recipe key" in changes.log_lines()[0]


def test_true_and_one_are_different_values(checkpoint, recipe_path):
    first = load_recipe(recipe_path, ["deepspeed.zero_optimization.overlap_comm=1"])
    (checkpoint / "recipe.yaml").write_text(recipe_to_yaml(first), encoding="utf-8")
    again = load_recipe(recipe_path, ["deepspeed.zero_optimization.overlap_comm=true"])
    refused = resume_changes(saved(checkpoint), again).refused
    assert refused == [Change("deepspeed.zero_optimization.overlap_comm", 1, True)]


def test_a_missing_or_hostile_saved_recipe_is_refused(checkpoint, recipe_path):
    (checkpoint / "recipe.yaml").write_text("a: &a [x, x]\nb: &b [*a, *a]\nc: &c [1, *c]\n", encoding="utf-8")
    with pytest.raises(MtaError, match="recipe.yaml: line 3: an alias refers to a node that contains it"):
        read_saved_recipe(checkpoint)
    (checkpoint / "recipe.yaml").unlink()
    with pytest.raises(MtaError, match="no recipe.yaml, so the recipe cannot be checked"):
        check_resume(checkpoint, load_recipe(recipe_path))


def test_a_checkpoint_past_the_new_total_is_refused(checkpoint, recipe_path):
    recipe = load_recipe(recipe_path, ["train.max_steps=4"])
    check_resume_length(4, 4, recipe, checkpoint)  # a finished run resumes to its end
    with pytest.raises(MtaError) as caught:
        check_resume_length(5, 4, recipe, checkpoint)
    assert str(caught.value).startswith(
        f"{checkpoint} is at step 5, past the 4 steps this recipe trains (train.max_steps=4); "
        "give a length of at least 5 steps"
    )


# --- off-policy sampling (off_policy:) --------------------------------------------------------


@pytest.mark.parametrize(
    "override, key, old, new",
    [
        ("off_policy.loss_eps=0.2", "off_policy.loss_eps", 0.1, 0.2),
        ("off_policy.threshold_step=0.05", "off_policy.threshold_step", 0.1, 0.05),
        ("train.save_generated=true", "train.save_generated", False, True),
    ],
)
def test_the_threshold_gains_and_saving_generated_rows_may_change(checkpoint, recipe_path, override, key, old, new):
    changes = check_resume(checkpoint, load_recipe(recipe_path, [override]))
    assert changes.refused == [] and changes.applied == [Change(key, old, new)]
    (line,) = changes.log_lines()
    assert line.startswith(f"resume changes {key}: ") and MUTABLE_KEYS[key] in line


@pytest.mark.parametrize(
    "override, key",
    [
        ("off_policy.mode=always", "off_policy.mode"),
        ("off_policy.schedule=constant", "off_policy.schedule"),
        ("off_policy.init_threshold=0.5", "off_policy.init_threshold"),
        ("off_policy.buffer_size=10", "off_policy.buffer_size"),
        ("off_policy.max_new_tokens=16", "off_policy.max_new_tokens"),
    ],
)
def test_what_decides_the_generated_rows_is_fixed(checkpoint, recipe_path, override, key):
    changes = resume_changes(saved(checkpoint), load_recipe(recipe_path, [override]))
    assert [change.key for change in changes.refused] == [key] and changes.applied == []
    with pytest.raises(MtaError, match=f"\n  {key}: "):
        changes.raise_if_refused(checkpoint)


def test_a_checkpoint_from_before_generation_counts_as_generation_off(checkpoint, recipe_path):
    older = saved(checkpoint)
    del older["off_policy"], older["train"]["save_generated"]
    (checkpoint / "recipe.yaml").write_text(yaml.safe_dump(older), encoding="utf-8")
    assert check_resume(checkpoint, load_recipe(recipe_path)).applied == []
    refused = resume_changes(older, load_recipe(recipe_path, ["off_policy.mode=always"])).refused
    assert refused == [Change("off_policy.mode", "off", "always")]
