"""What ``mta distill --dry-run`` shows: the run a recipe describes, without loading a weight.

Both models are built on the meta device from their architecture configs (a JSON file named by
the recipe, a tiny model's description, a local model directory or the Hugging Face cache), so
planning works offline and in seconds even for a 6.7B teacher. ``plan_run`` returns a
``RunPlan``; the CLI renders it (``mta_cli.dry_run_tables``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from mta.dtypes import BYTES_PER_ELEMENT
from mta.errors import MtaError
from mta.task_registry import task_of
from mta.training.config.layers import LayerIndexPair, LayerPair
from mta.training.config.model_checks import position_limit
from mta.training.config.schema import ModelSpec, Recipe, TinyModel, unset_variables
from mta.training.model_loading import embedding_rows

GIB = 1024**3
# fp32 [chunk, vocab] buffers live at once in a fused chunk (mta.losses.fused_head), the student's
# and the teacher's logits among them: 3 to 4 for the losses with a closed form (ce 2, fkl, rkl,
# srkl, tvd 3, skl and jsd 4, mta.losses.closed_form), up to 15 through autograd (DistiLLM-2's
# contrastive terms); measured by bench/logit_memory.py's chunk_buffers.
FUSED_FP32_BUFFERS = 4
FUSED_AUTOGRAD_FP32_BUFFERS = 15


@dataclass(frozen=True)
class ModelPlan:
    """One model as the run will build it (counts from a meta-device instance)."""

    role: str
    name: str
    config_source: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_rows: int
    parameters: int
    dtype: str
    max_positions: int | None = None  # None: the config sets no position limit
    trainable_parameters: int | None = None  # a LoRA student's adapters (None: every parameter trains)
    intermediate_size: int | None = None  # the MLP's width (None: 4 x hidden_size)
    kv_heads: int | None = None  # grouped-query attention's key/value heads (None: num_heads)
    gated_mlp: bool = False  # a gated MLP (SwiGLU: gate and up projections) keeps two more tensors

    def activation_elements_per_token(self, sequence_length: int, eager_attention: bool) -> float:
        """Elements a block keeps for the backward per token, counted on Hugging Face's blocks
        (bench/logit_memory.py): 9 of hidden width (norms, q, attention output, residuals), the
        keys and values, 4 (gated) or 2 of the MLP's width, and with eager attention the softmax's
        ``heads × sequence`` scores (SDPA and flash attention keep none)."""
        hidden = self.hidden_size
        key_value = 2 * hidden * (self.kv_heads or self.num_heads) // self.num_heads
        mlp = (4 if self.gated_mlp else 2) * (self.intermediate_size or 4 * hidden)
        scores = self.num_heads * sequence_length if eager_attention else 0
        return 9 * hidden + key_value + mlp + scores


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device for one training step; a rough guide, not a guarantee.

    Leaves out the CUDA context, allocator fragmentation and DeepSpeed's communication buffers
    (together typically 1 to 3 GiB).
    """

    student_weights: int
    student_gradients: int
    optimizer_states: int
    teacher_weights: int
    activations: int
    # Of the activations: the base loss's logits (whole, or one chunk of logit_chunk positions at a
    # time on the fused path, loss.fused_head) with their gradients and the fused head's gradient.
    logits: int = 0
    logit_chunk: int | None = None  # None: the whole [batch, seq, vocab] logits

    @property
    def total(self) -> int:
        return (
            self.student_weights
            + self.student_gradients
            + self.optimizer_states
            + self.teacher_weights
            + self.activations
        )


@dataclass(frozen=True)
class RunPlan:
    name: str
    student: ModelPlan
    teacher: ModelPlan | None
    layers: list[LayerPair]
    projector_parameters: int
    world_size: int
    micro_batch_size: int
    accumulation_steps: int
    global_batch: int
    zero_stage: int
    teacher_zero3: bool
    precision: str
    memory: MemoryEstimate
    notes: list[str] = field(default_factory=list)
    projectors: str = "HRA projector"  # what projector_parameters counts (task: embedding: TAMD's)
    # task: llm (mta.training.llm.plan): what the run builds from this plan besides the above.
    fdd_layers: list[LayerIndexPair] = field(default_factory=list)
    sra_layers: list[LayerIndexPair] = field(default_factory=list)
    teacher_source: str | None = None  # "online", "cache", "cache + online" (generated micro batches), None
    off_policy: str = "off"  # off_policy.mode: the student's own responses during training
    off_policy_new_tokens: int | None = None  # tokens each generated response may have
    summary: list[str] = field(default_factory=list)  # the plan's lines of the run's log before its first step


def load_model_config(spec: ModelSpec, recipe: Recipe, role: str) -> tuple[PretrainedConfig, str]:
    """The architecture config of ``recipe.<role>``, found offline, and where it came from.

    Order: ``<role>.config`` (a JSON file or directory, relative to the recipe), ``<role>.tiny``,
    a local model directory at ``<role>.path``, then the Hugging Face cache (no network).
    """
    if spec.config is not None:
        path = recipe.resolve(spec.config, key=f"{role}.config")
        if not path.exists():
            raise MtaError(
                f"{recipe.source}: {role}.config={spec.config!r} does not exist (looked for "
                f"{path}); give a config.json path relative to the recipe file"
            )
        return _config_from(path, f"{role}.config"), str(path)
    if spec.tiny is not None:
        return tiny_config(spec.tiny), "tiny: built at first use"
    local = recipe.resolve(spec.path, key=f"{role}.path")
    if (local / "config.json").exists():
        return _config_from(local, f"{role}.path"), str(local)
    cached = _cached_config(spec.path)
    if cached is None:
        raise MtaError(
            f"{recipe.source}: {role}.path={spec.path!r}: no architecture config offline (not a "
            f"local model directory, not in the Hugging Face cache). Add `{role}.config: "
            f"configs/<model>.json` to the recipe, or download the model first."
        )
    return _config_from(cached, f"{role}.path"), f"Hugging Face cache ({spec.path})"


def _cached_config(repo_id: str) -> Path | None:
    """The snapshot directory holding ``repo_id``'s config.json in the hub cache, if any.

    A file lookup only: ``from_pretrained(..., local_files_only=True)`` would still contact
    the hub for its own bookkeeping unless HF_HUB_OFFLINE is set.
    """
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id, so it cannot be cached
        return None
    return Path(found).parent if isinstance(found, str) else None


def tiny_config(tiny: TinyModel) -> PretrainedConfig:
    """The config of the random model ``mta.models.tiny.build_tiny_model`` builds for ``tiny``.

    The vocabulary is the one the tokenizer is trained to; the trained one can be a little
    smaller, which changes the counts by a few embedding rows at most.
    """
    from mta.models.tiny import tiny_config as build_config

    return build_config(
        tiny.model_type,
        tiny.vocab_size,
        num_layers=tiny.num_layers,
        hidden_size=tiny.hidden_size,
        num_heads=tiny.num_heads,
    )


def _config_from(path: Path, key: str) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise MtaError(
            f"{key}: {path} is not a Hugging Face model config ({error}); it needs at least "
            f"a model_type and the model's sizes"
        ) from error


def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The causal LM for ``config`` with every tensor on the meta device: shapes, no memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters: tied input/output embeddings are counted once."""
    return sum(parameter.numel() for parameter in model.parameters())


def plan_model(spec: ModelSpec, recipe: Recipe, role: str) -> ModelPlan:
    config, source = load_model_config(spec, recipe, role)
    return plan_from_config(spec, role, config, source)


def plan_from_config(spec: ModelSpec, role: str, config: PretrainedConfig, source: str) -> ModelPlan:
    model = meta_model(config)
    limit = position_limit(config)
    parameters = parameter_count(model)
    trainable = None
    if spec.lora is not None:  # the adapters the run injects, counted on the meta model
        from mta.training import lora

        trainable = lora.trainable_parameters(lora.wrap(model, spec.lora, seed=0))
    return ModelPlan(
        role=role,
        name=spec.path,
        config_source=source,
        architecture=type(model).__name__,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        vocab_rows=embedding_rows(model),
        parameters=parameters,
        dtype=spec.dtype,
        max_positions=limit[0] if limit else None,
        trainable_parameters=trainable,
        **mlp_shape(config, model),
    )


def mlp_shape(config: PretrainedConfig, model: torch.nn.Module) -> dict[str, Any]:
    """``ModelPlan``'s block widths from a config and its (meta) model: the MLP's width, whether it
    is gated (a ``gate_proj``), the key/value heads."""
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    gated = any(name.rsplit(".", 1)[-1] in ("gate_proj", "gate_up_proj") for name, _ in model.named_modules())
    return {
        "intermediate_size": intermediate,
        "kv_heads": getattr(config, "num_key_value_heads", None),
        "gated_mlp": gated,
    }


def estimate_memory(
    student: ModelPlan,
    teacher: ModelPlan | None,
    *,
    trainable_extra: int,
    aligned_teacher_layers: int,
    precision: str,
    zero_stage: int,
    teacher_zero3: bool,
    world_size: int,
    micro_batch_size: int,
    sequence_length: int,
    logit_chunk: int | None = None,
    fused_buffers: int = FUSED_FP32_BUFFERS,
    eager_attention: bool = False,
) -> MemoryEstimate:
    """Per-device bytes after the ZeRO paper's accounting (Rajbhandari et al., 2020).

    Mixed precision (bf16/fp16) keeps 16-bit weights and gradients plus fp32 master weights,
    momentum and variance: 2 + 2 + 12 bytes per trainable parameter; fp32 keeps 4 + 4 + 8.
    ZeRO-1 partitions the optimizer states over the ``world_size`` devices, ZeRO-2 also the
    gradients, ZeRO-3 also the weights. The frozen teacher holds only its weights (partitioned
    when ``teacher_zero3``). Activations without recomputation, as in Korthikanti et al. (2022)
    but counted on today's blocks (``ModelPlan.activation_elements_per_token``: gated MLPs,
    grouped keys and values, the attention scores only for ``eager_attention``), in the weights'
    dtype, plus the student's logits (16-bit and an fp32 copy for the loss, with gradients), the
    teacher's logits and the teacher hidden states kept for the aligned layers.

    logit_chunk (``loss.chunk_size`` on the fused path, ``loss.fused_head``): the logits exist one
    chunk of positions at a time, so instead of the whole logits a step holds ``fused_buffers``
    fp32 ``[chunk, vocab]`` buffers (both models' logits, log-distributions and the gradient,
    ``FUSED_FP32_BUFFERS`` for a loss with a closed form), each model's 16-bit chunk in a 16-bit
    run and, when the head trains, its weight's gradient summed in fp32 (``vocab × hidden``; the
    gradient in the weight's dtype is among the student's gradients; in fp32 a tied head's second
    gradient, the input embedding's, until they are added).
    """
    # A LoRA student keeps its frozen base weights, and gradients and optimizer states of its
    # adapters only.
    lora_student = student.trainable_parameters is not None
    trainable = (
        student.trainable_parameters if student.trainable_parameters is not None else student.parameters
    ) + trainable_extra
    mixed = precision != "fp32"
    weight_bytes = 2 if mixed else 4
    optimizer_bytes = 12 if mixed else 8
    weights = (trainable + (student.parameters if lora_student else 0)) * weight_bytes
    gradients = trainable * weight_bytes
    optimizer = trainable * optimizer_bytes
    if zero_stage >= 1:
        optimizer //= world_size
    if zero_stage >= 2:
        gradients //= world_size
    if zero_stage >= 3:
        weights //= world_size

    tokens = micro_batch_size * sequence_length
    activation_bytes = 2 if mixed else 4
    per_layer = student.activation_elements_per_token(sequence_length, eager_attention) * activation_bytes
    # The blocks, and the embeddings and final norm around them.
    activations = tokens * (per_layer * student.num_layers + 2 * student.hidden_size * activation_bytes)
    if logit_chunk is None:
        logits = tokens * student.vocab_rows * (weight_bytes + 4) * 2
    else:
        chunk = min(logit_chunk, tokens)
        logits = chunk * student.vocab_rows * (4 * fused_buffers + (weight_bytes if mixed else 0))
        if not lora_student:  # the head's gradient summed in fp32 (or a tied head's second gradient)
            logits += student.vocab_rows * student.hidden_size * 4

    teacher_weights = 0
    if teacher is not None:
        teacher_bytes = BYTES_PER_ELEMENT[teacher.dtype]
        teacher_weights = teacher.parameters * teacher_bytes
        if teacher_zero3:
            teacher_weights //= world_size
        if logit_chunk is None:
            logits += tokens * teacher.vocab_rows * teacher_bytes
        elif teacher_bytes != 4:  # its 16-bit chunk (the fp32 one is among fused_buffers)
            logits += min(logit_chunk, tokens) * teacher.vocab_rows * teacher_bytes
        activations += tokens * teacher.hidden_size * teacher_bytes * (aligned_teacher_layers + 1)
    return MemoryEstimate(
        student_weights=weights,
        student_gradients=gradients,
        optimizer_states=optimizer,
        teacher_weights=teacher_weights,
        activations=int(activations + logits),
        logits=int(logits),
        logit_chunk=logit_chunk,
    )


def plan_run(recipe: Recipe, world_size: int = 1) -> RunPlan:
    """Everything ``--dry-run`` reports for ``recipe`` on ``world_size`` devices; no weights. The
    recipe's task plans it (``mta.task_registry``): ``mta.training.llm.plan`` for ``task: llm``,
    ``mta.embedding.training_run`` for ``task: embedding``."""
    return task_of(recipe).plan_run(recipe, world_size)


def data_notes(recipe: Recipe) -> list[str]:
    """What is missing of ``data.train`` / ``data.dev``: a dry run reports it instead of failing
    (planning is useful before the download)."""
    notes: list[str] = []
    unset: dict[str, list[str]] = {}
    for key, written in (("data.train", recipe.data.train), ("data.dev", recipe.data.dev)):
        if written is None:
            continue
        if missing := unset_variables(written):
            for name in missing:
                unset.setdefault(name, []).append(key)
        elif not (path := recipe.resolve(written, key)).exists():
            from mta.models.hub import is_dataset_id

            if is_dataset_id(written):
                split = recipe.data.train_split if key == "data.train" else recipe.data.dev_split
                notes.append(
                    f"{key}: the Hub dataset {written} (split {split}), read through the Hugging Face cache and "
                    "annotated at first use"
                )
            else:
                notes.append(f"{key}: {path} does not exist yet")
    for name, keys in unset.items():
        notes.append(f"{' and '.join(keys)} use ${name}, which is not set: export {name}=... before training")
    return notes
