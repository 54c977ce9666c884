"""Edges of ``mta.training.lora`` that mutation testing (bench/mutation.py) found unchecked: the
peft config each recipe key becomes, GPT-2's Conv1D layers wrapped without peft's correction
warning, the messages of refused targets, merged weights kept in their dtype, the adapter file's
names and the summary line."""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from mta.errors import MtaError
from mta.models.tiny import build_tiny_model
from mta.training import lora
from mta.training.config.schema import LoraSpec


def test_each_recipe_key_becomes_the_peft_config_field():
    config = lora.lora_config(LoraSpec(r=3, alpha=12.0, dropout=0.25, target_modules=["q_proj"]))
    assert (config.r, config.lora_alpha, config.lora_dropout) == (3, 12.0, 0.25)
    assert config.target_modules == {"q_proj"} and config.bias == "none"
    assert config.task_type == "CAUSAL_LM" and config.fan_in_fan_out is False
    assert lora.lora_config(LoraSpec(), fan_in_fan_out=True).fan_in_fan_out is True


def test_without_peft_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    with pytest.raises(MtaError) as caught:
        lora.lora_config(LoraSpec())
    assert str(caught.value) == (
        "student.lora needs the peft package to train (pip install 'peft>=0.21,<1'); the "
        "trained student it exports loads without it"
    )


@pytest.fixture(scope="module")
def gpt2_dir(tiny_tokenizer_dir, tmp_path_factory):
    return build_tiny_model(tiny_tokenizer_dir, tmp_path_factory.mktemp("gpt2"), model_type="gpt2")


def test_gpt2s_conv1d_layers_are_wrapped_fan_in_fan_out_without_peft_correcting_it(gpt2_dir):
    model = AutoModelForCausalLM.from_pretrained(gpt2_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lora.wrap(model, LoraSpec(r=2, target_modules=["c_attn"]), seed=0)
    assert not [w for w in caught if "fan_in_fan_out" in str(w.message)]
    assert all(layer.fan_in_fan_out for layer in lora.lora_layers(model).values())


def test_targets_that_do_not_fit_name_the_model_class_and_the_fix(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(MtaError) as caught:
        lora.wrap(model, LoraSpec(target_modules=["c_attn"]), seed=0)
    message = str(caught.value)
    assert f"({type(model).__name__}): " in message
    assert message.endswith(
        ". Name the student's linear layers by their last name part (q_proj, v_proj for Llama / OPT / "
        "Qwen; c_attn for GPT-2), or use all-linear"
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(MtaError) as caught:
        lora.wrap(model, LoraSpec(target_modules=["embed_tokens"]), seed=0)
    assert str(caught.value) == (
        "student.lora.target_modules: model.embed_tokens is a Embedding LoRA layer; mta merges adapters of "
        "linear layers only (attention and MLP projections), not embeddings"
    )


def test_the_adapter_is_named_default_and_merged_weights_keep_their_dtype(tiny_model_dir):
    model = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraSpec(r=2), seed=0)
    assert set(model.peft_config) == {"default"}
    state = {key: tensor.to(torch.bfloat16) for key, tensor in model.state_dict().items()}
    merged = lora.merged_state_dict(model, state)
    assert {tensor.dtype for tensor in merged.values()} == {torch.bfloat16}
    adapter = lora.adapter_state_dict(state)
    assert adapter and all(key.startswith("base_model.model.") for key in adapter)
    assert all(".lora_A.weight" in key or ".lora_B.weight" in key for key in adapter)


def test_the_summary_line_names_the_targets_and_the_trainable_share():
    spec = LoraSpec(r=4, alpha=8.0, dropout=0.05, target_modules=["q_proj", "v_proj"])
    assert lora.describe(spec, 2_500, 1_000_000) == (
        "LoRA student (r 4, alpha 8, dropout 0.05; q_proj, v_proj): 2,500 trainable adapter parameters "
        "(0.25 % of the student's 1,000,000); the rest frozen; exports hold merged weights"
    )
    assert "; all-linear)" in lora.describe(LoraSpec(target_modules="all-linear"), 0, 0)
    assert "peft's default for the architecture): 0 trainable" in lora.describe(LoraSpec(), 0, 0)
    assert "(0.00 % of the student's 0)" in lora.describe(LoraSpec(), 0, 0)
    assert "(25.00 % of the student's 4)" in lora.describe(LoraSpec(), 1, 4)


def test_a_wrapped_model_trains_only_its_adapters_and_saves_an_adapter_peft_loads(tiny_model_dir, tmp_path):
    from peft import PeftModel

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not lora.is_wrapped(plain)
    assert lora.trainable_parameters(plain) == sum(p.numel() for p in plain.parameters())
    model = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraSpec(r=2), seed=0)
    assert lora.is_wrapped(model)
    adapters = {name: p for name, p in model.named_parameters() if "lora_" in name}
    assert lora.trainable_parameters(model) == sum(p.numel() for p in adapters.values()) > 0
    with torch.no_grad():
        for parameter in adapters.values():  # lora_B starts at zero: make the adapter matter
            parameter.normal_(std=0.5)
    target = lora.save_adapter(model, model.state_dict(), tmp_path / "checkpoint", base_model="org/base")
    assert target == tmp_path / "checkpoint" / "adapter"
    assert sorted(p.name for p in target.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((target / "adapter_config.json").read_text(encoding="utf-8"))
    assert config["inference_mode"] is True and config["base_model_name_or_path"] == "org/base"
    assert config["r"] == 2 and model.peft_config["default"].inference_mode is False  # the model's own is kept
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(target)).eval()
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model.eval()(ids).logits, atol=1e-5)
    from safetensors import safe_open

    with safe_open(str(target / "adapter_model.safetensors"), framework="pt") as saved:
        assert saved.metadata() == {"format": "pt"}  # what transformers and peft look for
    assert lora.save_adapter(model, model.state_dict(), tmp_path / "checkpoint") == target  # again: replaced
    unnamed = lora.save_adapter(model, model.state_dict(), tmp_path / "other")
    assert (
        json.loads((unnamed / "adapter_config.json").read_text(encoding="utf-8"))["base_model_name_or_path"]
        != "org/base"
    )
