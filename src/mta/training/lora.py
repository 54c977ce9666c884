"""LoRA students (``student.lora``): adapters through ``peft``, merged weights on every export.

``wrap`` injects the adapters into the loaded student in place, so it stays a plain transformers
model whose only trainable parameters are ``lora_A`` / ``lora_B`` (seeded by the recipe).
``merged_state_dict`` turns the wrapped student's state dict into the base model's keys with
``W + (alpha / r) · B A`` (transposed for GPT-2's ``Conv1D``), so every export loads without peft
and never carries an ``adapter_config.json`` (transformers would apply it twice); the adapter alone
goes to ``step-N/adapter/``. ZeRO 1-3 train to the same weights (tests/test_lora.py).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, TypeVar

import torch

from mta.errors import MtaError

if TYPE_CHECKING:
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer
    from transformers import PreTrainedModel

    from mta.training.config.schema import LoraSpec

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)

ADAPTER_DIR = "adapter"
ADAPTER_NAME = "default"  # peft's name for a model's only adapter
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # how peft names the base model's keys in an adapter file


def _peft() -> ModuleType:
    try:
        import peft
    except ImportError as error:  # pragma: no cover - peft is a dependency of mta
        raise MtaError(
            "student.lora needs the peft package to train (pip install 'peft>=0.21,<1'); the "
            "trained student it exports loads without it"
        ) from error
    return peft


def lora_config(spec: LoraSpec, *, fan_in_fan_out: bool = False) -> LoraConfig:
    """The ``peft.LoraConfig`` of ``student.lora`` (bias untouched, no DoRA or rsLoRA).
    ``fan_in_fan_out``: the student stores linear weights ``[in, out]`` (GPT-2's ``Conv1D``)."""
    peft = _peft()
    return peft.LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        bias="none",
        target_modules=spec.target_modules,
        task_type="CAUSAL_LM",
        fan_in_fan_out=fan_in_fan_out,
    )


def wrap(model: ModuleT, spec: LoraSpec, *, seed: int) -> ModuleT:
    """Inject ``spec``'s adapters into ``model`` in place and freeze everything else; returns
    ``model``. The adapters' random initialisation draws from ``seed`` (the global RNG is left as
    it was). Works on a meta-device model too (``--dry-run`` counts its parameters)."""
    from transformers.pytorch_utils import Conv1D

    peft = _peft()
    config = lora_config(spec, fan_in_fan_out=any(isinstance(module, Conv1D) for module in model.modules()))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    except ValueError as error:  # target modules that do not exist, or that LoRA cannot adapt
        raise MtaError(
            f"student.lora.target_modules={spec.target_modules!r} does not fit the student "
            f"({type(model).__name__}): {error}. Name the student's linear layers by their last "
            "name part (q_proj, v_proj for Llama / OPT / Qwen; c_attn for GPT-2), or use all-linear"
        ) from error
    for name, module in lora_layers(model).items():
        if not isinstance(module, peft.tuners.lora.layer.Linear):
            raise MtaError(
                f"student.lora.target_modules: {name} is a {type(module).__name__} LoRA layer; mta merges "
                "adapters of linear layers only (attention and MLP projections), not embeddings"
            )
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(_is_adapter_key(name))
    return model


def _is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_layers(model: torch.nn.Module) -> dict[str, LoraLayer]:
    """``{module name: peft LoRA layer}`` of a wrapped model (empty for any other model)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def is_wrapped(model: torch.nn.Module) -> bool:
    return bool(lora_layers(model))


def trainable_parameters(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)


def merged_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The wrapped ``model``'s ``state`` (its own keys) as the plain base model's state dict, each
    adapted weight merged: ``W + scaling · (B @ A)`` computed in fp32 and stored in ``W``'s dtype
    (``(B @ A)ᵀ`` for a ``fan_in_fan_out`` layer such as GPT-2's ``Conv1D``). ``state`` is
    untouched; the model's own tensors are not read (under ZeRO-3 they are shards)."""
    from peft.tuners.lora.layer import Linear

    merged: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(model).items():
        assert isinstance(layer, Linear), f"{name}: wrap admits linear LoRA layers only"
        weight = state[f"{name}.base_layer.weight"]
        lora_a = state[f"{name}.lora_A.{ADAPTER_NAME}.weight"].float()
        lora_b = state[f"{name}.lora_B.{ADAPTER_NAME}.weight"].float()
        delta = lora_b @ lora_a
        if layer.fan_in_fan_out:
            delta = delta.T
        merged[f"{name}.weight"] = (weight.float() + layer.scaling[ADAPTER_NAME] * delta).to(weight.dtype)
    for key, tensor in state.items():
        if _is_adapter_key(key):
            continue
        plain = key.replace(".base_layer.", ".")
        if plain not in merged:  # a merged weight wins over its base (biases pass unchanged)
            merged[plain] = tensor
    return merged


def adapter_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of ``state`` under the names peft's ``adapter_model.safetensors``
    uses (``base_model.model.<module>.lora_A.weight``: the adapter name dropped)."""
    return {
        PEFT_PREFIX + key.replace(f".{ADAPTER_NAME}.", "."): tensor.contiguous()
        for key, tensor in state.items()
        if _is_adapter_key(key)
    }


def save_adapter(
    model: PreTrainedModel, state: dict[str, torch.Tensor], directory: Path, base_model: str | None = None
) -> Path:
    """``directory/adapter/``: the adapter as peft saves one, loadable with
    ``PeftModel.from_pretrained(base, directory / "adapter")``. Main process only; ``directory``
    is a checkpoint being written (published whole, with its checksums, by the caller)."""
    import copy

    from safetensors.torch import save_file

    config = copy.deepcopy(model.peft_config[ADAPTER_NAME])
    config.inference_mode = True  # what PeftModel.save_pretrained records
    if base_model is not None:
        config.base_model_name_or_path = base_model
    target = Path(directory) / ADAPTER_DIR
    target.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state_dict(state), str(target / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config.save_pretrained(str(target))  # adapter_config.json, peft's own writer
    return target


def describe(spec: LoraSpec, trainable: int, total: int) -> str:
    """One line for the run's summary and the dry run."""
    targets = (
        ", ".join(spec.target_modules)
        if isinstance(spec.target_modules, list)
        else (spec.target_modules or "peft's default for the architecture")
    )
    share = 100.0 * trainable / total if total else 0.0
    return (
        f"LoRA student (r {spec.r}, alpha {spec.alpha:g}, dropout {spec.dropout:g}; {targets}): "
        f"{trainable:,} trainable adapter parameters ({share:.2f} % of the student's {total:,}); "
        "the rest frozen; exports hold merged weights"
    )
