"""Hugging Face ``datasets`` inputs and an annotate directory every Parquet reader opens.

- pandas, pyarrow.dataset and ``datasets.load_dataset("parquet", data_dir=DIR)`` read exactly
  ``read_annotations(DIR)``'s rows: no manifest in their way, no part of an unfinished shard set,
  of a superseded run or of a killed run;
- directories of the earlier layout (manifest.json beside the parts) still read, and a writer
  adopts one (reusing its rows);
- a Parquet file, a CSV file and a save_to_disk directory with other column names
  (``fields``) annotate to the same rows as the JSONL of the same content; a bad row names its
  index.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import datasets
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import EXAMPLES
from mta.data import annotate as annotate_module
from mta.data.annotate import AnnotateSettings, run_annotate
from mta.data.annotations import read_annotations
from mta.data.artefact_schema import SCHEMA, SCHEMA_VERSION
from mta.data.prompts import alpaca_prompt
from mta.errors import MtaError
from mta.hashing import directory_checksums, json_sha256
from mta.store.layout import LAYOUT_KEY, LAYOUT_VERSION, META

COMMITTED_V1 = Path(__file__).parent / "data" / "annotate-v1"
LINES = EXAMPLES.read_text(encoding="utf-8").splitlines()
FIELDS = {"prompt": "question", "response": "answer"}


@pytest.fixture(scope="module")
def settings(two_tokenizer_settings) -> AnnotateSettings:
    return two_tokenizer_settings


def rows_file(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def readers(directory: Path, cache: Path) -> dict[str, list[dict]]:
    """The rows each of the three readers finds in ``directory``, sorted by id."""
    frame = pd.read_parquet(directory).sort_values("id")
    loaded = datasets.load_dataset("parquet", data_dir=str(directory), cache_dir=str(cache))
    assert list(loaded) == ["train"]  # one split, whatever the directory is called
    return {
        "pandas": pa.Table.from_pandas(frame, schema=SCHEMA, preserve_index=False).to_pylist(),
        "pyarrow.dataset": pads.dataset(directory, format="parquet").to_table().sort_by("id").to_pylist(),
        "datasets": sorted(loaded["train"].to_list(), key=lambda row: row["id"]),
    }


def expected(directory: Path) -> list[dict]:
    return read_annotations(directory).table.sort_by("id").to_pylist()


def tree(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- the layout


def test_pandas_pyarrow_and_datasets_read_exactly_the_artefacts_rows(tmp_path, settings):
    data = rows_file(tmp_path / "rows.jsonl", LINES[:7])
    out = tmp_path / "dev"  # a split's name: datasets must not take the directory for a split
    for shard in (0, 1):
        run_annotate(data, out, settings, shard=shard, num_shards=2)
    rows = expected(out)
    assert len(rows) >= 4 and {row["id"] % 2 for row in rows} == {0, 1}  # rows of both shards
    assert len(list(out.glob("part-*.parquet"))) == 2  # two parts, each read once
    for reader, found in readers(out, tmp_path / "cache").items():
        assert found == rows, reader


class Killed(BaseException):
    """What SIGKILL leaves: the part is written, nothing after it ran."""


def test_unfinished_superseded_and_orphan_parts_are_read_by_none_of_them(tmp_path, settings, monkeypatch):
    out = tmp_path / "out"
    old_rows = rows_file(tmp_path / "old.jsonl", LINES[:5])
    new_rows = rows_file(tmp_path / "new.jsonl", LINES[5:11])
    run_annotate(old_rows, out, settings)
    before = expected(out)

    # Another input, sharded: shard 0 of 2 written, the set not complete.
    assert run_annotate(new_rows, out, settings, shard=0, num_shards=2).manifest is None
    # The same input unsharded, killed after its part was written, before its shard manifest.
    with monkeypatch.context() as patched:
        patched.setattr(annotate_module, "commit_shard", lambda *args: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            run_annotate(new_rows, out, settings)
    staged = sorted(p.name for p in (out / META / "staging").glob("part-*.parquet"))
    assert [name[:19] for name in staged] == ["part-00000-of-00001", "part-00000-of-00002"]
    assert read_annotations(out).table.to_pylist() == before
    for reader, found in readers(out, tmp_path / "cache-1").items():
        assert found == before, reader  # neither the unfinished shard nor the orphan

    # The next writer of that shard removes the orphan; its own rows replace the old ones.
    run_annotate(new_rows, out, settings)
    after = expected(out)
    assert [row["text"] for row in after] != [row["text"] for row in before]
    assert [name[:19] for name in sorted(p.name for p in (out / META / "staging").glob("part-*"))] == [
        "part-00000-of-00002"  # the unfinished set's part stays staged (it may still complete)
    ]
    for reader, found in readers(out, tmp_path / "cache-2").items():
        assert found == after, reader


def test_a_publish_cut_short_still_reads_and_the_next_writer_finishes_it(tmp_path, settings):
    data = rows_file(tmp_path / "rows.jsonl", LINES[:3])
    out = tmp_path / "out"
    run_annotate(data, out, settings)
    rows = expected(out)
    (part,) = out.glob("part-*.parquet")
    part.rename(out / META / "staging" / part.name)  # killed after manifest.json, before the rename
    assert expected(out) == rows  # mta reads the staged part (its sha256 still checked)
    assert run_annotate(data, out, settings).reused
    assert part.is_file() and not list((out / META / "staging").iterdir())
    assert readers(out, tmp_path / "cache")["pandas"] == rows

    manifest = json.loads((out / META / "manifest.json").read_text(encoding="utf-8"))
    (out / META / "manifest.json").write_text(json.dumps({**manifest, LAYOUT_KEY: LAYOUT_VERSION + 1}))
    with pytest.raises(
        MtaError,
        match=rf"has layout_version {LAYOUT_VERSION + 1}, .*It was written by a "
        r"newer mta: upgrade mta",
    ):
        read_annotations(out)


def flat_layout(source: Path, destination: Path) -> Path:
    """``source`` laid out as mta 0.1 wrote schema version 2: manifest.json and the shard
    manifests beside the parts, no .mta/, no layout_version."""
    shutil.copytree(source, destination)
    meta = destination / META
    manifest = json.loads((meta / "manifest.json").read_text(encoding="utf-8"))
    assert manifest.pop(LAYOUT_KEY) == LAYOUT_VERSION
    (destination / "manifest.json").write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    for shard in meta.glob("shard-*.json"):
        shard.rename(destination / shard.name)
    shutil.rmtree(meta)
    return destination


def test_directories_of_the_earlier_layout_still_read_and_are_adopted_by_writers(tmp_path, settings):
    v1 = read_annotations(COMMITTED_V1)
    assert (v1.stored_version, v1.layout, len(v1)) == (1, 1, 5)

    data = rows_file(tmp_path / "rows.jsonl", LINES[:4])
    today = tmp_path / "today"
    run_annotate(data, today, settings, shard=0, num_shards=2)
    run_annotate(data, today, settings, shard=1, num_shards=2)
    current = read_annotations(today)
    v2 = read_annotations(flat_layout(today, tmp_path / "v2"))
    assert (v2.stored_version, v2.layout) == (SCHEMA_VERSION, 1)  # today's rows, the old layout
    assert v2.table.equals(current.table)
    assert v2.manifest == {k: v for k, v in current.manifest.items() if k != LAYOUT_KEY}
    with pytest.raises(pa.ArrowInvalid):  # the reason for the new layout: the manifest is in the way
        pads.dataset(tmp_path / "v2", format="parquet").to_table()

    # A writer with the same input and settings adopts the directory and reuses its rows.
    assert run_annotate(data, tmp_path / "v2", settings).reused
    adopted = read_annotations(tmp_path / "v2")
    assert adopted.layout == LAYOUT_VERSION and adopted.table.equals(current.table)
    assert tree(tmp_path / "v2") == tree(today)
    assert readers(tmp_path / "v2", tmp_path / "cache")["pyarrow.dataset"] == current.table.to_pylist()

    # An unfinished earlier-layout set: its part is hidden, the next shard completes it.
    partial = flat_layout(today, tmp_path / "partial")
    (partial / "manifest.json").unlink()
    (partial / "shard-00001-of-00002.json").unlink()
    (partial / current.manifest["parts"][1]["file"]).unlink()
    assert run_annotate(data, partial, settings, shard=1, num_shards=2).manifest is not None
    assert read_annotations(partial).table.equals(current.table)
    assert len(list(partial.glob("part-*.parquet"))) == 2 and not list(partial.glob("*.json"))


# --------------------------------------------------------------------------- datasets inputs


def source_rows() -> list[dict]:
    rows = []
    for line in LINES[:4]:
        row = json.loads(line)
        rows.append({"question": alpaca_prompt(row["instruction"], row.get("input")), "answer": row["output"]})
    rows.append({"question": "Q: what is two plus two?\nA: ", "answer": "4"})  # a number, as text
    rows.append({"question": "Say nothing at all.\n", "answer": ""})  # an empty response
    return [dict(row, n=index) for index, row in enumerate(rows)]  # n: a column nobody reads


def write_inputs(directory: Path, rows: list[dict]) -> dict[str, Path]:
    directory.mkdir(exist_ok=True)
    jsonl = directory / "rows.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"prompt": r["question"], "response": r["answer"], "n": r["n"]}) + "\n" for r in rows),
        encoding="utf-8",
    )
    (directory / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, directory / "rows.parquet")
    with open(directory / "rows.csv", "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["question", "answer", "n"])
        writer.writeheader()
        writer.writerows(rows)
    datasets.Dataset(table).save_to_disk(str(directory / "saved"))
    return {
        "jsonl": jsonl,
        "parquet": directory / "rows.parquet",
        "csv": directory / "rows.csv",
        "dataset": directory / "saved",
        "jsonl-mapped": directory / "qa.jsonl",
    }


def test_parquet_csv_and_save_to_disk_inputs_annotate_to_the_rows_of_the_same_jsonl(tmp_path, settings, monkeypatch):
    from mta_cli.main import app

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    inputs = write_inputs(tmp_path / "in", source_rows())
    reference = read_annotations(run_annotate(inputs["jsonl"], tmp_path / "jsonl", settings).directory)
    assert {4, 5} <= set(reference.table.column("id").to_pylist())  # the "4" and the empty response
    mapped = AnnotateSettings(**{**settings.__dict__, "fields": FIELDS})
    for kind in ("parquet", "dataset", "jsonl-mapped"):
        outcome = run_annotate(inputs[kind], tmp_path / kind, mapped)
        annotations = read_annotations(outcome.directory)
        assert annotations.table.equals(reference.table), kind
        assert annotations.manifest["rows"] == reference.manifest["rows"], kind
        recorded = annotations.manifest["input"]
        assert (recorded["format"], recorded["fields"], recorded["rows"]) == (kind.removesuffix("-mapped"), FIELDS, 6)
    assert read_annotations(tmp_path / "dataset").manifest["input"]["sha256"] == json_sha256(
        directory_checksums(inputs["dataset"])
    )
    # CSV through the command line: --field maps the columns, cells are read as text.
    result = CliRunner().invoke(
        app,
        [
            "annotate",
            str(inputs["csv"]),
            "--teacher",
            settings.teacher,
            "--student",
            settings.student,
            "--max-length",
            str(settings.max_length),
            "--max-prompt-length",
            str(settings.max_prompt_length),
            "--workers",
            "1",
            "--field",
            "prompt=question",
            "--field",
            "response=answer",
            "-o",
            str(tmp_path / "csv"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert read_annotations(tmp_path / "csv").table.equals(reference.table)
    # The mapping is part of the run key: without it the same file is another artefact.
    assert run_annotate(inputs["parquet"], tmp_path / "parquet", mapped).reused
    with pytest.raises(MtaError, match="no response field"):
        run_annotate(inputs["parquet"], tmp_path / "parquet", settings)


def test_a_bad_row_of_a_parquet_input_names_its_row(tmp_path, settings, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    rows = source_rows()[:4]
    rows[2]["answer"] = None
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    mapped = AnnotateSettings(**{**settings.__dict__, "fields": FIELDS})
    with pytest.raises(MtaError) as error:
        run_annotate(path, tmp_path / "out", mapped)
    assert (
        f"{path}: row 2: field 'response' is missing or null (columns read as: prompt=question, response=answer)"
        in str(error.value)
    )
    assert "--on-error skip" in str(error.value) and not (tmp_path / "out").exists()

    skipping = AnnotateSettings(**{**mapped.__dict__, "on_error": "skip"})
    annotations = read_annotations(run_annotate(path, tmp_path / "out", skipping).directory)
    assert annotations.table.column("id").to_pylist() == [0, 1, 3]
    assert annotations.manifest["skipped_examples"][0].startswith(f"{path}: row 2: ")

    wrong = AnnotateSettings(**{**settings.__dict__, "fields": {"prompt": "query", "response": "answer"}})
    with pytest.raises(
        MtaError, match=r"has no column 'query' \(read as prompt=query\); its columns are: question, answer, n"
    ):
        run_annotate(path, tmp_path / "other", wrong)
    with pytest.raises(MtaError, match="'respones' is not a key the row formats read"):
        AnnotateSettings(**{**settings.__dict__, "fields": {"respones": "answer"}})


def test_recipe_data_fields_read_a_save_to_disk_directory(tmp_path, settings, tiny_tokenizer_dir, other_tokenizer_dir):
    from pydantic import ValidationError

    from mta.models.tokenizers import load_tokenizer, tokenizer_fingerprint
    from mta.training.config.schema import Recipe
    from mta.training.train_data import load_split

    inputs = write_inputs(tmp_path / "in", source_rows())
    spec = {
        "name": "fields",
        "output_dir": str(tmp_path / "run"),
        "teacher": {"path": "unused", "tokenizer": str(tiny_tokenizer_dir)},
        "student": {"path": "unused", "tokenizer": str(other_tokenizer_dir)},
        "data": {
            "train": str(inputs["dataset"]),
            "max_length": settings.max_length,
            "max_prompt_length": settings.max_prompt_length,
            "fields": FIELDS,
        },
        "train": {"max_steps": 1},
    }
    with pytest.raises(ValidationError, match="'reply' is not a key the row formats read"):
        Recipe.model_validate({**spec, "data": {**spec["data"], "fields": {"reply": "answer"}}})
    fingerprints = {
        side: tokenizer_fingerprint(load_tokenizer(path))
        for side, path in (("teacher", tiny_tokenizer_dir), ("student", other_tokenizer_dir))
    }
    annotations = load_split(
        Recipe.model_validate(spec),
        "train",
        teacher_tokenizer=str(tiny_tokenizer_dir),
        student_tokenizer=str(other_tokenizer_dir),
        fingerprints=fingerprints,
    )
    assert annotations.directory == tmp_path / "run" / "data" / "train"
    reference = read_annotations(run_annotate(inputs["jsonl"], tmp_path / "jsonl", settings).directory)
    assert annotations.table.equals(reference.table)


def test_a_dataset_dict_is_refused_naming_its_splits(tmp_path, settings):
    saved = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "P", "response": "R"}])}).save_to_disk(
        str(saved)
    )
    with pytest.raises(
        MtaError,
        match=rf"is a datasets DatasetDict \(save_to_disk\) with split\(s\) train; give one "
        rf"split's directory, e.g. `mta annotate {saved / 'train'} -o OUT_DIR`",
    ):
        run_annotate(saved, tmp_path / "out", settings)
