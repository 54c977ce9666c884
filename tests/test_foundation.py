"""The foundation: tokenizers trained here round-trip and fingerprint stably; the CLI starts."""

from __future__ import annotations

from typer.testing import CliRunner

from mta.models.tokenizers import load_tokenizer, tokenizer_fingerprint


def test_trained_tokenizer_round_trips_text(tiny_tokenizer_dir):
    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    text = "Water evaporates from oceans. 茶是中国的 👋 سلام"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id is not None


def test_fingerprint_is_stable_and_tells_tokenizers_apart(tiny_tokenizer_dir, other_tokenizer_dir):
    first = tokenizer_fingerprint(load_tokenizer(tiny_tokenizer_dir))
    again = tokenizer_fingerprint(load_tokenizer(tiny_tokenizer_dir))
    other = tokenizer_fingerprint(load_tokenizer(other_tokenizer_dir))
    assert first == again
    assert first != other


def test_cli_lists_every_stage():
    from mta_cli.main import app

    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("annotate", "distill", "evaluate", "show"):
        assert command in result.output
