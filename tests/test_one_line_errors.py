"""Inputs that used to end in a traceback where a one-line error is promised: YAML with control
characters (recipes, ``extends:`` parents, overrides, a checkpoint's recipe.yaml), a number past
Python's int digit limit in a data row, ``mta show`` on a manifest whose teacher is null."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import EXAMPLES, MINIMAL_RECIPE
from fixtures.commands import files_of, only_line, run_mta
from fixtures.recipes import error_of, write
from mta.data.rows import RowProblem, read_rows
from mta.errors import MtaError
from mta.store.layout import manifest_path
from mta.training.config.resume_rules import read_saved_recipe

MINIMAL = MINIMAL_RECIPE.format(teacher="teacher-model", student="student-model")
CONTROL = "name: a\x00b\n"  # printf 'name: a\x00b\n'
NOT_YAML = "not valid YAML: line 1, column 8: the control character U+0000 is not allowed in YAML"


@pytest.mark.parametrize("where", ["recipe", "extends parent", "override", "checkpoint recipe.yaml"])
def test_a_control_character_in_yaml_is_one_line_naming_where(where, tmp_path):
    if where == "recipe":
        message, named = error_of(write(tmp_path, CONTROL)), tmp_path / "recipe.yaml"
    elif where == "extends parent":
        named = write(tmp_path, CONTROL, "parent.yaml")
        message = error_of(write(tmp_path, "extends: parent.yaml\n" + MINIMAL.replace("name: minimal\n", "")))
    elif where == "override":
        message = error_of(write(tmp_path, MINIMAL), ("train.lr=1\x01",))
        named = "override 'train.lr=1\\x01'"
        assert message.startswith(f"{named}: not valid YAML: line 1, column 2: the control character U+0001")
    else:
        checkpoint = tmp_path / "checkpoints" / "step-2"
        checkpoint.mkdir(parents=True)
        named = write(checkpoint, CONTROL)
        with pytest.raises(MtaError) as refused:
            read_saved_recipe(checkpoint)
        message = str(refused.value)
    if where != "override":
        assert message.startswith(f"{named}: {NOT_YAML}")
    assert "\n" not in message and "<unicode string>" not in message


def test_a_control_character_in_a_recipe_stops_mta_distill_with_one_line(tmp_path, monkeypatch, capsys):
    recipe = write(tmp_path, MINIMAL.replace("name: minimal", "name: mini\x00mal"))
    before = files_of(tmp_path)
    code, lines = run_mta(monkeypatch, capsys, "distill", "--recipe", recipe)
    assert code == 2
    assert only_line(lines, "error:") == (
        f"error: {recipe}: not valid YAML: line 1, column 11: the control character U+0000 is not allowed in "
        "YAML (a binary file, or a character pasted in by mistake?); remove it"
    )
    assert files_of(tmp_path) == before  # nothing written (no runs/minimal)


# --------------------------------------------------------------------------- data rows


@pytest.fixture
def long_number_rows(tmp_path) -> Path:
    """The example rows with a 5,000-digit integer ``id`` in the second (Python reads 4,300)."""
    lines = EXAMPLES.read_text(encoding="utf-8").splitlines()[:4]
    row = json.loads(lines[1])
    lines[1] = '{"id": ' + "7" * 5000 + ", " + json.dumps(row)[1:]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


PROBLEM = (
    "unreadable JSON: Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits "
    "(write a number this long as a JSON string)"
)


def test_a_number_past_the_int_digit_limit_is_a_bad_row(long_number_rows):
    rows = list(read_rows(long_number_rows))
    assert [type(row).__name__ for row in rows] == ["Example", "RowProblem", "Example", "Example"]
    assert isinstance(rows[1], RowProblem) and rows[1].describe(long_number_rows) == f"{long_number_rows}:2: {PROBLEM}"


def test_mta_annotate_skips_or_refuses_a_number_past_the_int_digit_limit(
    long_number_rows, tiny_tokenizer_dir, tmp_path, monkeypatch, capsys
):
    def annotate(out: Path, *extra: str):
        tokenizers = ["--teacher", tiny_tokenizer_dir, "--student", tiny_tokenizer_dir]
        return run_mta(
            monkeypatch, capsys, "annotate", long_number_rows, *tokenizers, "-o", out, "--workers", "1", *extra
        )

    code, lines = annotate(tmp_path / "refused")
    assert code == 2
    assert only_line(lines, "error:").startswith(f"error: {long_number_rows}:2: {PROBLEM} (fix the row, or pass")
    assert not (tmp_path / "refused").exists()

    from mta.data.annotations import read_annotations

    code, lines = annotate(tmp_path / "skipped", "--on-error", "skip")
    assert code == 0, "\n".join(lines)
    manifest = read_annotations(tmp_path / "skipped").manifest
    assert manifest["rows"]["read"] == 4 and manifest["rows"]["written"] == 3


def test_mta_evaluate_refuses_a_number_past_the_int_digit_limit_in_one_line(
    long_number_rows, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    data = tmp_path / "data" / "dolly" / "valid.jsonl"
    data.parent.mkdir(parents=True)
    shutil.copy(long_number_rows, data)
    out = tmp_path / "eval"
    args = ["evaluate", tiny_model_dir, "--data-dir", tmp_path / "data", "-o", out, "--benchmarks", "dolly"]
    code, lines = run_mta(monkeypatch, capsys, *args)
    assert code == 2
    assert only_line(lines, "error:").startswith(f"error: {data}:2: unreadable JSON (Exceeds the limit (4300 digits)")
    assert not out.exists()


# --------------------------------------------------------------------------- mta show


def test_mta_show_on_a_manifest_whose_teacher_is_null_is_one_line(same_data, tmp_path, monkeypatch, capsys):
    directory = Path(shutil.copytree(same_data, tmp_path / "annotations"))
    path = manifest_path(directory)
    manifest = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**manifest, "teacher": None}), encoding="utf-8")
    before = files_of(directory)
    code, lines = run_mta(monkeypatch, capsys, "show", directory)
    assert code == 2
    assert only_line(lines, "error:") == (
        f"error: {directory}: its manifest's 'teacher' is None, not the tokenizer record {{name, fingerprint}} "
        "`mta annotate` writes; the manifest was changed by hand or by another program: annotate the input "
        "again into a new directory"
    )
    assert files_of(directory) == before
