"""DistiLLM-2's pair rows (prompt, chosen, rejected) through `mta annotate`: each response is its
own artefact row, equal to what a plain prompt/response row with that response gives, carrying
`pair_id` and `role`; files that mix the two kinds are refused; version 1 reads without pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import EXAMPLES
from fixtures.annotate import write_jsonl
from mta.data.annotate import AnnotateSettings, run_annotate
from mta.data.annotations import read_annotations
from mta.errors import MtaError

COMMITTED_V1 = Path(__file__).parent / "data" / "annotate-v1"
PAIR_COLUMNS = ("id", "pair_id", "role")


def pairs() -> list[dict]:
    rows = [json.loads(line) for line in EXAMPLES.read_text(encoding="utf-8").splitlines()[:8]]
    # The teacher's response is a row's reference; the student's is another row's, or multibyte.
    return [
        {
            "id": n,
            "prompt": f"Question {n}: {row['instruction']}\nAnswer: ",
            "chosen": row["output"],
            "rejected": rows[(n + 1) % len(rows)]["output"] if n % 3 else "茶是一种饮料 👋🏽, naïve.",
        }
        for n, row in enumerate(rows)
    ]


@pytest.fixture(scope="module", params=["two tokenizers", "one tokenizer"])
def settings(request, two_tokenizer_settings, tiny_tokenizer_dir) -> AnnotateSettings:
    if request.param == "two tokenizers":
        return two_tokenizer_settings
    return AnnotateSettings(
        teacher=str(tiny_tokenizer_dir),
        student=str(tiny_tokenizer_dir),
        workers=1,
        max_length=256,
        max_prompt_length=160,
    )


def test_each_response_of_a_pair_is_the_row_a_plain_row_would_be(tmp_path, settings):
    rows = pairs()
    run_annotate(write_jsonl(tmp_path / "pairs.jsonl", rows), tmp_path / "pairs", settings)
    singles = [{"prompt": row["prompt"], "response": row[role]} for row in rows for role in ("chosen", "rejected")]
    run_annotate(write_jsonl(tmp_path / "singles.jsonl", singles), tmp_path / "singles", settings)

    got = read_annotations(tmp_path / "pairs").table.to_pylist()
    want = read_annotations(tmp_path / "singles").table.to_pylist()
    assert len(got) == len(want) == 2 * len(rows)
    for position, (pair_row, single) in enumerate(zip(got, want, strict=True)):
        n, half = divmod(position, 2)
        assert (pair_row["id"], pair_row["pair_id"], pair_row["role"]) == (
            2 * n + half,
            n,
            ("chosen", "rejected")[half],
        )
        assert (single["pair_id"], single["role"]) == (None, None)
        # Everything else, both tokenizers' ids and every span, as the plain row has it.
        assert {k: v for k, v in pair_row.items() if k not in PAIR_COLUMNS} == {
            k: v for k, v in single.items() if k not in PAIR_COLUMNS
        }
        assert pair_row["text"] == rows[n]["prompt"] + rows[n][pair_row["role"]]


def test_a_file_that_mixes_pairs_and_single_rows_is_refused_at_the_row(tmp_path, two_tokenizer_settings):
    rows = pairs()[:3]
    mixed = rows[:2] + [{"prompt": "Q: ", "response": "A."}] + rows[2:]
    with pytest.raises(MtaError, match=r"mixed\.jsonl:3: a row without chosen/rejected in a file of pair rows"):
        run_annotate(write_jsonl(tmp_path / "mixed.jsonl", mixed), tmp_path / "out", two_tokenizer_settings)
    assert not (tmp_path / "out").exists()
    other = [{"prompt": "Q: ", "response": "A."}, rows[0]]
    with pytest.raises(MtaError, match=r"other\.jsonl:2: a pair row \(chosen/rejected\) in a file whose first row"):
        run_annotate(write_jsonl(tmp_path / "other.jsonl", other), tmp_path / "out2", two_tokenizer_settings)
    broken = [{"prompt": "Q: ", "chosen": "A."}]
    with pytest.raises(MtaError, match=r"broken\.jsonl:1: field 'rejected' is missing"):
        run_annotate(write_jsonl(tmp_path / "broken.jsonl", broken), tmp_path / "out3", two_tokenizer_settings)


def test_a_version_1_artefact_reads_with_no_pairs():
    table = read_annotations(COMMITTED_V1).table
    assert table.column("pair_id").null_count == table.column("role").null_count == table.num_rows > 0
