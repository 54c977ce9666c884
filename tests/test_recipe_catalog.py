"""The shipped recipes: every one loads, `mta recipes list` / `copy`, and `--recipe NAME`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from mta.errors import MtaError
from mta.training.config.catalog import (
    INPUT_PATH_KEYS,
    SHIPPED_DIR,
    copy_recipe,
    describe,
    find_recipe,
    plan_copy,
    shipped_recipe,
    shipped_recipes,
)
from mta.training.config.loading import load_recipe
from mta_cli.main import app

SHIPPED = shipped_recipes()
runner = CliRunner()


def _value(recipe, key: tuple[str, ...]):
    node = recipe
    for part in key:
        node = getattr(node, part, None)
        if node is None:
            return None
    return node


# --- every shipped recipe --------------------------------------------------------------------


def test_the_catalog_is_the_clones_top_level_recipes_directory():
    # A clone (an editable install) reads the one copy in git; the wheel's copy: tests/test_wheel.py.
    assert SHIPPED_DIR == Path(__file__).resolve().parents[1] / "recipes"
    assert [recipe.name for recipe in SHIPPED] == sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml"))
    assert {"tiny", "gpt2", "qwen", "opt", "cross-tokenizer", "smollm2-demo"} <= {recipe.name for recipe in SHIPPED}


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda recipe: recipe.name)
def test_every_shipped_recipe_loads_and_its_input_files_are_shipped_beside_it(shipped):
    recipe = load_recipe(shipped.path)
    assert recipe.source == str(shipped.path)
    for role in ("teacher", "student"):
        spec = getattr(recipe, role)
        if spec is None:
            continue
        if spec.config:
            assert recipe.resolve(spec.config).is_relative_to(SHIPPED_DIR), spec.config
        if spec.tiny:
            assert recipe.resolve(spec.tiny.tokenizer_corpus).is_relative_to(SHIPPED_DIR)


def test_every_shipped_data_file_is_named_by_a_recipe(tmp_path):
    # One copy of each file and nothing orphaned: configs/ and examples/ hold only what recipes use.
    named = {
        file.source.resolve()
        for recipe in SHIPPED
        for file in plan_copy(recipe.name, tmp_path / recipe.name)[1].files
        if file.source.suffix != ".yaml"  # the recipes a recipe extends travel with its copy
    }
    shipped = {p.resolve() for p in SHIPPED_DIR.rglob("*") if p.is_file() and p.suffix != ".yaml"}
    assert named == shipped


def test_list_names_every_recipe_with_its_header_line():
    for recipe in SHIPPED:
        assert recipe.description and "\n" not in recipe.description
    assert shipped_recipe("gpt2").description.startswith("GPT-2 1.5B (48 layers) -> GPT-2 120M")
    result = runner.invoke(app, ["recipes", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for recipe in SHIPPED:
        assert recipe.name in result.output


def test_describe_falls_back_to_the_name():
    assert describe("# First line\n# goes on. Second sentence.\n#\n# more\nname: x\n") == ("First line goes on.")
    assert describe("name: bare\noutput_dir: runs\n") == "bare"


# --- --recipe NAME ----------------------------------------------------------------------------


def test_a_name_resolves_to_the_shipped_recipe_and_an_existing_file_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for spec in ("tiny", "tiny.yaml"):
        chosen = find_recipe(spec)
        assert chosen.shipped is not None and chosen.path == SHIPPED_DIR / "tiny.yaml"
    (tmp_path / "tiny.yaml").write_text("name: mine\n")
    assert find_recipe("tiny").path == Path("tiny.yaml") and find_recipe("tiny").shipped is None
    (tmp_path / "tiny").write_text("name: mine too\n")
    assert find_recipe("tiny").path == Path("tiny")
    assert find_recipe(str(SHIPPED_DIR / "gpt2.yaml")).path == SHIPPED_DIR / "gpt2.yaml"


@pytest.mark.parametrize("spec", ["nope", "recipes/tiny.yaml"])
def test_an_unknown_recipe_lists_the_shipped_names(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MtaError) as caught:
        find_recipe(spec)
    message = str(caught.value)
    assert repr(spec) in message
    assert ", ".join(sorted(path.stem for path in SHIPPED_DIR.glob("*.yaml"))) in message


def test_a_shipped_recipe_reads_its_files_beside_it_and_writes_into_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(find_recipe("tiny").path)
    assert recipe.resolve(recipe.data.train) == SHIPPED_DIR / "examples" / "tiny.jsonl"
    assert recipe.resolve(recipe.student.tiny.tokenizer_corpus).is_file()
    # output_dir does not exist beside the shipped file, so it stays relative to the cwd ...
    assert recipe.resolve(recipe.output_dir) == Path("runs/tiny")
    assert not (SHIPPED_DIR / "runs").exists()
    # ... also once a run has created it there.
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    assert recipe.resolve(recipe.output_dir).resolve() == tmp_path / "runs" / "tiny"


def test_distill_by_name_says_which_file_it_uses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["distill", "--recipe", "tiny", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f"recipe: shipped tiny ({SHIPPED_DIR / 'tiny.yaml'})" in result.output
    assert not (SHIPPED_DIR / "runs").exists()  # nothing is written beside the shipped file
    result = runner.invoke(app, ["distill", "--recipe", "nope", "--dry-run"])
    assert isinstance(result.exception, MtaError) and "mta recipes list" in str(result.exception)


# --- mta recipes copy -------------------------------------------------------------------------


def test_a_copy_works_from_another_directory_with_every_file_inside_dest(tmp_path, monkeypatch):
    dest = tmp_path / "mine"
    result = runner.invoke(app, ["recipes", "copy", "tiny", str(dest)])
    assert result.exit_code == 0, result.output
    assert (dest / "tiny.yaml").read_text() == (SHIPPED_DIR / "tiny.yaml").read_text()  # comments too
    assert (dest / "examples" / "tiny.jsonl").read_bytes() == (SHIPPED_DIR / "examples" / "tiny.jsonl").read_bytes()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    recipe = load_recipe(dest / "tiny.yaml")
    for key in INPUT_PATH_KEYS:
        written = _value(recipe, key)
        if written and key[-1] != "path":
            assert recipe.resolve(written).is_relative_to(dest), key
    assert recipe.resolve(recipe.output_dir) == Path("runs/tiny")
    result = runner.invoke(app, ["distill", "--recipe", str(dest / "tiny.yaml"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f"recipe: {dest / 'tiny.yaml'}" in result.output and "shipped" not in result.output


def test_a_copy_carries_the_architecture_configs(tmp_path, monkeypatch):
    copied = copy_recipe("gpt2", tmp_path / "gpt2")
    assert sorted(f.destination.name for f in copied.files) == ["gpt2-xl.json", "gpt2.json"]
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(copied.recipe)
    assert recipe.resolve(recipe.teacher.config) == tmp_path / "gpt2" / "configs" / "gpt2-xl.json"
    assert recipe.teacher.path == "MiniLLM/teacher-gpt2-1.5B"  # a hub name: not a file, not copied


def test_a_copy_rewrites_only_the_path_values_that_leave_the_recipe_directory(tmp_path, monkeypatch):
    catalog = tmp_path / "catalog" / "recipes"
    (catalog / "configs").mkdir(parents=True)
    (catalog / "configs" / "s.json").write_text("{}")
    (tmp_path / "catalog" / "rows").mkdir()
    (tmp_path / "catalog" / "rows" / "train.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    text = (
        "# A custom recipe.\n"
        "name: custom\n"
        "output_dir: runs/custom   # an output: stays\n"
        "teacher:\n  path: gpt2\n"
        "student:\n  path: gpt2\n  config: 'configs/s.json'\n"
        "data:\n"
        "  train: ../rows/train.jsonl    # the rows\n"
        '  dev: "${MTA_DATA_DIR}/dolly/dev.jsonl"\n'
        "train:\n  max_steps: 1\n  batch_size: 2\n  micro_batch_size: 2\n"
    )
    (catalog / "custom.yaml").write_text(text)
    dest = tmp_path / "dest"
    copied = copy_recipe("custom", dest, directory=catalog)
    assert copied.rewritten == {"data.train": ("../rows/train.jsonl", "rows/train.jsonl")}
    assert copied.recipe.read_text() == text.replace(
        "train: ../rows/train.jsonl    # the rows", "train: rows/train.jsonl    # the rows"
    )
    assert yaml.safe_load(copied.recipe.read_text())["student"]["config"] == "configs/s.json"
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(copied.recipe)
    assert recipe.resolve(recipe.data.train) == dest / "rows" / "train.jsonl"
    assert recipe.resolve(recipe.student.config) == dest / "configs" / "s.json"


def test_a_copy_never_overwrites_a_changed_file_without_force(tmp_path):
    dest = tmp_path / "mine"
    copy_recipe("tiny", dest)
    again = copy_recipe("tiny", dest)  # identical files: nothing to refuse, nothing rewritten
    assert all(file.unchanged for file in again.files)
    rows = dest / "examples" / "tiny.jsonl"
    rows.write_text("edited\n")
    (dest / "tiny.yaml").write_text("# mine\n")
    with pytest.raises(MtaError) as caught:
        copy_recipe("tiny", dest)
    assert str(dest / "tiny.yaml") in str(caught.value) and str(rows) in str(caught.value)
    assert "--force" in str(caught.value)
    assert rows.read_text() == "edited\n"  # untouched
    result = runner.invoke(app, ["recipes", "copy", "tiny", str(dest)])
    assert isinstance(result.exception, MtaError)
    result = runner.invoke(app, ["recipes", "copy", "tiny", str(dest), "--force"])
    assert result.exit_code == 0, result.output
    assert rows.read_bytes() == (SHIPPED_DIR / "examples" / "tiny.jsonl").read_bytes()


def test_copying_an_unknown_name_lists_the_shipped_ones(tmp_path):
    with pytest.raises(MtaError) as caught:
        copy_recipe("tinyy", tmp_path)
    assert "'tinyy'" in str(caught.value) and "tiny" in str(caught.value)
    assert not any(tmp_path.iterdir())
