"""Edges of recipe configuration that mutation testing (bench/mutation.py) found unchecked.

``extends``: a parent written with its ``.yaml`` suffix or with a directory, the input paths of a
parent elsewhere (three-part keys, sections that are missing or not mappings, values that name an
environment variable or a home directory, the parent's own mapping left as read); FDD's ``auto``
layers at their boundaries; YAML flow text; a refused document's message.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fixtures.selection import recipe
from mta.errors import MtaError
from mta.training.config.catalog import SHIPPED_DIR
from mta.training.config.extends import RecipeFile, merged_recipe, parent_path
from mta.training.config.layers import auto_fdd_layers, resolve_fdd_layers
from mta.training.config.resume_rules import ABSENT, Change, resume_changes
from mta.training.config.schema import LayerIndexPair
from mta.training.config.yaml_reader import Refused, yaml_text


def test_a_shipped_parent_is_found_with_or_without_its_suffix_but_never_through_a_directory(tmp_path):
    child = tmp_path / "mine.yaml"
    assert parent_path("qwen.yaml", child) == parent_path("qwen", child) == SHIPPED_DIR / "qwen.yaml"
    with pytest.raises(MtaError, match=r"no such recipe beside it"):
        parent_path("./qwen", child)  # a path: beside the child or nowhere, never the shipped one


def chain_with_parent_elsewhere(tmp_path: Path, parent_raw: dict) -> tuple[list[RecipeFile], Path]:
    elsewhere = tmp_path / "shared"
    elsewhere.mkdir()
    (tmp_path / "child").mkdir()
    child = RecipeFile(tmp_path / "child" / "r.yaml", "", {"name": "child"})
    return [child, RecipeFile(elsewhere / "base.yaml", "", parent_raw)], elsewhere


def test_a_parents_input_paths_keep_naming_its_files_three_part_keys_included(tmp_path):
    parent = {"teacher": {"tiny": {"tokenizer_corpus": "corpus.txt"}}, "data": {"train": "train.jsonl"}}
    chain, elsewhere = chain_with_parent_elsewhere(tmp_path, parent)
    for name in ("corpus.txt", "train.jsonl"):
        (elsewhere / name).write_text("x", encoding="utf-8")
    merged = merged_recipe(chain)
    assert merged["teacher"] == {"tiny": {"tokenizer_corpus": str(elsewhere / "corpus.txt")}}
    assert merged["data"] == {"train": str(elsewhere / "train.jsonl")}
    assert parent == {"teacher": {"tiny": {"tokenizer_corpus": "corpus.txt"}}, "data": {"train": "train.jsonl"}}


def test_missing_or_scalar_sections_are_passed_over_and_later_keys_still_resolved(tmp_path):
    parent = {"student": "not a mapping", "data": {"train": "train.jsonl", "dev": 5}}
    chain, elsewhere = chain_with_parent_elsewhere(tmp_path, parent)
    (elsewhere / "train.jsonl").write_text("x", encoding="utf-8")
    merged = merged_recipe(chain)  # no teacher section, a scalar student, a number as data.dev
    assert merged["student"] == "not a mapping" and merged["data"] == {
        "train": str(elsewhere / "train.jsonl"),
        "dev": 5,
    }


def test_values_naming_an_environment_variable_or_a_home_directory_are_left_as_written(tmp_path):
    parent = {"data": {"train": "$DATA/train.jsonl", "dev": "~/dev.jsonl"}}
    chain, elsewhere = chain_with_parent_elsewhere(tmp_path, parent)
    for folder in ("$DATA", "~"):  # folders of those literal names beside the parent
        (elsewhere / folder).mkdir()
    (elsewhere / "$DATA" / "train.jsonl").write_text("x", encoding="utf-8")
    (elsewhere / "~" / "dev.jsonl").write_text("x", encoding="utf-8")
    assert merged_recipe(chain)["data"] == {"train": "$DATA/train.jsonl", "dev": "~/dev.jsonl"}


def test_fdd_auto_layers_take_one_layer_models_and_refuse_empty_ones():
    assert auto_fdd_layers(1, 1) == [LayerIndexPair(student=1, teacher=1)]
    for student, teacher in ((0, 12), (12, 0)):
        with pytest.raises(
            MtaError,
            match=rf"^FDD needs models with at least one layer \(student {student}, teacher {teacher}\)$",
        ):
            auto_fdd_layers(student, teacher)


def test_fdd_layers_auto_resolves_to_the_published_pairs():
    assert resolve_fdd_layers("auto", 12, 48) == [
        LayerIndexPair(student=4, teacher=16),
        LayerIndexPair(student=6, teacher=24),
        LayerIndexPair(student=8, teacher=32),
    ]
    assert resolve_fdd_layers("auto", 3, 6) == auto_fdd_layers(3, 6) != auto_fdd_layers(6, 3)


def test_yaml_text_is_one_line_of_flow_style_in_the_given_order():
    assert yaml_text({"b": 1, "a": [1, 2]}) == "{b: 1, a: [1, 2]}"
    assert yaml_text([1, {"x": None}]) == "[1, {x: null}]"
    long = list(range(40))
    assert yaml_text(long) == "[" + ", ".join(map(str, long)) + "]"


def test_a_refused_document_carries_its_message_and_one_based_line():
    error = Refused(yaml.Mark("r.yaml", 0, 4, 2, None, None), "anchors are not allowed")
    assert str(error) == "anchors are not allowed" and error.line == 5


def test_a_saved_recipe_the_schema_no_longer_takes_gets_todays_defaults_for_what_it_lacks():
    new = recipe("loss")  # a plain recipe: the selection tests' minimal one
    saved = new.model_dump(mode="json")
    saved["retired_key"] = 1  # no longer a recipe key: the saved mapping does not validate
    del saved["loss"]  # a whole section, and a key inside another, written before they existed
    del saved["train"]["lr"]
    changes = resume_changes(saved, new)
    assert changes.refused == [] and changes.applied == [Change("retired_key", 1, ABSENT)]
    assert changes.log_lines() == ["resume changes retired_key: 1 → (not set) (no longer a recipe key: ignored)"]
