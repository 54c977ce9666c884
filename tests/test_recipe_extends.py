"""Recipes that extend another (`extends:`): merging, where errors point, cycles, copies."""

from __future__ import annotations

from pathlib import Path

import pytest

from mta.errors import MtaError
from mta.training.config.catalog import SHIPPED_DIR, copy_recipe, shipped_recipes
from mta.training.config.extends import merged_recipe, recipe_chain
from mta.training.config.loading import load_recipe, recipe_to_yaml
from mta.training.config.yaml_reader import load_yaml

TINY = SHIPPED_DIR / "tiny.yaml"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_the_child_lays_its_keys_over_the_parent(tmp_path):
    parent = write(tmp_path / "parent.yaml", TINY.read_text(encoding="utf-8"))
    child = write(
        tmp_path / "child.yaml",
        ("extends: parent\nname: child\nloss: {dsa_weight: 5.0, layers: [[2, 2, word]]}\ntrain: {lr: 1.0e-4}\n"),
    )
    recipe, base = load_recipe(child), load_recipe(parent)
    assert recipe.name == "child" and recipe.loss.dsa_weight == 5.0 and recipe.train.lr == 1.0e-4
    # Mappings merge: what the child does not set is the parent's ...
    assert recipe.loss.hra_weight == base.loss.hra_weight and recipe.loss.base == base.loss.base
    assert recipe.train.max_steps == base.train.max_steps and recipe.student == base.student
    # ... and a list replaces the parent's list whole.
    assert [(p.student, p.teacher) for p in recipe.loss.layers] == [(2, 2)]
    # A second, independent reading: the parent's mapping with the child's keys set by hand.
    expected = load_yaml(parent.read_text(encoding="utf-8"), "parent")
    expected["name"] = "child"
    expected["loss"].update(dsa_weight=5.0, layers=[[2, 2, "word"]])
    expected["train"]["lr"] = 1.0e-4
    assert merged_recipe(recipe_chain(child)) == expected


def test_null_replaces_and_chains_of_three_merge_in_order(tmp_path):
    write(tmp_path / "a.yaml", TINY.read_text(encoding="utf-8"))
    write(tmp_path / "b.yaml", "extends: a.yaml\nseed: 7\ntrain: {lr: 2.0e-3, max_steps: 5}\n")
    c = write(
        tmp_path / "c.yaml",
        "extends: b\ntrain: {max_steps: 3}\nteacher: null\nloss: {base: ce, dsa_weight: 0, hra_weight: 0}\n",
    )
    recipe = load_recipe(c)
    assert recipe.seed == 7 and recipe.train.lr == 2.0e-3 and recipe.train.max_steps == 3
    assert recipe.teacher is None
    assert "extends" not in recipe_to_yaml(recipe)


def test_errors_name_the_file_and_line_the_key_came_from(tmp_path):
    text = TINY.read_text(encoding="utf-8").replace("  lr:", "  lr_typo:", 1)
    parent_line = next(i for i, line in enumerate(text.splitlines(), 1) if "lr_typo" in line)
    write(tmp_path / "parent.yaml", text)
    child = write(tmp_path / "child.yaml", "extends: parent\n\nloss: {dsa_wieght: 1.0}\n")
    with pytest.raises(MtaError) as error:
        load_recipe(child)
    message = str(error.value)
    assert f"parent.yaml line {parent_line}: train.lr_typo: unknown key" in message
    assert "  line 3: loss.dsa_wieght: unknown key: did you mean dsa_weight?" in message


def test_cycles_missing_parents_and_bad_values_are_refused(tmp_path):
    write(tmp_path / "a.yaml", "extends: b\nname: a\n")
    write(tmp_path / "b.yaml", "extends: a\nname: b\n")
    with pytest.raises(MtaError, match=r"cycle \(a.yaml -> b.yaml -> a.yaml\)"):
        load_recipe(tmp_path / "a.yaml")
    lonely = write(tmp_path / "lonely.yaml", "extends: nowhere\n")
    with pytest.raises(MtaError, match="'nowhere': no such recipe beside it .* no shipped recipe"):
        load_recipe(lonely)
    listed = write(tmp_path / "listed.yaml", "extends: [a, b]\n")
    with pytest.raises(MtaError, match="extends: names one recipe"):
        load_recipe(listed)
    for index in range(6):
        write(tmp_path / f"d{index}.yaml", f"extends: d{index + 1}\n")
    write(tmp_path / "d6.yaml", TINY.read_text(encoding="utf-8"))
    with pytest.raises(MtaError, match="more than 4 recipes extend each other"):
        load_recipe(tmp_path / "d0.yaml")


def test_a_recipe_elsewhere_extends_a_shipped_one_and_its_files_still_resolve(tmp_path):
    child = write(tmp_path / "mine.yaml", "extends: gpt2\nname: mine\ntrain: {lr: 3.0e-5}\n")
    recipe = load_recipe(child)
    shipped = load_recipe(SHIPPED_DIR / "gpt2.yaml")
    assert recipe.train.lr == 3.0e-5 and recipe.loss == shipped.loss
    # configs/gpt2-xl.json lives beside gpt2.yaml, not beside mine.yaml.
    config = recipe.resolve(recipe.teacher.config, "teacher.config")
    assert config.is_file() and config.resolve() == (SHIPPED_DIR / "configs" / "gpt2-xl.json").resolve()


def extending_shipped_recipes() -> list[str]:
    return [
        r.name for r in shipped_recipes() if "extends" in (load_yaml(r.path.read_text(encoding="utf-8"), r.name) or {})
    ]


def test_a_copy_of_a_recipe_that_extends_another_carries_its_parent(tmp_path):
    names = extending_shipped_recipes()
    assert names, "no shipped recipe uses extends: (the paper rows share their pair's recipe)"
    for name in names:
        dest = tmp_path / name
        copy = copy_recipe(name, dest)
        parents = [file.destination.name for file in copy.files if file.destination.suffix == ".yaml"]
        assert parents, f"{name}: the copy left out the recipe it extends"
        copied, shipped = load_recipe(copy.recipe), load_recipe(SHIPPED_DIR / f"{name}.yaml")
        ignore = {"source"}
        assert copied.model_dump(exclude=ignore) == shipped.model_dump(exclude=ignore)
