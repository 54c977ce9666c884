"""The total limit at its boundary (docs/method.md §1) and each side's own EOS.

A side whose text is ``max_length − 1``, ``max_length`` or ``max_length + 1`` tokens: only the
first leaves the EOS slot, so only it is whole with EOS; the others get no EOS and never exceed
``max_length``. Expectations come from re-tokenising with ``transformers``; the tokenizers have
EOS ids that differ between the sides and from PAD, so a side given the other's EOS shows.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from fixtures.annotate import check_artefact, write_jsonl
from mta.data.annotate import AnnotateSettings, run_annotate
from mta.data.annotations import read_annotations
from mta.data.encoding import TokenizerSide
from mta.data.truncation import FittedText, fit_to_limits

PROMPT = "Question: why is the sky blue?\nAnswer: "
RESPONSE = "Because the air scatters blue light more than red light, the sky looks blue all day. "
MAX_LENGTH, MAX_PROMPT_LENGTH = 48, 32


@pytest.fixture(scope="module")
def tokenizer_dirs(eos_1_tokenizer_dir, eos_2_tokenizer_dir):
    return {"teacher": eos_1_tokenizer_dir, "student": eos_2_tokenizer_dir}


@pytest.fixture(scope="module")
def tokenizers(tokenizer_dirs):
    loaded = {side: AutoTokenizer.from_pretrained(str(path)) for side, path in tokenizer_dirs.items()}
    eos = [tokenizer.eos_token_id for tokenizer in loaded.values()]
    pad = [tokenizer.pad_token_id for tokenizer in loaded.values()]
    assert eos[0] != eos[1] and not set(eos) & set(pad)
    return loaded


def count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def longest_side(tokenizers, text: str) -> int:
    return max(count(tokenizer, text) for tokenizer in tokenizers.values())


def response_of_length(tokenizers, tokens: int) -> str:
    """The shortest head of ``RESPONSE`` after which ``PROMPT + head`` is ``tokens`` long on its
    longer side."""
    for cut in range(len(RESPONSE) + 1):
        if longest_side(tokenizers, PROMPT + RESPONSE[:cut]) == tokens:
            return RESPONSE[:cut]
    raise AssertionError(f"no head of the response gives {tokens} tokens")


@pytest.mark.parametrize("order", ["teacher-first", "student-first"])
@pytest.mark.parametrize("room", [-1, 0, 1])
def test_the_eos_slot_at_the_length_limit(tokenizers, tokenizer_dirs, order, room):
    """max_length = tokens + room: with room 1 the text stays whole and EOS fits; with room 0
    it is kept whole but gets no EOS; with room −1 it is cut where one more character overflows."""
    names = ["teacher", "student"] if order == "teacher-first" else ["student", "teacher"]
    sides = [TokenizerSide.load(tokenizer_dirs[name]) for name in names]
    text = PROMPT + RESPONSE
    max_length = longest_side(tokenizers, text) + room
    fitted = fit_to_limits(PROMPT, RESPONSE, sides, max_length=max_length, max_prompt_length=MAX_PROMPT_LENGTH)
    assert isinstance(fitted, FittedText)
    assert fitted.complete == (room == 1)
    assert text.startswith(fitted.text)
    for name, encoding in zip(names, fitted.encodings, strict=True):
        assert encoding.ids.tolist() == tokenizers[name](fitted.text, add_special_tokens=False)["input_ids"]
        assert len(encoding) + fitted.complete <= max_length  # EOS included
    if room >= 0:
        assert fitted.text == text
    else:
        assert len(fitted.text) < len(text)
        assert longest_side(tokenizers, text[: len(fitted.text) + 1]) > max_length


def test_annotate_ends_each_side_with_its_own_eos_only_when_it_fits(tmp_path, tokenizers, tokenizer_dirs):
    """Rows whose longer side is max_length − 1, max_length and max_length + 1 tokens, through the
    whole annotate stage with a teacher and a student whose EOS ids differ."""
    rows = [{"prompt": PROMPT, "response": response_of_length(tokenizers, MAX_LENGTH + room)} for room in (-1, 0, 1)]
    settings = AnnotateSettings(
        teacher=str(tokenizer_dirs["teacher"]),
        student=str(tokenizer_dirs["student"]),
        workers=1,
        max_length=MAX_LENGTH,
        max_prompt_length=MAX_PROMPT_LENGTH,
    )
    out = tmp_path / "out"
    run_annotate(write_jsonl(tmp_path / "rows.jsonl", rows), out, settings)
    check_artefact(out, rows, tokenizer_dirs["teacher"], tokenizer_dirs["student"], settings)

    records = read_annotations(out).table.to_pylist()
    assert [record["id"] for record in records] == [0, 1, 2]
    fits, full, over = records
    for side, tokenizer in tokenizers.items():
        encoded = tokenizer(fits["text"], add_special_tokens=False)["input_ids"]
        assert fits[f"{side}_input_ids"] == encoded + [tokenizer.eos_token_id]  # its own EOS
        for cut in (full, over):
            ids = cut[f"{side}_input_ids"]
            assert ids == tokenizer(cut["text"], add_special_tokens=False)["input_ids"]
            assert len(ids) <= MAX_LENGTH and tokenizer.eos_token_id not in ids
    assert full["text"] == PROMPT + rows[1]["response"]  # exactly max_length: whole, no EOS
    assert len(over["text"]) < len(PROMPT + rows[2]["response"])
