"""LoRA students (``student.lora``, ``mta.training.lora``): a tiny run trains the adapters only,
resumes bit-identically, and leaves merged weights that plain transformers loads with peft
unimportable and with peft installed, the adapter applied once; the merge is peft's own, for
Llama's ``nn.Linear`` and GPT-2's transposed ``Conv1D``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fixtures.distill import write_recipe
from mta.errors import MtaError
from mta.training import lora
from mta.training.config.loading import load_recipe
from mta.training.config.resume_rules import read_saved_recipe, resume_changes
from mta.training.config.schema import LoraSpec
from mta.training.trainer import run_distillation

REPO = Path(__file__).resolve().parents[1]
LORA = {"r": 4, "alpha": 16, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}
# Row 0 and 1 of the tokens every model is asked for next-token logits on.
TOKENS = [[5, 17, 42, 99, 7, 250, 3, 64], [300, 12, 12, 80, 401, 9, 33, 2]]

# Loads final/ with transformers in a process where `import peft` fails, and saves its logits.
WITHOUT_PEFT = """
import sys
sys.modules["peft"] = None  # any `import peft` now raises ImportError
try:
    import peft  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("peft is still importable")
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
assert "peft" not in type(model).__module__
with torch.no_grad():
    torch.save(model(torch.tensor({tokens})).logits, sys.argv[2])
"""

pytestmark = pytest.mark.usefixtures("one_thread")


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(torch.tensor(TOKENS)).logits


def with_lora(recipe_path: Path, spec: dict) -> Path:
    """The recipe file with ``student.lora: spec`` added."""
    raw = yaml.safe_load(recipe_path.read_text(encoding="utf-8"))
    raw["student"]["lora"] = spec
    recipe_path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return recipe_path


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


@pytest.mark.slow
def test_a_lora_run_trains_the_adapters_resumes_bit_identically_and_exports_merged_weights(
    tmp_path, tiny_model_dir, tiny_run_recipe
):
    from peft import PeftModel

    out = tmp_path / "run"
    recipe_path = tiny_run_recipe(
        out,
        data={"dev": None},
        train={
            "lr": 2e-2,
            "max_steps": 4,
            "save_interval": 2,
            "keep_checkpoints": 3,
            "schedule": "cosine",
            "warmup_steps": 1,
        },
    )
    with_lora(recipe_path, LORA)
    final = run_distillation(load_recipe(recipe_path))
    first_final = tensors(final / "model.safetensors")
    adapter = out / "checkpoints" / "step-4" / lora.ADAPTER_DIR
    first_adapter = tensors(adapter / lora.ADAPTER_WEIGHTS)

    # Only the adapted projections moved; every other weight is the start's, bit for bit. The
    # exports hold the plain model's keys (no base_layer / lora_ entries).
    start = tensors(tiny_model_dir / "model.safetensors")
    assert first_final.keys() == start.keys()
    adapted = {key for key in start if key.rsplit(".", 2)[-2] in LORA["target_modules"]}
    assert adapted and all(not torch.equal(first_final[key], start[key]) for key in adapted)
    assert all(torch.equal(first_final[key], start[key]) for key in start.keys() - adapted)
    # The adapter is peft's file, keyed as PeftModel.save_pretrained keys it.
    assert first_adapter and all(key.startswith("base_model.model.") and ".lora_" in key for key in first_adapter)
    # No model directory has an adapter_config.json that transformers would apply again.
    assert {p.parent.name for p in out.rglob("adapter_config.json")} == {lora.ADAPTER_DIR}
    assert (final / "checksums.sha256").read_text().count("model.safetensors") == 1

    # The merged weights are the peft model's: final/ (loaded here, peft installed) gives the logits
    # of the start with the checkpoint's adapter applied, and applying it again would show.
    with_peft = AutoModelForCausalLM.from_pretrained(final)
    assert type(with_peft).__module__.startswith("transformers.")
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(adapter))
    expected = logits(peft_model)
    torch.testing.assert_close(logits(with_peft), expected, rtol=0, atol=1e-5)
    twice = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(final), str(adapter))
    assert (logits(twice) - expected).abs().max() > 1e-3  # a double application is visible
    assert (logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir)) - expected).abs().max() > 1e-3

    # transformers alone, peft unimportable, in a fresh process: the same weights, the same logits.
    script = tmp_path / "without_peft.py"
    script.write_text(WITHOUT_PEFT.format(tokens=TOKENS), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, str(script), str(final), str(tmp_path / "logits.pt")], check=True, env=env, capture_output=True
    )
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), logits(with_peft), rtol=0, atol=1e-6)

    # Resume from step 2 (adapter, optimizer moments, schedule and dropout RNG from the checkpoint):
    # steps 3 and 4 again give exactly the same adapter and merged weights.
    again = run_distillation(load_recipe(recipe_path), resume=str(out / "checkpoints" / "step-2"))
    resumed_adapter = tensors(adapter / lora.ADAPTER_WEIGHTS)
    assert resumed_adapter.keys() == first_adapter.keys()
    assert all(torch.equal(resumed_adapter[key], first_adapter[key]) for key in first_adapter)
    resumed_final = tensors(again / "model.safetensors")
    assert all(torch.equal(resumed_final[key], first_final[key]) for key in first_final)

    # A resume may not change the adapters (they are what the checkpoint trained).
    changed = load_recipe(recipe_path, ["student.lora.r=8"])
    refused = resume_changes(read_saved_recipe(out / "checkpoints" / "step-2"), changed).refused
    assert [change.key for change in refused] == ["student.lora.r"]


@pytest.mark.slow
def test_zero_stages_2_and_3_train_the_lora_student_of_stage_1(tmp_path, teacher_dir, tiny_model_dir, same_data):
    """ZeRO-2 partitions the adapters' gradients, ZeRO-3 the frozen base weights too (gathered for
    the merged export): the same merged student as ZeRO-1."""
    finals = {}
    for stage in (1, 2, 3):
        recipe_path = with_lora(
            write_recipe(
                tmp_path / f"z{stage}.yaml",
                teacher=teacher_dir,
                student=tiny_model_dir,
                annotations=same_data,
                output_dir=tmp_path / f"z{stage}",
                data={"dev": None},
                train={"lr": 2e-2, "max_steps": 2, "zero_stage": stage},
            ),
            {**LORA, "dropout": 0.0},
        )
        finals[stage] = tensors(run_distillation(load_recipe(recipe_path)) / "model.safetensors")
    start = tensors(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(finals[1][key], start[key]) for key in start)
    for stage in (2, 3):
        assert finals[stage].keys() == finals[1].keys()
        for key, tensor in finals[stage].items():
            torch.testing.assert_close(tensor, finals[1][key], rtol=1e-4, atol=1e-6, msg=f"zero {stage} {key}")


@pytest.mark.parametrize("model_type, targets", [("llama", ["q_proj", "v_proj"]), ("gpt2", ["c_attn"])])
def test_the_merge_is_the_adapter_applied_once(tiny_tokenizer_dir, tmp_path, model_type, targets):
    """merged_state_dict against the wrapped model itself, on random adapters (B is 0 at first)."""
    from mta.models.tiny import build_tiny_model

    directory = build_tiny_model(tiny_tokenizer_dir, tmp_path / model_type, model_type=model_type)
    wrapped = lora.wrap(
        AutoModelForCausalLM.from_pretrained(directory),
        LoraSpec(r=2, alpha=6, dropout=0.0, target_modules=targets),
        seed=0,
    )
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0, 0.5)
    assert {n for n, p in wrapped.named_parameters() if p.requires_grad} == {
        n for n, _ in wrapped.named_parameters() if ".lora_A." in n or ".lora_B." in n
    }
    merged = lora.merged_state_dict(wrapped, wrapped.state_dict())
    plain = AutoModelForCausalLM.from_pretrained(directory)
    assert merged.keys() == plain.state_dict().keys()
    plain.load_state_dict(merged)
    expected = logits(wrapped)
    torch.testing.assert_close(logits(plain), expected, rtol=0, atol=1e-5)
    assert (logits(AutoModelForCausalLM.from_pretrained(directory)) - expected).abs().max() > 1e-3


def test_lora_keys_are_checked(tiny_model_dir):
    recipe = REPO / "recipes" / "tiny.yaml"
    with pytest.raises(MtaError, match="teacher.lora: LoRA trains the student"):
        load_recipe(recipe, ["teacher.lora.r=4"])
    with pytest.raises(MtaError, match="student.lora.target_modules: name at least one module"):
        load_recipe(recipe, ["student.lora.target_modules=[]"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(MtaError, match=r"student.lora.target_modules=\['c_attn'\] does not fit the student"):
        lora.wrap(model, LoraSpec(target_modules=["c_attn"]), seed=0)
