"""The YAML reader's bounds at their edges, overrides' and resumes' messages, and the recipe file's
refusals: what mutation testing (bench/mutation.py) found unchecked in mta.training.config.

The bounds are tested with the module's limits patched small (the functions read them at call
time), so a document one value or one level past a bound is a few lines, not 100,000 values.
"""

from __future__ import annotations

import pytest
import yaml

from fixtures.selection import recipe
from mta.errors import MtaError
from mta.training.config import extends, yaml_reader
from mta.training.config.extends import read_recipe_file, recipe_chain
from mta.training.config.layers import resolve_sra_layers
from mta.training.config.overrides import apply_overrides
from mta.training.config.resume_rules import (
    ABSENT,
    SAVED_RECIPE,
    Change,
    ResumeChanges,
    check_resume_length,
    read_saved_recipe,
    resume_changes,
)
from mta.training.config.schema import LayerIndexPair, Recipe
from mta.training.config.yaml_reader import load_yaml


def nested(depth: int) -> str:
    """A flow document ``depth`` nodes deep: ``[[0]]`` is 3 (two lists and the scalar)."""
    return "[" * (depth - 1) + "0" + "]" * (depth - 1)


# --- the YAML reader ------------------------------------------------------------------------------


def test_a_document_exactly_max_depth_deep_loads_and_one_level_more_is_refused(monkeypatch):
    monkeypatch.setattr(yaml_reader, "MAX_YAML_DEPTH", 6)
    assert load_yaml(nested(6), "r.yaml") == [[[[[0]]]]]
    with pytest.raises(MtaError, match=r"^r\.yaml: line 1: nested more than 6 levels deep; a recipe needs a handful$"):
        load_yaml(nested(7), "r.yaml")


def test_the_depth_is_counted_again_after_a_sibling_has_been_read(monkeypatch):
    # A scalar read at the deepest list before the next level: leaving a node must undo exactly
    # its own level, or the levels after it are counted short.
    monkeypatch.setattr(yaml_reader, "MAX_YAML_DEPTH", 6)
    assert load_yaml("[1, [2, [3, [4, [5]]]]]", "r.yaml") == [1, [2, [3, [4, [5]]]]]
    with pytest.raises(MtaError, match=r"nested more than 6 levels deep"):
        load_yaml("[1, [2, [3, [4, [5, [6]]]]]]", "r.yaml")


def test_aliases_may_nest_the_values_exactly_max_depth_deep_but_not_one_level_more(monkeypatch):
    monkeypatch.setattr(yaml_reader, "MAX_YAML_DEPTH", 6)
    # Each document is at most 4 levels deep as written; the aliases make it 6, then 7, once expanded.
    six = "a: &a [[0]]\nb: [[*a]]\n"
    assert load_yaml(six, "r.yaml") == {"a": [[0]], "b": [[[[0]]]]}
    seven = "a: &a [[0]]\nb: [[[*a]]]\n"
    # The line is the anchor's: an alias is the node it names (PyYAML keeps no mark of its own).
    with pytest.raises(MtaError, match=r"^r\.yaml: line 1: aliases nest the values more than 6 levels deep$"):
        load_yaml(seven, "r.yaml")
    # Refused where the alias that goes too deep is used (named by its anchor's line), not at the root.
    with pytest.raises(MtaError, match=r"^r\.yaml: line 2: aliases nest the values more than 6 levels deep$"):
        load_yaml("x: 1\na: &a [[0]]\nb: [[[*a]]]\n", "r.yaml")
    # The same alias a second time (memoised): its depth still counts where it is used.
    with pytest.raises(MtaError, match=r"line 1: aliases nest the values more than 6 levels deep"):
        load_yaml("a: &a [[0]]\nb: [*a]\nc: [[[*a]]]\n", "r.yaml")


def test_a_value_holding_exactly_max_values_loads_and_one_more_is_refused(monkeypatch):
    monkeypatch.setattr(yaml_reader, "MAX_YAML_VALUES", 10)
    # A list of n scalars holds n + 1 values (itself and its items); aliases count once per use.
    assert load_yaml("[1, 2, 3, 4, 5, 6, 7, 8, 9]", "r.yaml") == list(range(1, 10))
    with pytest.raises(MtaError, match=r"^r\.yaml: line 1: this value holds more than 10 values once its aliases"):
        load_yaml("[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]", "r.yaml")
    assert load_yaml("- &a [1, 2, 3]\n- *a\n- 0\n", "r.yaml") == [[1, 2, 3], [1, 2, 3], 0]  # 1 + 4 + 4 + 1
    with pytest.raises(MtaError, match=r"line 1: this value holds more than 10 values"):
        load_yaml("- &a [1, 2, 3]\n- *a\n- 0\n- 0\n", "r.yaml")


def test_merge_keys_may_repeat_and_the_keys_after_them_are_still_checked_for_repeats():
    merged = load_yaml("a: &a {x: 1}\nb: &b {y: 2}\nc:\n  <<: *a\n  <<: *b\n  z: 3\n", "r.yaml")
    assert merged["c"] == {"x": 1, "y": 2, "z": 3}
    with pytest.raises(MtaError, match=r"^r\.yaml: line 5: key 'z' is given twice in one mapping \(also line 4\)"):
        load_yaml("a: &a {x: 1}\nc:\n  <<: *a\n  z: 3\n  z: 4\n", "r.yaml")


def test_a_control_character_is_refused_naming_its_line_column_and_code_point():
    with pytest.raises(MtaError) as refused:
        load_yaml("a: 1\nb: 2\nc: x\x07y\n", "r.yaml")
    assert str(refused.value) == (
        "r.yaml: not valid YAML: line 3, column 5: the control character U+0007 is not allowed in YAML "
        "(a binary file, or a character pasted in by mistake?); remove it"
    )


def test_broken_yaml_is_refused_with_pyyamls_line_column_and_problem_on_one_line():
    with pytest.raises(MtaError) as refused:
        load_yaml("a: [1, 2\nb: 3\n", "r.yaml")
    message = str(refused.value)
    assert message.startswith("r.yaml: not valid YAML: line 2, column 2: while parsing a flow sequence, ")
    assert "\n" not in message


def test_pyyamls_errors_without_a_mark_or_a_text_are_still_one_line():
    mark = yaml.Mark("r.yaml", 0, 1, 2, None, None)
    assert yaml_reader.yaml_problem(yaml.MarkedYAMLError(problem="a problem"), "") == "a problem"
    assert yaml_reader.yaml_problem(yaml.MarkedYAMLError(problem_mark=mark), "") == "line 2, column 3: MarkedYAMLError"
    assert yaml_reader.yaml_problem(yaml.YAMLError("two\n   lines"), "") == "two lines"


def test_a_recursion_error_while_loading_is_reported_as_too_deep(monkeypatch):
    def recurse(self):
        raise RecursionError

    monkeypatch.setattr(yaml_reader.BoundedLoader, "get_single_data", recurse)
    with pytest.raises(MtaError, match=r"^r\.yaml: nested too deeply to be a recipe$"):
        load_yaml("a: 1", "r.yaml")


def test_flow_text_is_never_wrapped_and_keeps_the_mappings_order():
    long = {"z": "x" * 1_100_000, "a": 1}
    assert yaml_reader.yaml_text(long) == "{z: " + "x" * 1_100_000 + ", a: 1}"


# --- overrides -------------------------------------------------------------------------------------


def test_an_override_value_may_hold_an_equals_sign():
    assert apply_overrides({}, ["train.report_to=a=b"]) == {"train": {"report_to": "a=b"}}


@pytest.mark.parametrize("override", ["train.lr", "train..lr=1", "=1"])
def test_an_override_that_is_not_key_equals_value_is_refused_with_an_example(override):
    with pytest.raises(MtaError) as refused:
        apply_overrides({}, [override])
    assert str(refused.value) == f"override {override!r} is not of the form key.path=value (e.g. train.lr=5e-5)"


def test_an_index_past_a_list_names_the_list_and_the_valid_range():
    raw = {"loss": {"layers": [{"student": 1}, {"student": 2}]}}
    assert apply_overrides(raw, ["loss.layers.1.student=3"])["loss"]["layers"][1] == {"student": 3}
    for index in ("2", "x"):
        with pytest.raises(MtaError) as refused:
            apply_overrides(raw, [f"loss.layers.{index}.student=3"])
        assert str(refused.value) == (
            f"override 'loss.layers.{index}.student=3': loss.layers.{index} indexes a list of 2 items; "
            "use an index from 0 to 1"
        )


def test_a_key_under_a_value_names_the_value():
    with pytest.raises(MtaError) as refused:
        apply_overrides({"train": {"lr": 1.0}}, ["train.lr.x=1"])
    assert str(refused.value) == "override 'train.lr.x=1': train.lr is a value, not a mapping"


# --- resume ------------------------------------------------------------------------------------------


def test_a_refused_resume_names_both_ways_back_joined():
    changes = ResumeChanges(
        refused=[Change("a.b", 1, 2), Change("c", ABSENT, 3), Change("d", ABSENT, [4])],
    )
    with pytest.raises(MtaError) as refused:
        changes.raise_if_refused("ck")
    message = str(refused.value)
    assert "  a.b: 1 → 2\n  c: (not set) → 3\n  d: (not set) → [4]\n" in message
    assert "Either put the old values back (override a.b=1) and remove c, d from the recipe, or start" in message
    only_removals = ResumeChanges(refused=[Change("c", ABSENT, 3)])
    with pytest.raises(MtaError, match=r"Either remove c from the recipe, or start a new run"):
        only_removals.raise_if_refused("ck")


def test_a_checkpoint_without_its_recipe_or_with_a_list_for_one_is_refused(tmp_path):
    with pytest.raises(MtaError) as refused:
        read_saved_recipe(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path}: no {SAVED_RECIPE}, so the recipe cannot be checked against the one the run was "
        "trained with; copy it from another checkpoint of the run (or final/), or start a new run: "
        "--overwrite or another output_dir"
    )
    (tmp_path / SAVED_RECIPE).write_text("- 1\n", encoding="utf-8")
    with pytest.raises(MtaError) as refused:
        read_saved_recipe(tmp_path)
    assert str(refused.value) == f"{tmp_path / SAVED_RECIPE}: a recipe is a YAML mapping, got list"


def with_train(**train) -> Recipe:
    """The selection tests' minimal recipe with these ``train`` keys."""
    raw = recipe("loss").model_dump(mode="json")
    raw["train"].update(train)
    return Recipe.model_validate(raw)


def test_a_saved_value_the_schema_normalises_is_compared_normalised():
    new = with_train(report_to=["tensorboard"])
    saved = new.model_dump(mode="json")
    saved["train"]["report_to"] = "tensorboard"  # as written: validation makes it a list
    changes = resume_changes(saved, new)
    assert changes.applied == [] and changes.refused == []


def test_numbers_compare_by_value_and_booleans_by_type():
    new = recipe("loss")
    saved = new.model_dump(mode="json")
    saved["train"]["lr"] = int(new.train.lr) if new.train.lr == int(new.train.lr) else new.train.lr
    saved["train"]["max_steps"] = 10.0  # 10 written as a float: the same length
    assert resume_changes(saved, new).refused == []
    saved["train"]["max_steps"] = True
    assert [c.key for c in resume_changes(saved, new).refused + resume_changes(saved, new).applied] == [
        "train.max_steps"
    ]


def test_a_checkpoint_past_the_runs_length_names_the_length_key_it_was_given():
    by_steps = recipe("loss")
    with pytest.raises(MtaError) as refused:
        check_resume_length(12, 10, by_steps, "ck")
    assert str(refused.value) == (
        "ck is at step 12, past the 10 steps this recipe trains (train.max_steps=10); give a length "
        "of at least 12 steps to continue it, or start a new run: --overwrite or another output_dir"
    )
    by_epochs = with_train(max_steps=None, epochs=2.0)
    with pytest.raises(MtaError, match=r"\(train\.epochs=2\); give a length"):
        check_resume_length(12, 10, by_epochs, "ck")
    check_resume_length(10, 10, by_steps, "ck")  # at the end: nothing to refuse


# --- the recipe file ---------------------------------------------------------------------------------


def test_a_recipe_file_exactly_at_the_size_limit_is_read_and_one_byte_more_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(extends, "MAX_RECIPE_BYTES", 8)
    path = tmp_path / "r.yaml"
    path.write_text("a: 12345", encoding="utf-8")
    assert read_recipe_file(path) == ("a: 12345", {"a": 12345})
    path.write_text("a: 123456", encoding="utf-8")
    with pytest.raises(MtaError, match=r"r\.yaml: 9 bytes is not a recipe \(a recipe is a few KB; the limit is 8\)"):
        read_recipe_file(path)


def test_a_missing_binary_or_scalar_recipe_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "r.yaml"
    with pytest.raises(MtaError) as refused:
        read_recipe_file(path)
    assert str(refused.value) == f"recipe file not found: {path}"
    path.write_bytes(b"a: \xff\n")
    with pytest.raises(MtaError, match=rf"^{path}: not a UTF-8 text file \('utf-8' codec can't decode"):
        read_recipe_file(path)
    path.write_text("3\n", encoding="utf-8")
    with pytest.raises(MtaError) as refused:
        read_recipe_file(path)
    assert str(refused.value) == f"{path}: a recipe is a YAML mapping, got int"


def test_a_cycle_is_named_from_the_file_that_closes_it(tmp_path):
    for name, parent in (("a", "b"), ("b", "c"), ("c", "b")):
        (tmp_path / f"{name}.yaml").write_text(f"extends: {parent}\n", encoding="utf-8")
    with pytest.raises(MtaError) as refused:
        recipe_chain(tmp_path / "a.yaml")
    assert str(refused.value) == (
        f"{tmp_path / 'c.yaml'}: extends: b makes a cycle (a.yaml -> b.yaml -> c.yaml -> b.yaml); "
        "a recipe cannot extend itself"
    )


def test_exactly_max_depth_files_may_extend_each_other_and_one_more_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(extends, "MAX_DEPTH", 3)
    for index in range(3):
        (tmp_path / f"r{index}.yaml").write_text(f"extends: r{index + 1}\nk{index}: 1\n", encoding="utf-8")
    (tmp_path / "r3.yaml").write_text("k3: 1\n", encoding="utf-8")
    assert len(recipe_chain(tmp_path / "r1.yaml")) == 3
    with pytest.raises(MtaError) as refused:
        recipe_chain(tmp_path / "r0.yaml")
    assert str(refused.value) == (
        f"{tmp_path / 'r0.yaml'}: more than 3 recipes extend each other; write the shared part into fewer files"
    )


# --- layers ------------------------------------------------------------------------------------------


def test_sra_layers_last_is_each_models_last_layer_and_pairs_are_checked():
    assert resolve_sra_layers("last", 4, 12) == [LayerIndexPair(student=4, teacher=12)]
    pairs = [LayerIndexPair(student=2, teacher=6)]
    assert resolve_sra_layers(pairs, 4, 12) == pairs
    with pytest.raises(
        MtaError, match=r"^loss\.sra_layers\[0\]: teacher layer 13 does not exist; .* `sra_layers: last`\.$"
    ):
        resolve_sra_layers([LayerIndexPair(student=2, teacher=13)], 4, 12)
