"""Evaluation set files: the MiniLLM layout, prompts, caps, and every bad-input message."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from mta.data.prompts import alpaca_prompt
from mta.errors import MtaError
from mta.evaluation.datasets import BENCHMARKS, load_rows, resolve_benchmarks, resolve_split_file
from mta.evaluation.download import download_sets


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_rows_use_prompt_or_build_it_from_instruction_and_input(tmp_path):
    path = write_jsonl(
        tmp_path / "set.jsonl",
        [
            {"prompt": "P0", "output": "a"},
            {"instruction": "Do it.", "input": "with this", "output": ["b", "c"]},
            {"instruction": "No input.", "output": "d"},
        ],
    )
    rows, in_file = load_rows(path)
    assert in_file == 3
    assert [r.prompt for r in rows] == ["P0", alpaca_prompt("Do it.", "with this"), alpaca_prompt("No input.")]
    assert [r.references for r in rows] == [("a",), ("b", "c"), ("d",)]
    assert [(r.index, r.line) for r in rows] == [(0, 1), (1, 2), (2, 3)]


def test_limit_and_cap_keep_the_first_rows(tmp_path):
    path = write_jsonl(tmp_path / "set.jsonl", [{"prompt": f"p{i}", "output": "o"} for i in range(7)])
    assert [r.prompt for r in load_rows(path, limit=3)[0]] == ["p0", "p1", "p2"]
    assert len(load_rows(path, cap=5)[0]) == 5
    assert len(load_rows(path, cap=5, limit=6)[0]) == 5
    assert BENCHMARKS["uinst"].cap == 10_000


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "p", "output": "o"}', '{"prompt": "p", "output": '], r"set\.jsonl:2: not valid JSON"),
        (['{"prompt": "p", "output": "o"}', "", '["a list"]'], r"set\.jsonl:3: expected a JSON object"),
        (['{"input": "x", "output": "o"}'], r"set\.jsonl:1: .*neither a 'prompt' nor an 'instruction'"),
        (['{"prompt": "p"}'], r"set\.jsonl:1: 'output' must be"),
        (['{"prompt": " ", "output": "o"}'], r"set\.jsonl:1: 'prompt' must be a non-empty string"),
        (['{"prompt": "p", "output": []}'], r"set\.jsonl:1: 'output' must be"),
        (['{"prompt": "p", "output": ["ok", 3]}'], r"set\.jsonl:1: 'output' must be"),
        (["", "   "], r"set\.jsonl holds no rows"),
    ],
)
def test_bad_set_files_name_the_file_and_line(tmp_path, lines, message):
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(MtaError, match=message):
        load_rows(path)


def test_layout_accepts_the_11_bucket_and_prefers_it(tmp_path):
    write_jsonl(tmp_path / "dolly" / "valid.jsonl", [{"prompt": "p", "output": "o"}])
    write_jsonl(tmp_path / "sinst" / "valid.jsonl", [{"prompt": "plain", "output": "o"}])
    write_jsonl(tmp_path / "sinst" / "11_" / "valid.jsonl", [{"prompt": "bucket", "output": ["o"]}])
    write_jsonl(tmp_path / "uinst" / "11_" / "valid.jsonl", [{"prompt": "u", "output": "o"}])
    found = dict((b.name, p) for b, p in resolve_benchmarks(tmp_path, ["dolly", "sinst", "uinst"]))
    assert found["sinst"] == tmp_path / "sinst" / "11_" / "valid.jsonl"
    assert found["uinst"] == tmp_path / "uinst" / "11_" / "valid.jsonl"


def test_missing_default_set_is_skipped_with_the_path_but_a_named_one_is_an_error(tmp_path, caplog):
    write_jsonl(tmp_path / "dolly" / "valid.jsonl", [{"prompt": "p", "output": "o"}])
    with caplog.at_level(logging.WARNING, logger="mta.evaluation"):
        found = resolve_benchmarks(tmp_path, None)
    assert [b.name for b, _ in found] == ["dolly"]
    assert str(tmp_path / "vicuna" / "valid.jsonl") in caplog.text
    assert str(tmp_path / "uinst" / "11_" / "valid.jsonl") in caplog.text
    with pytest.raises(MtaError, match=r"benchmark 'vicuna' is missing: looked for .*vicuna/valid\.jsonl"):
        resolve_benchmarks(tmp_path, ["dolly", "vicuna"])
    with pytest.raises(MtaError, match="unknown benchmark"):
        resolve_benchmarks(tmp_path, ["dolly", "mmlu"])
    with pytest.raises(MtaError, match="no evaluation set found"):
        resolve_benchmarks(tmp_path / "empty", None)


def test_perplexity_set_names_resolve_to_files(tmp_path):
    dev = write_jsonl(tmp_path / "dolly" / "dev.jsonl", [{"prompt": "p", "output": "o"}])
    test = write_jsonl(tmp_path / "dolly" / "valid.jsonl", [{"prompt": "p", "output": "o"}])
    assert resolve_split_file(tmp_path, "dolly-dev") == dev
    assert resolve_split_file(tmp_path, "dolly") == test
    assert resolve_split_file(tmp_path, str(dev)) == dev
    with pytest.raises(MtaError, match=r"dolly/train\.jsonl"):
        resolve_split_file(tmp_path, "dolly-train")


def test_download_keeps_sets_already_present_and_rejects_unknown_names(tmp_path):
    path = write_jsonl(tmp_path / "vicuna" / "valid.jsonl", [{"prompt": "p", "output": "o"}])
    assert download_sets(tmp_path, ["vicuna"]) == {"vicuna": path}
    with pytest.raises(MtaError, match="unknown set"):
        download_sets(tmp_path, ["squad"])
