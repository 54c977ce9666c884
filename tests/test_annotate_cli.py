"""`mta annotate` and `mta show` through the Typer app, and a run killed mid-write."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from conftest import EXAMPLES, REPO
from mta.data.annotations import read_annotations
from mta.data.encoding import TokenizerSide
from mta.errors import MtaError
from mta_cli.main import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(arg) for arg in args], env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def annotated(tmp_path_factory, tiny_tokenizer_dir, other_tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("cli") / "out"
    result = invoke(
        "annotate",
        EXAMPLES,
        "--teacher",
        tiny_tokenizer_dir,
        "--student",
        other_tokenizer_dir,
        "-o",
        out,
        "--max-length",
        480,
        "--max-prompt-length",
        400,
        "--workers",
        1,
    )
    assert result.exit_code == 0, result.output
    return out


def test_annotate_writes_and_then_reuses(annotated, tiny_tokenizer_dir, other_tokenizer_dir):
    manifest = read_annotations(annotated).manifest
    assert manifest["rows"]["written"] == manifest["rows"]["read"] == 36
    assert manifest["max_length"] == 480
    result = invoke(
        "annotate",
        EXAMPLES,
        "--teacher",
        tiny_tokenizer_dir,
        "--student",
        other_tokenizer_dir,
        "-o",
        annotated,
        "--max-length",
        480,
        "--max-prompt-length",
        400,
    )
    assert result.exit_code == 0
    assert "reused" in result.output


def test_bad_input_exits_with_the_file_and_line(tmp_path, tiny_tokenizer_dir):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"instruction": "x", "output": "y"}\n{"instruction": "x", "output": 3}\n')
    result = invoke(
        "annotate", data, "--teacher", tiny_tokenizer_dir, "--student", tiny_tokenizer_dir, "-o", tmp_path / "out"
    )
    assert isinstance(result.exception, MtaError)  # main() prints it in red and exits 2
    assert f"{data}:2: field 'output' must be a string, got a number: 3" in str(result.exception)
    assert not (tmp_path / "out").exists()


def test_recipe_supplies_tokenizers_and_lengths(tmp_path, tiny_tokenizer_dir, other_tokenizer_dir):
    recipe = {
        "name": "annotate-test",
        "output_dir": str(tmp_path / "run"),
        "teacher": {"path": str(tiny_tokenizer_dir)},
        "student": {"path": "unused-model", "tokenizer": str(other_tokenizer_dir)},
        "data": {"train": "x.jsonl", "max_length": 300, "max_prompt_length": 180, "word_spans": "all"},
        "train": {"max_steps": 1},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    lines = EXAMPLES.read_text(encoding="utf-8").splitlines()[:4]
    data = tmp_path / "four.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = invoke("annotate", data, "--recipe", path, "-o", tmp_path / "out", "--workers", 1)
    assert result.exit_code == 0, result.output
    manifest = read_annotations(tmp_path / "out").manifest
    assert (manifest["max_length"], manifest["max_prompt_length"], manifest["word_spans"]) == (300, 180, "all")
    assert manifest["teacher"]["name"] == str(tiny_tokenizer_dir)
    assert manifest["student"]["name"] == str(other_tokenizer_dir)


def test_a_tiny_recipes_tokenizers_are_built_and_training_accepts_the_artefact(tmp_path, monkeypatch):
    # `--recipe tiny`: its models are built at first use, not Hub names; the artefact must be the
    # one training checks against the same recipe.
    from mta.models.tokenizers import load_tokenizer, tokenizer_fingerprint
    from mta.training.config.loading import load_recipe
    from mta.training.model_loading import tokenizer_sources
    from mta.training.train_data import check_manifest

    monkeypatch.chdir(tmp_path)
    lines = EXAMPLES.read_text(encoding="utf-8").splitlines()[:4]
    (tmp_path / "four.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = invoke("annotate", "four.jsonl", "--recipe", "tiny-cross", "-o", "out", "--workers", 1)
    assert result.exit_code == 0, result.output
    recipe = load_recipe(REPO / "recipes" / "tiny-cross.yaml")
    sources = tokenizer_sources(recipe)
    assert sources["teacher"] != sources["student"]  # two tokenizers, from two corpora
    annotations = read_annotations(tmp_path / "out")
    assert (annotations.manifest["teacher"]["name"], annotations.manifest["student"]["name"]) == (
        sources["teacher"],
        sources["student"],
    )
    assert annotations.table.column("boundary_spans").null_count == 0
    fingerprints = {side: tokenizer_fingerprint(load_tokenizer(path)) for side, path in sources.items()}
    # What training checks before it uses an artefact: no error.
    check_manifest(annotations, recipe, "data.train", sources["teacher"], sources["student"], fingerprints)


def test_shard_option_and_merge(tmp_path, annotated, tiny_tokenizer_dir, other_tokenizer_dir):
    out = tmp_path / "sharded"
    common = [
        "--teacher",
        tiny_tokenizer_dir,
        "--student",
        other_tokenizer_dir,
        "-o",
        out,
        "--max-length",
        480,
        "--max-prompt-length",
        400,
        "--workers",
        1,
    ]
    assert "must look like I/N" in str(invoke("annotate", EXAMPLES, *common, "--shard", "2").exception)
    result = invoke("annotate", EXAMPLES, *common, "--shard", "0/2")
    assert result.exit_code == 0 and "manifest.json appears when every shard" in result.output
    assert "missing: 1" in str(invoke("annotate", "--merge", out).exception)
    assert invoke("annotate", EXAMPLES, *common, "--shard", "1/2").exit_code == 0
    assert read_annotations(out).table.equals(read_annotations(annotated).table)


def test_show_prints_the_row_its_spans_and_both_tokenisations(annotated, tiny_tokenizer_dir, other_tokenizer_dir):
    record = read_annotations(annotated).row(2)
    result = invoke("show", annotated, "--row", 2, "--words")
    assert result.exit_code == 0, result.output
    output = result.output
    assert record["text"].splitlines()[-1] in output
    assert str(tiny_tokenizer_dir) in output and str(other_tokenizer_dir) in output
    # Each phrase row of the table shows its text and its tokens on both sides, as re-tokenised.
    side = TokenizerSide.load(other_tokenizer_dir)
    offsets = side.encode(record["text"]).offsets.tolist()
    for span in record["phrase_spans"][:5]:
        pieces = [
            record["text"][a:b].replace(" ", "·").replace("\n", "↵")
            for a, b in offsets[span["student_start"] : span["student_end"]]
        ]
        assert f"[{span['student_start']},{span['student_end']}) {'|'.join(pieces)}" in output
    assert "word spans" in output


def test_show_refuses_a_row_out_of_range_and_a_missing_artefact(annotated, tmp_path):
    assert "out of range" in str(invoke("show", annotated, "--row", 999).exception)
    assert "has no .mta/manifest.json" in str(invoke("show", tmp_path).exception)


@pytest.mark.slow
def test_a_killed_run_leaves_the_previous_artefact(tmp_path, annotated, tiny_tokenizer_dir, other_tokenizer_dir):
    out = tmp_path / "out"
    shutil.copytree(annotated, out)
    before = read_annotations(out)
    big = tmp_path / "big.jsonl"
    big.write_text(EXAMPLES.read_text(encoding="utf-8") * 40, encoding="utf-8")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mta_cli.main",
            "annotate",
            str(big),
            "--teacher",
            str(tiny_tokenizer_dir),
            "--student",
            str(other_tokenizer_dir),
            "-o",
            str(out),
            "--max-length",
            "480",
            "--max-prompt-length",
            "400",
            "--workers",
            "1",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # Kill once the unfinished part exists: the run is then between opening and committing it.
    deadline = time.monotonic() + 600
    while not list(out.glob(".mta/staging/.part-*.tmp")):
        assert process.poll() is None, "the run ended before it wrote its part"
        assert time.monotonic() < deadline, "no unfinished part appeared in 600 s"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be interrupted"
    assert list(out.glob(".mta/staging/.part-*.tmp")), "the kill landed after the part was committed"
    after = read_annotations(out)
    assert after.manifest == before.manifest and after.table.equals(before.table)
    # The half-written part stays hidden; the only visible part is the previous, complete one.
    assert [p.name for p in out.glob("part-*.parquet")] == [before.manifest["parts"][0]["file"]]
