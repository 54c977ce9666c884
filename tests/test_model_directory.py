"""What transformers and peft read from a model directory: one list (``mta.models.weights``)
that the fingerprint covers, file by file; an adapter in a directory under test is named in the
log and keys its predictions; the directories transformers refuses with a traceback or advice mta
does not follow (an adapter config without weights, a pickle the weights-only loader refuses,
custom code) are one line before or instead of the load."""

from __future__ import annotations

import builtins
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from fixtures.commands import files_of, run_mta
from mta.errors import MtaError
from mta.evaluation import EvalSettings, evaluate_checkpoints
from mta.evaluation import runner as runner_module
from mta.models.weights import (
    ADAPTER_CONFIG,
    MODEL_FILE_PATTERNS,
    checkpoint_fingerprint,
    describe_changes,
    is_model_file,
    model_files,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = EvalSettings(benchmarks=["dolly"], seeds=[10], max_new_tokens=4, max_prompt_length=48, limit=2)
TRAINING_RECORDS = ("recipe.yaml", "trainer_state.json", "versions.json", "README.md", "selection.json")


def names_transformers_and_peft_read() -> set[str]:
    """The file names transformers (config, weights, generation config, tokenizers, chat templates)
    and peft (adapters) look for in a model directory, from their own constants and from every
    tokenizer class's ``VOCAB_FILES_NAMES`` (read from the source: importing them all is slow)."""
    from peft.utils import constants as peft_names
    from transformers import tokenization_utils_base as tokenizer_names
    from transformers import utils
    from transformers.utils import hub

    names = {
        utils.CONFIG_NAME,
        utils.GENERATION_CONFIG_NAME,
        utils.SAFE_WEIGHTS_NAME,
        utils.SAFE_WEIGHTS_INDEX_NAME,
        utils.WEIGHTS_NAME,
        utils.WEIGHTS_INDEX_NAME,
        "model-00001-of-00002.safetensors",
        "pytorch_model-00001-of-00002.bin",
        utils.ADAPTER_CONFIG_NAME,
        utils.ADAPTER_SAFE_WEIGHTS_NAME,
        utils.ADAPTER_WEIGHTS_NAME,
        peft_names.CONFIG_NAME,
        peft_names.SAFETENSORS_WEIGHTS_NAME,
        peft_names.WEIGHTS_NAME,
        tokenizer_names.SPECIAL_TOKENS_MAP_FILE,
        tokenizer_names.ADDED_TOKENS_FILE,
        tokenizer_names.TOKENIZER_CONFIG_FILE,
        tokenizer_names.FULL_TOKENIZER_FILE,
        "tokenizer.v2.json",  # a versioned fast tokenizer (fast_tokenizer_files)
        hub.CHAT_TEMPLATE_FILE,
        hub.LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE,
        f"{hub.CHAT_TEMPLATE_DIR}/tool_use.jinja",
    }
    package = Path(transformers.__file__).parent
    sources = [package / "tokenization_utils_tokenizers.py", *package.glob("models/*/tokenization_*.py")]
    for source in sources:
        for block in re.findall(r"VOCAB_FILES_NAMES\s*=\s*\{(.*?)\}", source.read_text(encoding="utf-8"), re.S):
            names.update(re.findall(r':\s*"([^"]+)"', block))
    return names


def test_the_one_list_holds_every_file_transformers_and_peft_read():
    names = names_transformers_and_peft_read()
    assert len(names) > 40  # the scan found the tokenizer classes' files
    assert sorted(name for name in names if not is_model_file(name)) == []
    # Training records and what mta keeps beside a checkpoint are not model files.
    others = [*TRAINING_RECORDS, "checksums.sha256", "adapter/adapter_model.safetensors", "deepspeed/state/x.pt"]
    assert [name for name in others if is_model_file(name)] == []


def one_of_each(directory: Path) -> list[str]:
    """A file for each pattern of the list (``*`` as ``x``) and each name transformers reads."""
    names = {pattern.replace("*", "x") for pattern in MODEL_FILE_PATTERNS} | names_transformers_and_peft_read()
    for name in sorted(names):
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(f"{name} v1\n", encoding="utf-8")
    for name in TRAINING_RECORDS:
        (directory / name).write_text("not a model file\n", encoding="utf-8")
    return sorted(names)


def test_changing_any_file_transformers_or_peft_read_changes_the_fingerprint(tmp_path):
    names = one_of_each(tmp_path)
    assert model_files(tmp_path) == names
    original, digests = checkpoint_fingerprint(str(tmp_path))
    for name in names:
        path = tmp_path / name
        before = path.read_bytes()
        path.write_bytes(before.replace(b"v1", b"v2"))
        changed, changed_digests = checkpoint_fingerprint(str(tmp_path))
        assert changed != original, name
        assert describe_changes(digests, changed_digests).startswith(f"{name} changed"), name
        path.write_bytes(before)
    for name in TRAINING_RECORDS:
        (tmp_path / name).write_text("changed\n", encoding="utf-8")
    assert checkpoint_fingerprint(str(tmp_path))[0] == original


# --------------------------------------------------------------------------- an adapter under test


@pytest.fixture
def with_adapter(tiny_model_dir, tmp_path) -> Path:
    """The tiny model with a LoRA adapter saved into its own directory: what transformers (with
    peft installed) applies on top of the weights when it loads the directory."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    directory = Path(shutil.copytree(tiny_model_dir, tmp_path / "with-adapter"))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(directory),
        LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    model.save_pretrained(directory)  # adapter_config.json + adapter_model.safetensors
    assert hasattr(AutoModelForCausalLM.from_pretrained(directory), "peft_config")  # the premise: it is applied
    return directory


def test_an_adapter_is_named_in_the_log_and_a_change_to_its_config_is_not_reused(
    with_adapter, data_dir, tmp_path, caplog, monkeypatch
):
    out = tmp_path / "eval"
    with caplog.at_level(logging.WARNING, logger="mta.evaluation.models_under_test"):
        evaluate_checkpoints([with_adapter], ["m"], data_dir, out, SETTINGS)
    (warning,) = [r.getMessage() for r in caplog.records if "peft adapter" in r.getMessage()]
    assert str(with_adapter) in warning and "adapter_config.json, adapter_model.safetensors" in warning
    assert "lora_alpha 4" in warning and "transformers applies it" in warning
    claim = json.loads((out / "predictions" / "m" / "generation.json").read_text())
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(claim["checkpoint_files"])
    before = files_of(out)

    config = json.loads((with_adapter / ADAPTER_CONFIG).read_text())
    config["lora_alpha"] = 64  # same weights, a 16 times stronger adapter
    (with_adapter / ADAPTER_CONFIG).write_text(json.dumps(config))
    monkeypatch.setattr(runner_module, "loaded_checkpoint", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(MtaError) as refused:
        evaluate_checkpoints([with_adapter], ["m"], data_dir, out, SETTINGS)
    assert "adapter_config.json changed" in str(refused.value) and "\n" not in str(refused.value)
    assert files_of(out) == before  # the old predictions stay, never scored as current


# --------------------------------------------------------------------------- refused in one line


def evaluate_args(checkpoint: Path, data_dir: Path, out: Path) -> list:
    return ["evaluate", checkpoint, "--data-dir", data_dir, "-o", out, "--benchmarks", "dolly", "--seeds", "10"] + [
        "--max-new-tokens",
        "4",
        "--limit",
        "2",
    ]


def error_line(lines: list[str]) -> str:
    (line,) = [line for line in lines if line.startswith("error:")]
    return line


def test_an_adapter_config_without_adapter_weights_is_one_line_before_any_model_loads(
    tiny_model_dir, data_dir, tmp_path, monkeypatch, capsys
):
    checkpoint = Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    (checkpoint / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 2, "base_model_name_or_path": "x"}))
    monkeypatch.setattr(runner_module, "loaded_checkpoint", lambda *a, **k: pytest.fail("a model was loaded"))
    code, lines = run_mta(monkeypatch, capsys, *evaluate_args(checkpoint, data_dir, tmp_path / "eval"))
    assert code == 2
    assert error_line(lines).startswith(
        f"error: {checkpoint} has an adapter_config.json but no adapter weights "
        "(adapter_model.safetensors or adapter_model.bin)"
    )
    assert not (tmp_path / "eval").exists()


class RunsCode:
    """Unpickling this runs ``open(path, "w")``: what a planted pytorch_model.bin would do."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (builtins.open, (self.path, "w"))


def test_a_pickle_the_weights_only_loader_refuses_is_one_line_and_runs_nothing(
    tiny_model_dir, data_dir, tmp_path, monkeypatch, capsys
):
    from safetensors.torch import load_file

    checkpoint = Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    state = load_file(checkpoint / "model.safetensors")
    (checkpoint / "model.safetensors").unlink()
    ran = tmp_path / "the-pickle-ran"
    torch.save({**state, "extra": RunsCode(ran)}, checkpoint / "pytorch_model.bin")
    out = tmp_path / "eval"
    code, lines = run_mta(monkeypatch, capsys, *evaluate_args(checkpoint, data_dir, out))
    assert code == 2
    line = error_line(lines)
    assert line.startswith(
        f"error: checkpoint '{checkpoint}': its PyTorch weights (pytorch_model*.bin) are a pickle that "
        "torch's weights-only loader refuses (it pickles io.open)"  # builtins.open's own module
    )
    assert "weights_only` set to `False`" not in line and "add_safe_globals" not in line
    assert not ran.exists()
    # The claim of the label was written before the load; no prediction, no result.
    assert sorted(files_of(out)) == ["predictions/m/generation.json"]


def test_custom_code_is_one_line_that_suggests_no_trust_remote_code(
    tiny_model_dir, data_dir, tmp_path, monkeypatch, capsys
):
    checkpoint = Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(
        model_type="mystery",
        auto_map={"AutoConfig": "configuration_mystery.MysteryConfig", "AutoModelForCausalLM": "m.MysteryLM"},
    )
    (checkpoint / "config.json").write_text(json.dumps(config))
    before = files_of(checkpoint)
    # Left to itself, transformers asks on a terminal whether to run the code: it must not ask.
    monkeypatch.setattr(builtins, "input", lambda *a: pytest.fail("transformers asked to run the custom code"))
    code, lines = run_mta(monkeypatch, capsys, *evaluate_args(checkpoint, data_dir, tmp_path / "eval"))
    assert code == 2
    line = error_line(lines)
    assert line.startswith(
        f"error: checkpoint '{checkpoint}' needs the custom code its files name (auto_map) for the model "
        "type 'mystery', which transformers"
    )
    assert "trust_remote_code" not in line and "hf.co" not in line
    assert not (tmp_path / "eval").exists() and files_of(checkpoint) == before
