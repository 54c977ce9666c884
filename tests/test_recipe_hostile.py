"""Hostile and broken recipes are refused with one line naming where, before anything is built.

Alias bombs, self-reference, deep nesting and repeated keys are refused by the loader; non-finite
numbers and keys that are not names are refused by the schema with the file's line.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import MINIMAL_RECIPE
from fixtures.recipes import error_of, write
from mta.training.config.loading import load_recipe
from mta.training.config.yaml_reader import MAX_RECIPE_BYTES, MAX_YAML_DEPTH, MAX_YAML_VALUES, load_yaml

REPO = Path(__file__).resolve().parents[1]
MINIMAL = MINIMAL_RECIPE.format(teacher="teacher-model", student="student-model")


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """Billion laughs: each level is a list of ``width`` aliases of the level before."""
    names = [f"l{level}" for level in range(levels)]
    lines = [f"{names[0]}: &{names[0]} [" + ", ".join(["x"] * width) + "]"]
    for before, name in zip(names, names[1:], strict=False):  # consecutive pairs
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{before}"] * width) + "]")
    return "\n".join(lines) + "\n"


def line_of(text: str, needle: str) -> int:
    return next(number for number, line in enumerate(text.splitlines(), 1) if needle in line)


# --- YAML: aliases, nesting, repeated keys ------------------------------------------------------


def test_an_alias_bomb_is_refused_before_any_value_is_constructed(tmp_path, monkeypatch):
    constructed = []
    original = yaml.constructor.BaseConstructor.construct_object

    def counting(self, node, deep=False):
        constructed.append(node)
        return original(self, node, deep)

    monkeypatch.setattr(yaml.constructor.BaseConstructor, "construct_object", counting)
    text = alias_bomb() + MINIMAL
    message = error_of(write(tmp_path, text))
    assert constructed == []
    assert message.count("\n") == 0
    assert message.startswith(f"{tmp_path / 'recipe.yaml'}: line ")
    assert f"more than {MAX_YAML_VALUES:,} values once its aliases are expanded" in message


def test_an_alias_bomb_is_refused_within_a_small_memory_and_time_budget(tmp_path):
    """The same bomb in a fresh interpreter capped at 1 GiB and 60 s of CPU (a guard against a
    regression that would otherwise take minutes and gigabytes)."""
    path = write(tmp_path, alias_bomb() + MINIMAL)
    script = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        resource.setrlimit(resource.RLIMIT_CPU, (60, 60))
        from mta.errors import MtaError
        from mta.training.config.loading import load_recipe
        try:
            load_recipe({str(path)!r})
        except MtaError as error:
            print(error)
            sys.exit(0)
        sys.exit("the bomb was accepted")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "once its aliases are expanded" in done.stdout


def test_an_alias_bomb_in_an_override_value_is_refused_naming_the_override(tmp_path):
    # The flow form of the bomb: seven levels of ten aliases, 10**7 values once expanded.
    value = "[&a0 [" + ", ".join(["x"] * 10) + "]"
    for level in range(1, 7):
        value += f", &a{level} [" + ", ".join([f"*a{level - 1}"] * 10) + "]"
    value += "]"
    message = error_of(write(tmp_path, MINIMAL), (f"deepspeed.wall_clock_breakdown={value}",))
    assert message.startswith("override 'deepspeed.wall_clock_breakdown=[&a0")
    assert "line 1: this value holds more than" in message


def test_few_aliases_and_merge_keys_still_load(tmp_path):
    text = MINIMAL.replace(
        "teacher:\n  path: teacher-model\n", "teacher: &model\n  path: teacher-model\n  dtype: fp32\n"
    ).replace("student:\n  path: student-model\n", "student:\n  <<: *model\n  path: student-model\n")
    recipe = load_recipe(write(tmp_path, text))
    assert (recipe.teacher.path, recipe.student.path, recipe.student.dtype) == (
        "teacher-model",
        "student-model",
        "fp32",
    )


def test_a_self_referencing_alias_is_refused(tmp_path):
    text = MINIMAL + "deepspeed:\n  loop: &loop [1, *loop]\n"
    message = error_of(write(tmp_path, text))
    assert f"line {line_of(text, '&loop')}: an alias refers to a node that contains it" in message


def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "deepspeed:\n  x: " + "[" * 5000 + "]" * 5000 + "\n"))
    assert f"nested more than {MAX_YAML_DEPTH} levels deep" in message
    # Depth built from aliases (each level a small list of the one before) is refused too.
    chain = "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, MAX_YAML_DEPTH + 2))
    assert "more than" in error_of(write(tmp_path, "a0: &a0 [x]\n" + chain + MINIMAL))


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    text = MINIMAL + "train:\n  lr: 1.0e-3\n"
    message = error_of(write(tmp_path, text))
    first, second = text.splitlines().index("train:") + 1, len(text.splitlines()) - 1
    assert message == (
        f"{tmp_path / 'recipe.yaml'}: line {second}: key 'train' is given twice in one mapping "
        f"(also line {first}); YAML would silently keep only the last: remove one"
    )


def test_an_oversized_file_is_refused_unread(tmp_path):
    path = write(tmp_path, MINIMAL + "#" * MAX_RECIPE_BYTES)
    assert "is not a recipe (a recipe is a few KB" in error_of(path)


def test_load_yaml_reads_what_safe_load_reads():
    text = "a: [1, 2.5, .inf, null, true, '1']\nb: {c: d}\n"
    assert load_yaml(text, "x") == yaml.safe_load(text)


# --- non-finite numbers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, key, shown",
    [
        ("train.lr=.inf", "train.lr", "inf"),
        ("train.lr=.nan", "train.lr", "nan"),
        ("train.projector_lr=1.0e+400", "train.projector_lr", "inf"),  # overflows to inf
        ("loss.temperature=-.inf", "loss.temperature", "-inf"),
        ("train.betas=[0.9, .nan]", "train.betas.1", "nan"),
        ("train.epochs=.inf", "train.epochs", "inf"),
    ],
)
def test_non_finite_numbers_are_refused(tmp_path, override, key, shown):
    overrides = (override, "train.max_steps=null") if "epochs" in override else (override,)
    message = error_of(write(tmp_path, MINIMAL), overrides)
    assert f"{key}: must be a finite number (got {shown})" in message
    assert f"(from override {override!r})" in message


def test_a_non_finite_number_in_the_file_is_named_with_its_line(tmp_path):
    text = MINIMAL.replace("  base: fkl\n", "  base: fkl\n  dsa_weight: .nan\n")
    message = error_of(write(tmp_path, text))
    assert f"line {line_of(text, 'dsa_weight')}: loss.dsa_weight: must be a finite number (got nan)" in message


def test_non_finite_numbers_inside_the_deepspeed_mapping_are_found(tmp_path):
    text = MINIMAL + ("deepspeed:\n  zero_optimization:\n    overlap_comm: true\n    reduce_bucket_size: .inf\n")
    message = error_of(write(tmp_path, text))
    assert (
        f"line {line_of(text, 'reduce_bucket_size')}: deepspeed.zero_optimization.reduce_bucket_size: "
        "must be a finite number (got inf)"
    ) in message
    listed = error_of(write(tmp_path, MINIMAL), ("deepspeed.flops_profiler.ranks=[1.0, .nan]",))
    assert "deepspeed.flops_profiler.ranks.1: must be a finite number (got nan)" in listed


# --- keys that are not names ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, named",
    [
        ('"train lr": 1\n', "'train lr': unknown key"),
        ("1: x\n", "1: unknown key"),
        ("null: x\n", "null: unknown key"),
        ("train-lr: 1\n", "train-lr: unknown key"),
    ],
)
def test_a_top_level_key_that_is_not_a_name_is_named_with_its_line(tmp_path, extra, named):
    text = MINIMAL + extra
    message = error_of(write(tmp_path, text))
    assert f"line {len(text.splitlines())}: {named}" in message
    assert "allowed here: name, seed, output_dir" in message


def test_a_misspelt_key_names_the_close_match_or_its_section(tmp_path):
    text = MINIMAL.replace("  max_steps: 10\n", "  max-steps: 10\n")
    message = error_of(write(tmp_path, text))
    assert f"line {line_of(text, 'max-steps')}: train.max-steps: unknown key: did you mean max_steps?" in message
    elsewhere = error_of(write(tmp_path, MINIMAL), ("train.max_prompt_length=64",))
    assert "train.max_prompt_length: unknown key here: max_prompt_length is a key of data" in elsewhere


def test_a_non_string_key_inside_the_deepspeed_mapping_is_named(tmp_path):
    text = MINIMAL + "deepspeed:\n  1: x\n"
    message = error_of(write(tmp_path, text))
    assert f"line {len(text.splitlines())}: deepspeed.1: a key must be a name (got 1)" in message
