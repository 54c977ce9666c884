"""Spans of generated rows (mta.data.online_spans) against what `mta annotate` writes for the
same text and ids: same tokenizer, two tokenizers, GPT-2; multibyte text and a generation cut
inside a character; empty responses, EOS first, the length limit; the worker pool."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import EXAMPLES
from fixtures.annotate import EDGE_ROWS, reference_range, write_jsonl
from mta.data.annotate import AnnotateSettings, run_annotate
from mta.data.annotations import read_annotations
from mta.data.encoding import BYTE_LEVEL_CHARS, TokenizerSide
from mta.data.online_spans import (
    GeneratedRow,
    SpanParser,
    annotate_generated,
    generated_row,
    online_annotator,
)
from mta.errors import MtaError

MULTIBYTE = "Café crème, naïve señor: 茶是一种饮料 👋🏽 and 🎉 done."
ROWS = (
    [json.loads(line) for line in EXAMPLES.read_text().splitlines()[:12] if line.strip()]
    + EDGE_ROWS
    + [
        {"prompt": "Write mixed text.\n", "response": MULTIBYTE},
    ]
)
SPAN_COLUMNS = ("phrase_spans", "word_spans")
TAIL_CHARS = 40  # where a cut row's parse may differ: annotate parsed past the cut, online cannot


def settings_for(teacher, student) -> AnnotateSettings:
    return AnnotateSettings(
        teacher=str(teacher), student=str(student), workers=1, max_length=256, max_prompt_length=160
    )


def annotate_rows(tmp_path_factory, settings: AnnotateSettings) -> list[dict]:
    directory = tmp_path_factory.mktemp("online")
    run_annotate(write_jsonl(directory / "in.jsonl", ROWS), directory / "out", settings)
    return read_annotations(directory / "out").table.to_pylist()


@pytest.fixture(scope="module")
def same(tmp_path_factory, tiny_tokenizer_dir):
    settings = settings_for(tiny_tokenizer_dir, tiny_tokenizer_dir)
    return annotate_rows(tmp_path_factory, settings), online_annotator(settings)


@pytest.fixture(scope="module")
def two(tmp_path_factory, tiny_tokenizer_dir, other_tokenizer_dir):
    settings = settings_for(tiny_tokenizer_dir, other_tokenizer_dir)
    return annotate_rows(tmp_path_factory, settings), online_annotator(settings), settings


def replay(annotator, row: dict, side: str = "student", **changes) -> dict:
    """Feed an annotate row back as a generation: its prompt text, its ids split at the prompt."""
    ids, prompt_len = row[f"{side}_input_ids"], row[f"{side}_prompt_len"]
    values = dict(
        prompt=row["text"][: row["prompt_chars"]],
        prompt_ids=ids[:prompt_len],
        generated_ids=ids[prompt_len:],
        side=side,
        id=row["id"],
    )
    values.update(changes)
    return generated_row(annotator, **values)


def is_complete(row: dict, side: TokenizerSide, name: str = "student") -> bool:
    return row[f"{name}_input_ids"][-1:] == [side.eos_id]


def assert_same_row(got: dict, want: dict, complete: bool) -> None:
    """Every column equal; for a row annotate cut at the limit, spans equal away from the cut."""
    if complete:
        assert got == want
        return
    for column in want:
        if column not in SPAN_COLUMNS:
            assert got[column] == want[column], column
    limit = len(want["text"]) - TAIL_CHARS
    for column in SPAN_COLUMNS:
        assert [s for s in got[column] if s["char_end"] <= limit] == [
            s for s in want[column] if s["char_end"] <= limit
        ], column


def test_same_tokenizer_rows_equal_what_annotate_wrote(same):
    rows, annotator = same
    side = annotator.sides[1]
    assert any(not is_complete(row, side) for row in rows) and any("👋" in row["text"] for row in rows)
    for row in rows:
        got = replay(annotator, row)
        assert_same_row(got, row, is_complete(row, side))
        assert got["teacher_input_ids"] == got["student_input_ids"]


@pytest.mark.parametrize("generator", ["student", "teacher"])
def test_two_tokenizers_rows_equal_what_annotate_wrote(two, generator):
    rows, annotator, _ = two
    maker = annotator.sides[("teacher", "student").index(generator)]
    for row in rows:
        assert_same_row(replay(annotator, row, generator), row, is_complete(row, maker, generator))


def test_the_real_gpt2_tokenizer(tmp_path_factory, gpt2_tokenizer_dir, tiny_tokenizer_dir):
    settings = settings_for(gpt2_tokenizer_dir, tiny_tokenizer_dir)
    rows, annotator = annotate_rows(tmp_path_factory, settings), online_annotator(settings)
    for row in rows:
        for generator in ("teacher", "student"):
            maker = annotator.sides[("teacher", "student").index(generator)]
            assert_same_row(replay(annotator, row, generator), row, is_complete(row, maker, generator))
    row = next(row for row in rows if "👋" in row["text"])
    check_cut_inside_a_character(annotator, row, "teacher")


def test_ids_that_are_not_the_encoding_of_their_text_are_kept(two):
    """The response as single-byte tokens: kept as given, each character shared by its bytes."""
    rows, annotator, _ = two
    student = annotator.sides[1]
    row = next(row for row in rows if row["text"].endswith(MULTIBYTE))
    prompt = row["text"][: row["prompt_chars"]]
    prompt_ids = row["student_input_ids"][: row["student_prompt_len"]]
    byte_token = {byte: student.backend.token_to_id(char) for char, byte in BYTE_LEVEL_CHARS.items()}
    response_ids = [byte_token[byte] for byte in MULTIBYTE.encode()]
    got = generated_row(annotator, prompt, prompt_ids, response_ids + [student.eos_id])

    assert got["text"] == row["text"] and got["prompt_chars"] == row["prompt_chars"]
    assert got["student_input_ids"] == prompt_ids + response_ids + [student.eos_id]
    assert got["student_input_ids"] != row["student_input_ids"]  # not the tokenizer's encoding
    assert got["student_prompt_len"] == len(prompt_ids)
    assert got["teacher_input_ids"] == row["teacher_input_ids"]  # the teacher encodes the text
    # Independent offsets: every byte token of a character covers that character.
    offsets = [tuple(o) for o in student.encode(prompt).offsets]
    offsets += [(len(prompt) + i, len(prompt) + i + 1) for i, char in enumerate(MULTIBYTE) for _ in char.encode()]
    for column in SPAN_COLUMNS:
        assert [(s["char_start"], s["char_end"], s["teacher_start"], s["teacher_end"]) for s in got[column]] == [
            (s["char_start"], s["char_end"], s["teacher_start"], s["teacher_end"]) for s in row[column]
        ]
        for span in got[column]:
            expected = reference_range(offsets, got["text"], span["char_start"], span["char_end"])
            assert (span["student_start"], span["student_end"]) == expected


def check_cut_inside_a_character(annotator, row: dict, side: str) -> dict:
    """Cut the generated ids right after a token that ends inside a character."""
    maker = annotator.sides[("teacher", "student").index(side)]
    ids, prompt_len = row[f"{side}_input_ids"], row[f"{side}_prompt_len"]
    text, encoding = maker.decode_with_offsets([i for i in ids if i != maker.eos_id])
    offsets = encoding.offsets
    # token k ends inside a character the next token finishes: their ranges share it
    k = next(k for k in range(prompt_len, len(ids) - 2) if offsets[k, 1] > offsets[k + 1, 0])
    cut = ids[: k + 1]
    got = replay(annotator, row, side, generated_ids=cut[prompt_len:])
    assert got[f"{side}_input_ids"] == cut
    assert got["text"] == maker.backend.decode(cut, skip_special_tokens=False)
    assert got["text"] == text[: offsets[k + 1, 0]] + "\ufffd"  # the unfinished character
    assert got[f"{side}_prompt_len"] == prompt_len
    _, cut_encoding = maker.decode_with_offsets(cut)
    assert (cut_encoding.offsets[:k] == offsets[:k]).all()
    assert tuple(cut_encoding.offsets[k]) == (offsets[k, 0], len(got["text"]))
    for column in SPAN_COLUMNS:
        for span in got[column]:
            assert span["char_end"] <= len(got["text"])
            assert 0 <= span[f"{side}_start"] < span[f"{side}_end"] <= len(cut)
    return got


@pytest.mark.parametrize("generator", ["student", "teacher"])
def test_a_generation_that_stops_inside_a_multibyte_character(two, generator):
    rows, annotator, _ = two
    row = next(row for row in rows if row["text"].endswith(MULTIBYTE))
    got = check_cut_inside_a_character(annotator, row, generator)
    other = "teacher" if generator == "student" else "student"
    other_side = annotator.sides[("teacher", "student").index(other)]
    assert got[f"{other}_input_ids"] == other_side.encode(got["text"]).ids.tolist()  # no EOS: unfinished


def test_empty_response_eos_first_and_the_length_limit(same, two):
    rows, annotator = same
    empty = next(row for row in rows if row["prompt_chars"] == len(row["text"]))
    eos = annotator.sides[1].eos_id
    assert empty["student_input_ids"][empty["student_prompt_len"] :] == [eos]
    assert replay(annotator, empty) == empty  # EOS as the first generated token
    nothing = replay(annotator, empty, generated_ids=[])  # nothing generated: no EOS either
    assert nothing == {
        **empty,
        "teacher_input_ids": empty["teacher_input_ids"][:-1],
        "student_input_ids": empty["student_input_ids"][:-1],
    }
    # A response that fills the budget: the ids without EOS, spans as annotate's for that text.
    for table, online in ((rows, annotator), two[:2]):
        for row in table:
            if is_complete(row, online.sides[1]):
                ids = row["student_input_ids"][:-1]
                got = replay(online, row, generated_ids=ids[row["student_prompt_len"] :])
                assert got["student_input_ids"] == ids
                assert got["teacher_input_ids"] == row["teacher_input_ids"][:-1]
                assert {k: v for k, v in got.items() if not k.endswith("input_ids")} == {
                    k: v for k, v in row.items() if not k.endswith("input_ids")
                }


def test_eos_ids_per_side_and_a_stop_token_that_is_not_eos(eos_1_tokenizer_dir, eos_2_tokenizer_dir):
    annotator = online_annotator(settings_for(eos_1_tokenizer_dir, eos_2_tokenizer_dir))
    teacher, student = annotator.sides
    prompt = "Q: what is tea?\nA: "
    response = student.encode("Tea is a drink made from leaves.").ids.tolist()
    prompt_ids = student.encode(prompt).ids.tolist()
    finished = generated_row(annotator, prompt, prompt_ids, response + [2])
    assert finished["student_input_ids"] == prompt_ids + response + [2]
    assert finished["teacher_input_ids"] == teacher.encode(finished["text"]).ids.tolist() + [1]
    assert finished["text"] == prompt + "Tea is a drink made from leaves."
    # A chat model's end-of-turn id (here PAD = 0): kept, not decoded, the teacher gets its EOS.
    stopped = generated_row(annotator, prompt, prompt_ids, response + [0], finished=True)
    assert stopped["student_input_ids"][-1] == 0 and stopped["teacher_input_ids"][-1] == 1
    assert {k: stopped[k] for k in ("text", "phrase_spans", "word_spans")} == {
        k: finished[k] for k in ("text", "phrase_spans", "word_spans")
    }
    with pytest.raises(ValueError, match="EOS"):  # padding after the first EOS
        generated_row(annotator, prompt, prompt_ids, response + [2, 2])
    # A prompt text the prompt ids do not decode to: the prompt ends where its ids' text does.
    odd = annotate_generated(annotator, [GeneratedRow("Something else", prompt_ids, response)])
    assert odd.batch.column("prompt_chars").to_pylist() == [len(prompt)]
    assert odd.counts["prompt_not_decoded"] == 1


def test_decoded_text_and_offsets_match_the_tokenizer(tiny_tokenizer_dir):
    side = TokenizerSide.load(tiny_tokenizer_dir)
    rng = np.random.default_rng(0)
    vocabulary = side.backend.get_vocab_size(with_added_tokens=True)
    for _ in range(300):  # mostly single bytes: invalid UTF-8 everywhere
        ids = rng.integers(0, vocabulary + 3, size=rng.integers(0, 16))
        text, encoding = side.decode_with_offsets(ids)
        assert text == side.backend.decode(ids.tolist(), skip_special_tokens=False)
        assert (0 <= encoding.offsets[:, 0]).all() and (encoding.offsets[:, 0] <= encoding.offsets[:, 1]).all()
        assert (encoding.offsets[:, 1] <= len(text)).all()
    for text in (MULTIBYTE, "<|endoftext|> x\n\n  y", ""):
        encoded = side.encode(text)
        decoded, encoding = side.decode_with_offsets(encoded.ids)
        assert decoded == text and (encoding.offsets == encoded.offsets).all()


def test_a_tokenizer_that_is_not_byte_level_is_refused():
    from tokenizers import Tokenizer, decoders, models

    backend = Tokenizer(models.WordLevel({"a": 0, "</s>": 1}, unk_token="a"))
    backend.decoder = decoders.Metaspace()
    side = TokenizerSide("spm", "sha256:x", 1, backend.to_str())
    with pytest.raises(MtaError, match="Metaspace decoder"):
        side.decode_with_offsets([0])


def test_the_worker_pool_returns_what_the_synchronous_path_does(two):
    import torch

    torch.set_num_threads(2)
    torch.ones(256, 256) @ torch.ones(256, 256)  # the parent's thread pool is up before the fork
    rows, annotator, settings = two
    generated = [
        GeneratedRow(
            row["text"][: row["prompt_chars"]],
            row["student_input_ids"][: row["student_prompt_len"]],
            row["student_input_ids"][row["student_prompt_len"] :],
            id=row["id"],
        )
        for row in rows
    ]
    sync = SpanParser(settings, teacher=annotator.sides[0], student=annotator.sides[1]).parse(generated)
    with SpanParser(settings, workers=2, teacher=annotator.sides[0], student=annotator.sides[1]) as parser:
        first, second = parser.submit(generated), parser.submit(generated[::-1])  # both in flight
        bad = parser.submit([GeneratedRow("x", [], [annotator.sides[1].eos_id, 5])])
        assert first.result().batch.equals(sync.batch) and first.result().counts == sync.counts
        assert second.result().batch.to_pylist() == sync.batch.to_pylist()[::-1]
        assert parser.submit([]).result().batch.num_rows == 0
        with pytest.raises(ValueError, match="EOS"):
            bad.result()
        assert len(multiprocessing.active_children()) == 2
    assert multiprocessing.active_children() == []


def test_closing_never_waits_on_work_in_flight(two):
    rows, annotator, settings = two
    row = max(rows, key=lambda row: len(row["text"]))
    generated = [GeneratedRow(row["text"], row["student_input_ids"], [])] * 400  # seconds of work
    with pytest.raises(KeyboardInterrupt):
        with SpanParser(settings, workers=1, teacher=annotator.sides[0], student=annotator.sides[1]) as parser:
            pending = parser.submit(generated)
            started = time.monotonic()
            raise KeyboardInterrupt  # leaving on an error: the busy worker is terminated at once
    assert time.monotonic() - started < 3 and multiprocessing.active_children() == []
    with pytest.raises((RuntimeError, MtaError), match="closed"):
        pending.result(timeout=5)
    with pytest.raises(RuntimeError, match="closed"):
        parser.submit(generated)


KILLED_TRAINER = """
import os, pickle, signal, sys
from mta.data.annotate import AnnotateSettings
from mta.data.online_spans import GeneratedRow, SpanParser
settings, teacher, student, row = pickle.load(open(sys.argv[1], "rb"))
parser = SpanParser(settings, workers=2, teacher=teacher, student=student).start()
import multiprocessing
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
parser.submit([row] * 200)
os.kill(os.getpid(), signal.SIGKILL)  # no close, no atexit: the workers must go by themselves
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_end_with_a_trainer_that_is_killed(two, tmp_path):
    rows, annotator, settings = two
    row = rows[0]
    state = tmp_path / "state.pickle"
    state.write_bytes(
        pickle.dumps((settings, *annotator.sides, GeneratedRow(row["text"], row["student_input_ids"], [])))
    )
    done = subprocess.run(
        [sys.executable, "-c", KILLED_TRAINER, str(state)], capture_output=True, text=True, timeout=60, check=False
    )  # it dies by SIGKILL
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 2, done.stderr

    def alive(pid: int) -> bool:
        try:
            status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        return status != "Z"

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids)
