"""What ``mta distill --dry-run`` shows: the run a recipe describes, without loading a weight.

Both models are built on the meta device from their architecture configs (a JSON file named by
the recipe, a tiny model's description, a local model directory or the Hugging Face cache), so
planning works offline and in seconds even for a 6.7B teacher. ``plan_run`` returns a
``RunPlan``; the CLI renders it (``mta_cli.dry_run_tables``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from mta.distributed import local_device
from mta.dtypes import BYTES_PER_ELEMENT, resolve_precision
from mta.errors import MtaError
from mta.losses.sra import tokenizers_shared_vocabulary
from mta.models.tokenizers import load_tokenizer
from mta.training.config.layers import LayerPair, resolve_layer_map, resolve_sra_layers
from mta.training.config.model_checks import check_sequence_lengths, position_limit
from mta.training.config.schema import ModelSpec, Recipe, TinyModel, unset_variables
from mta.training.model_loading import embedding_rows
from mta.training.tasks import task_of

GIB = 1024**3


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
    return _plan_from_config(spec, role, config, source)


def _plan_from_config(spec: ModelSpec, role: str, config: PretrainedConfig, source: str) -> ModelPlan:
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
    )


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
) -> MemoryEstimate:
    """Per-device bytes after the ZeRO paper's accounting (Rajbhandari et al., 2020).

    Mixed precision (bf16/fp16) keeps 16-bit weights and gradients plus fp32 master weights,
    momentum and variance: 2 + 2 + 12 bytes per trainable parameter; fp32 keeps 4 + 4 + 8.
    ZeRO-1 partitions the optimizer states over the ``world_size`` devices, ZeRO-2 also the
    gradients, ZeRO-3 also the weights. The frozen teacher holds only its weights (partitioned
    when ``teacher_zero3``). Activations follow Korthikanti et al. (2022) without recomputation,
    ``s·b·h·(34 + 5·a·s/h)`` bytes per 16-bit layer, plus the student's logits (16-bit and an
    fp32 copy for the loss, with gradients), the teacher's logits and the teacher hidden states
    kept for the aligned layers.
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
    per_layer = tokens * student.hidden_size * (34 + 5 * student.num_heads * sequence_length / student.hidden_size)
    activations = per_layer * student.num_layers * (1 if mixed else 2)
    activations += tokens * student.vocab_rows * (weight_bytes + 4) * 2

    teacher_weights = 0
    if teacher is not None:
        teacher_bytes = BYTES_PER_ELEMENT[teacher.dtype]
        teacher_weights = teacher.parameters * teacher_bytes
        if teacher_zero3:
            teacher_weights //= world_size
        activations += tokens * teacher.vocab_rows * teacher_bytes
        activations += tokens * teacher.hidden_size * teacher_bytes * (aligned_teacher_layers + 1)
    return MemoryEstimate(
        student_weights=weights,
        student_gradients=gradients,
        optimizer_states=optimizer,
        teacher_weights=teacher_weights,
        activations=int(activations),
    )


def plan_run(recipe: Recipe, world_size: int = 1) -> RunPlan:
    """Everything ``--dry-run`` reports for ``recipe`` on ``world_size`` devices; no weights. The
    recipe's task plans it (``mta.training.tasks``): ``plan_llm_run`` for ``task: llm``,
    ``mta.embedding.training_run`` for ``task: embedding``."""
    return task_of(recipe).plan_run(recipe, world_size)


def plan_llm_run(recipe: Recipe, world_size: int = 1) -> RunPlan:
    """``plan_run`` for ``task: llm``.

    Raises ``MtaError`` when a config cannot be found offline, ``data.max_length`` (or the dev
    samples) needs more positions than a model has, a layer pair points past a model's depth, or
    the global batch cannot be split over ``world_size`` devices.
    """
    if world_size < 1:
        raise MtaError(f"world size must be at least 1, got {world_size}")
    train = recipe.train
    accumulation = train.accumulation_steps(world_size)
    configs = {
        role: load_model_config(spec, recipe, role)
        for role, spec in (("student", recipe.student), ("teacher", recipe.teacher))
        if spec is not None
    }
    # Before the models are built: a length no model can take is the first thing to fix.
    for role, (config, _) in configs.items():
        check_sequence_lengths(
            recipe.data,
            config,
            role,
            model=getattr(recipe, role).path,
            source=recipe.source,
            sample_new_tokens=recipe.dev_sample_new_tokens if role == "student" else 0,
        )
    student = _plan_from_config(recipe.student, "student", *configs["student"])
    teacher = _plan_from_config(recipe.teacher, "teacher", *configs["teacher"]) if recipe.teacher else None
    notes: list[str] = []

    layers: list[LayerPair] = []
    projector_parameters = 0
    if teacher is not None and recipe.loss.alignment_terms:
        layers = resolve_layer_map(recipe.loss.layers, student.num_layers, teacher.num_layers)
    if teacher is not None and "hra" in recipe.loss.alignment_terms and layers:
        # HRA holds one nn.Linear(d_S, d_T) with bias per aligned pair.
        projector_parameters = len(layers) * (student.hidden_size + 1) * teacher.hidden_size
    if teacher is not None and recipe.loss.sra_weight:
        # SRA holds one nn.Linear(d_S, d_T) with bias per span pair, trained with the projectors.
        sra_pairs = resolve_sra_layers(recipe.loss.sra_layers, student.num_layers, teacher.num_layers)
        projector_parameters += len(sra_pairs) * (student.hidden_size + 1) * teacher.hidden_size
        notes.append(_shared_vocabulary_note(recipe))
    logit_loss = recipe.loss.base != "ce"
    if teacher is not None and logit_loss and teacher.vocab_rows != student.vocab_rows:
        notes.append(
            f"embedding rows differ (teacher {teacher.vocab_rows:,}, student "
            f"{student.vocab_rows:,}): the {recipe.loss.base} loss compares the tokenizers' "
            f"common real vocabulary, checked when the tokenizers load"
        )
    if recipe.student.lora is not None and student.trainable_parameters is not None:  # both or neither
        from mta.training import lora

        notes.append(lora.describe(recipe.student.lora, student.trainable_parameters, student.parameters))
    notes.extend(data_notes(recipe))
    if teacher is not None and recipe.teacher_cache.dir is not None:
        notes.extend(teacher_cache_notes(recipe, student, teacher))

    memory = estimate_memory(
        student,
        teacher,
        trainable_extra=projector_parameters,
        aligned_teacher_layers=len({pair.teacher for pair in layers}),
        # auto: what it means on this machine (bf16 on a GPU or a CPU with bf16 instructions)
        precision=resolve_precision(train.precision, local_device()),
        zero_stage=train.zero_stage,
        teacher_zero3=train.teacher_zero3,
        world_size=world_size,
        micro_batch_size=train.micro_batch_size,
        sequence_length=recipe.data.max_length,
    )
    return RunPlan(
        name=recipe.name,
        student=student,
        teacher=teacher,
        layers=layers,
        projector_parameters=projector_parameters,
        world_size=world_size,
        micro_batch_size=train.micro_batch_size,
        accumulation_steps=accumulation,
        global_batch=train.micro_batch_size * accumulation * world_size,
        zero_stage=train.zero_stage,
        teacher_zero3=train.teacher_zero3,
        precision=train.precision,
        memory=memory,
        notes=notes,
    )


def _shared_vocabulary_note(recipe: Recipe) -> str:
    """SRA's shared vocabulary size when both tokenizers are local directories (else when they load)."""
    if not recipe.loss.sra_logit_weight:
        return "SRA: span logit term off (loss.sra_logit_weight=0)"
    teacher = recipe.teacher
    assert teacher is not None, "asked for SRA only, which the schema refuses without a teacher"
    paths = [
        recipe.resolve(spec.tokenizer_path, role) for role, spec in (("teacher", teacher), ("student", recipe.student))
    ]
    if not all((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file() for path in paths):
        return "SRA: the tokenizers' shared vocabulary is counted when they load (not at hand for a dry run)"
    teacher_tokenizer, student_tokenizer = (load_tokenizer(path) for path in paths)
    student_ids, _ = tokenizers_shared_vocabulary(student_tokenizer, teacher_tokenizer)
    if len(student_ids) == 0:
        return "SRA: the tokenizers share no token; the span logit term will be off"
    return f"SRA: {len(student_ids):,} tokens shared by the two vocabularies (its span logit term)"


def teacher_cache_notes(recipe: Recipe, student: ModelPlan, teacher: ModelPlan) -> list[str]:
    """The teacher cache's size per split (``mta teacher``'s artefact), from the annotated rows'
    token counts when ``data.<split>`` is an annotate directory, else an upper bound per row at
    ``data.max_length``; and which micro batches still run the teacher."""
    import pyarrow.compute as pc

    from mta.data.annotations import read_annotations
    from mta.data.artefact_schema import INPUT_IDS, PROMPT_LEN
    from mta.store.layout import holds_artefact
    from mta.training.teacher_cache.content import SizeEstimate, estimate_bytes, human_bytes, teacher_reads

    spec = recipe.teacher_cache
    reads = teacher_reads(recipe, student.num_layers, teacher.num_layers)
    top_k = min(spec.top_k, teacher.vocab_rows)

    def size_of(tokens: int, responses: int, rows: int) -> SizeEstimate:
        return estimate_bytes(
            reads,
            top_k=top_k,
            storage=spec.storage,
            hidden_size=teacher.hidden_size,
            tokens=tokens,
            responses=responses,
            rows=rows,
        )

    what = f"layers {', '.join(map(str, reads.layers)) or 'none'}" + (f", k = {top_k}" if reads.logits else "")
    notes = []
    for key, written in (("data.train", recipe.data.train), ("data.dev", recipe.data.dev)):
        if written is None or unset_variables(written):
            continue
        path = recipe.resolve(written, key)
        if path.is_file():  # rows annotated on first use, into the run's data/ cache
            path = recipe.resolve(recipe.output_dir, "output_dir") / "data" / key.split(".")[1]
        if path.is_dir() and holds_artefact(path):
            table = read_annotations(path).table
            lengths = pc.list_value_length(table.column(INPUT_IDS["teacher"]))
            tokens = int(pc.sum(lengths).as_py() or 0)
            responses = tokens - int(pc.sum(table.column(PROMPT_LEN["teacher"])).as_py() or 0)
            size = size_of(tokens, responses, table.num_rows)
            notes.append(
                f"teacher cache, {key} ({teacher.name}, {what}, {spec.storage}): {human_bytes(size.logits)} logits + "
                f"{human_bytes(size.hidden)} hidden states over {size.rows:,} rows ({human_bytes(size.per_row)} a row; "
                "at most: Parquet's dictionary encoding stores the ids and values in less)"
            )
        else:
            length = recipe.data.max_length
            responses = length - recipe.data.max_prompt_length
            size = size_of(length, responses, 1)
            notes.append(
                f"teacher cache, {key} ({teacher.name}, {what}, {spec.storage}): at most {human_bytes(size.total)} a "
                f"row at data.max_length={length} ({key} is not annotated yet: the total follows its rows)"
            )
    online = "generated and replayed micro batches" if recipe.generation.mode != "off" else None
    notes.append(
        f"teacher cache: gold micro batches read {spec.dir}; "
        + (f"the teacher is loaded for the {online}" if online else "the teacher's weights are never loaded")
    )
    return notes


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
