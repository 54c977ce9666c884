"""Edges of ``mta.hashing`` and ``mta.scoring`` that mutation testing (bench/mutation.py) found
unchecked: each digest against ``hashlib`` over the documented bytes, the checksum list's format,
hidden files and line numbers, and the protocol's scorer (rougeL, stemmed) built afresh."""

from __future__ import annotations

import builtins
import hashlib
import json
import sys

import numpy as np
import pytest
from rouge_score import rouge_scorer

from mta import scoring
from mta.errors import MtaError
from mta.hashing import (
    CHECKSUMS,
    arrays_sha256,
    checksum_differences,
    checksum_text,
    directory_checksums,
    file_sha256,
    json_sha256,
    read_checksums,
    records_sha256,
)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def framed(parts: list[bytes]) -> bytes:
    return b"".join(len(part).to_bytes(8, "little") + part for part in parts)


def test_each_digest_is_sha256_of_the_documented_bytes(tmp_path):
    blob = bytes(range(256)) * 9000  # 2.3 MB: more than one read block
    (tmp_path / "blob").write_bytes(blob)
    assert file_sha256(tmp_path / "blob") == sha(blob)
    arrays = [np.arange(5, dtype=np.int64), np.array([1.5, -2.0], dtype=np.float32)]
    assert arrays_sha256(arrays) == sha(framed([a.tobytes() for a in arrays]))
    assert arrays_sha256([np.arange(4)]) != arrays_sha256([np.arange(2), np.arange(2, 4)])
    assert json_sha256({"b": [1, "é"], "a": None}) == sha(b'{"a": null, "b": [1, "\\u00e9"]}')
    assert json_sha256({"b": 1, "a": 2}) == json_sha256({"a": 2, "b": 1})
    records = [{"z": 1, "a": tmp_path}, [2, 3]]  # a value JSON cannot hold is hashed as its str()
    plain = [{"a": str(tmp_path), "z": 1}, [2, 3]]
    assert records_sha256(records) == sha(framed([json.dumps(r, sort_keys=True).encode() for r in plain]))


def test_the_list_leaves_out_hidden_files_and_itself_and_uses_posix_paths(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(b"a")
    (tmp_path / "b.txt").write_bytes(b"b")
    (tmp_path / ".partial-write").write_bytes(b"x")
    (tmp_path / CHECKSUMS).write_text("ignored", encoding="utf-8")
    listed = directory_checksums(tmp_path)
    assert listed == {"b.txt": sha(b"b"), "sub/a.bin": sha(b"a")}
    assert checksum_text(listed) == f"{sha(b'b')}  b.txt\n{sha(b'a')}  sub/a.bin\n"


@pytest.mark.parametrize(
    "bad",
    [
        "0" * 63 + "  short.bin",  # a digest of 63 digits
        "0" * 63 + "g  hex.bin",  # 64 characters, one not hex
        "0" * 63 + "X  upper.bin",
        "0" * 64 + "  ",  # no file name
        "0" * 64 + " one-space.bin",  # sha256sum's two spaces are the separator
        "0" * 64 + "  ../outside.bin",
    ],
)
def test_a_malformed_second_line_is_refused_with_its_number(tmp_path, bad):
    (tmp_path / CHECKSUMS).write_text(f"{'a' * 64}  ok.bin\n{bad}\n", encoding="utf-8")
    with pytest.raises(MtaError, match=rf"{CHECKSUMS}:2: not a '<sha256>  <file in this directory>' line"):
        read_checksums(tmp_path)


def test_a_name_with_two_spaces_inside_is_read_whole(tmp_path):
    (tmp_path / CHECKSUMS).write_text(f"{'b' * 64}  a  b.bin\n", encoding="utf-8")
    assert read_checksums(tmp_path) == {"a  b.bin": "b" * 64}


def test_differences_name_missing_changed_and_unlisted_files(tmp_path):
    (tmp_path / "kept").write_bytes(b"1")
    (tmp_path / "changed").write_bytes(b"2")
    (tmp_path / "new").write_bytes(b"3")
    recorded = {"kept": sha(b"1"), "changed": sha(b"two"), "gone": sha(b"4")}
    assert checksum_differences(tmp_path, recorded) == [
        "gone (missing)",
        "changed (changed: sha256 differs)",
        f"new (not in {CHECKSUMS})",
    ]


def test_the_protocol_scorer_is_stemmed_rouge_l_built_afresh():
    scoring.rouge_l_scorer.cache_clear()
    try:
        scorer = scoring.rouge_l_scorer()
        assert list(scorer.rouge_types) == ["rougeL"]
        plain = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
        pair = ("the cats were running home", "a cat runs home")
        assert scorer.score(*pair)["rougeL"] == plain.score(*pair)["rougeL"]
        assert scoring.rouge_l("a cat runs home", ["the cats were running home"]) == pytest.approx(
            100 * plain.score(*pair)["rougeL"].fmeasure
        )
        unstemmed = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False).score(*pair)["rougeL"].fmeasure
        assert scoring.rouge_l("a cat runs home", ["the cats were running home"]) > 100 * unstemmed
    finally:
        scoring.rouge_l_scorer.cache_clear()


def test_nltk_is_imported_with_its_optional_heavy_imports_hidden_then_unhidden(monkeypatch):
    hidden = scoring.HIDDEN_FROM_NLTK
    for name in list(sys.modules):
        if name == "nltk" or name.startswith("nltk.") or any(name == h or name.startswith(h + ".") for h in hidden):
            monkeypatch.delitem(sys.modules, name)
    seen: dict[str, object] = {}
    real_import = builtins.__import__

    def spy(name, *args, **kwargs):
        if name == "nltk" and not seen:
            seen.update({h: sys.modules.get(h, "absent") for h in hidden})
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", spy)
    scoring.import_nltk()
    assert seen == dict.fromkeys(hidden)  # both hidden (None) while nltk imports
    assert "nltk" in sys.modules
    assert all(sys.modules.get(h, "absent") is not None for h in hidden)  # and importable afterwards
    seen.clear()
    scoring.import_nltk()  # nltk is imported already: nothing is imported again
    assert not seen


class RecordingTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return f"  {ids} special={skip_special_tokens}\n"


def test_the_scored_text_is_decoded_without_special_tokens_and_stripped():
    assert scoring.completion_text(RecordingTokenizer(), (4, 5)) == "[4, 5] special=True"


def test_exact_match_compares_squad_normalised_text_against_any_reference():
    assert scoring.normalize_answer("  The CAT, sat!\t(on a mat) ") == "the cat sat on a mat"
    assert scoring.exact_match("The cat.", ["a dog", "the  CAT"]) == 100.0
    assert scoring.exact_match("The cat.", ["a cat"]) == 0.0


def test_rouge_tokens_are_ascii_letter_and_digit_runs():
    assert scoring.has_rouge_tokens("茶 👋 a1") and scoring.has_rouge_tokens("Ünï 7")
    assert not scoring.has_rouge_tokens("茶是一种饮料 👋🏽 — ?")
