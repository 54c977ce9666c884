"""An embedding recipe (``task: embedding``, TALAS) as a ``Run`` of the one training loop.

``mta.training.trainer.build_run`` hands a ``task: embedding`` recipe to ``build_embedding_run``
(through the task registry: ``mta.embedding.task``), which builds what the loop needs from it:
the encoder student (``AutoModel``; a ``tiny`` encoder built at first use), the teacher's stored
embeddings of ``data.train`` / ``data.dev`` (``mta.embedding.training_data``; the teacher model is
loaded only to embed rows at first use), ``EmbeddingObjective`` and the DeepSpeed engine.
``Trainer`` then runs it exactly as an LLM run: batches, accumulation, ASAM, checkpoints, resume,
dev loss, ``final/`` (here a Hugging Face encoder that is also a sentence-transformers model:
``mta.embedding.export``).

``plan_embedding_run`` is the same recipe for ``mta distill --dry-run``: meta-device models, no
weights, no data read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mta import distributed
from mta.embedding.objective import EmbeddingDistillationModel, EmbeddingObjective
from mta.embedding.recipe import EmbeddingRecipe, EncoderSpec
from mta.embedding.training_data import EmbeddingExamples, describe_embeddings, load_teacher_embeddings
from mta.errors import MtaError
from mta.reporting import Reporter
from mta.task_registry import Task
from mta.training import engine as engines
from mta.training.batching import StepSchedule
from mta.training.config import resume_rules
from mta.training.config.model_checks import position_limit
from mta.training.dry_run import (
    ModelPlan,
    RunPlan,
    data_notes,
    estimate_memory,
    load_model_config,
    mlp_shape,
    parameter_count,
)
from mta.training.lifecycle import checkpointing, run_directory

KEY_LENGTH = 12


def encoder_source(spec: EncoderSpec, recipe: EmbeddingRecipe, role: str) -> tuple[str, str]:
    """``(model, tokenizer)`` directories or hub names of ``recipe.<role>``, building a ``tiny``
    encoder first: its WordPiece tokenizer trained on ``tiny.tokenizer_corpus`` into
    ``output_dir/models/wordpiece-<vocab>-<key>`` (shared by encoders of one corpus and size), the
    model at ``<path>-<key>`` under ``output_dir`` (``mta.embedding.tiny_encoders``)."""
    from mta.training.model_loading import local_or_hub_sources, tiny_tokenizer_corpus

    if spec.tiny is None:
        return local_or_hub_sources(spec, recipe, role)
    from mta.embedding.tiny_encoders import build_tiny_encoder, build_wordpiece_tokenizer
    from mta.models.tiny import corpus_texts

    tiny = spec.tiny
    output_dir = recipe.resolve(recipe.output_dir, "output_dir")
    if spec.tokenizer:
        tokenizer_dir = recipe.resolve(spec.tokenizer, f"{role}.tokenizer")
    else:
        corpus, key = tiny_tokenizer_corpus(spec, recipe, role)
        tokenizer_dir = output_dir / "models" / f"wordpiece-{tiny.vocab_size}-{key}"
        build_wordpiece_tokenizer(tokenizer_dir, vocab_size=tiny.vocab_size, texts=corpus_texts(corpus))
    directory = Path(spec.path).expanduser()
    model_dir = build_tiny_encoder(
        directory if directory.is_absolute() else output_dir / directory,
        layers=tiny.num_layers,
        hidden=tiny.hidden_size,
        heads=tiny.num_heads,
        vocab_size=None,
        seed=tiny.seed,
        tokenizer=tokenizer_dir,
        max_position=max(512, recipe.data.max_length),
    )
    return str(model_dir), str(tokenizer_dir)


def check_text_length(recipe: EmbeddingRecipe, config) -> None:
    """Refuse ``data.max_length`` beyond the student's positions (RoBERTa-style models, MPNet
    among them, number positions from padding_idx + 1: two fewer)."""
    found = position_limit(config)
    if found is None:
        return
    limit, attribute = found
    offset = 2 if getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "mpnet") else 0
    if recipe.data.max_length > limit - offset:
        where = f"{recipe.source}: " if recipe.source else ""
        raise MtaError(
            f"{where}data.max_length={recipe.data.max_length:,} is longer than the student "
            f"({recipe.student.path}) takes: {limit - offset:,} tokens ({attribute} {limit:,} in its config); "
            f"set data.max_length to at most {limit - offset:,}"
        )


def load_student(recipe: EmbeddingRecipe):
    """The student encoder (``AutoModel``, weights in ``student.dtype``) and its tokenizer."""
    from transformers import AutoModel

    from mta.dtypes import torch_dtype
    from mta.models.hub import load_pretrained
    from mta.models.tokenizers import load_tokenizer

    model_path, tokenizer_path = encoder_source(recipe.student, recipe, "student")
    tokenizer = load_tokenizer(tokenizer_path)
    model = load_pretrained(
        AutoModel.from_pretrained,
        model_path,
        what="student.path",
        dtype=torch_dtype(recipe.student.dtype),
        otherwise=f"student.path: cannot load an encoder from '{model_path}' with AutoModel (give a local "
        "Hugging Face or sentence-transformers directory, or a hub name in the Hugging Face cache)",
    )
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise MtaError(
            f"student: the tokenizer '{tokenizer_path}' has {len(tokenizer)} tokens but the model "
            f"'{model_path}' only {model.get_input_embeddings().num_embeddings} embedding rows; set "
            "student.tokenizer to the model's own tokenizer"
        )
    return model, tokenizer


def build_embedding_run(
    recipe: EmbeddingRecipe, reporter: Reporter, task: Task, *, resume: str | None = None, overwrite: bool = False
):
    """``build_run`` for ``task: embedding``: claim the output directory, load the student and
    the teacher embeddings, check they fit, start the DeepSpeed engine; ``task`` goes on the run."""
    from mta.training.lifecycle.utilisation import StepFlops
    from mta.training.trainer import Run

    rank, world_size = engines.init_distributed()
    device = distributed.local_device()
    precision = engines.resolve_training_precision(recipe.train, device)
    output_dir = recipe.resolve(recipe.output_dir, "output_dir")
    owner = run_directory.claim(output_dir, recipe.name, resume=resume, overwrite=overwrite)
    resume_from = checkpointing.resolve_resume(resume, output_dir)
    resumed_with = resume_rules.check_resume(resume_from, recipe) if resume_from is not None else None

    # Rank 0 builds tiny models and embeds rows first; the others then find them cached.
    with distributed.main_process_first():
        student, tokenizer = load_student(recipe)
        teacher = encoder_source(recipe.teacher, recipe, "teacher")[0] if recipe.teacher is not None else None
        splits = {
            split: load_teacher_embeddings(
                recipe, split, teacher_model=teacher, reporter=reporter if rank == 0 else None
            )
            for split in ("train", "dev")
        }
    check_text_length(recipe, student.config)
    train, dev = splits["train"], splits["dev"]
    if dev is not None and dev.dimension != train.dimension:
        raise MtaError(
            f"data.dev's teacher embeddings are {dev.dimension} wide, data.train's {train.dimension}: "
            "embed both with the same teacher"
        )
    config = student.config.get_text_config()
    torch.manual_seed(recipe.seed)  # the TAMD projections' initialisation follows the recipe's seed
    objective = EmbeddingObjective(
        recipe.loss,
        num_layers=config.num_hidden_layers,
        student_dim=config.hidden_size,
        teacher_dim=train.dimension,
        pooling=recipe.student.pooling,
    )
    examples = {
        split: EmbeddingExamples(found, tokenizer, recipe.data.max_length) if found is not None else None
        for split, found in splits.items()
    }
    accumulation = recipe.train.accumulation_steps(world_size)
    schedule = StepSchedule(len(examples["train"]), recipe.train.micro_batch_size, accumulation, world_size)
    total_steps = schedule.total_steps(recipe.train.epochs, recipe.train.max_steps)
    model = EmbeddingDistillationModel(student, objective, max_seq_length=recipe.data.max_length)
    engine = initialize_engine(model, recipe, total_steps, world_size, precision)
    messages = [
        precision.describe(),
        *_summary(recipe, objective, accumulation, world_size, schedule, total_steps, splits),
    ]
    if resumed_with is not None:
        messages += resumed_with.log_lines()
    return Run(
        recipe=recipe,
        task=task,
        plan=None,  # planned for --dry-run only (plan_embedding_run)
        output_dir=output_dir,
        run_id=owner.run_id,
        engine=engine,
        teacher=None,
        tokenizer=tokenizer,
        train=examples["train"],
        dev=examples["dev"],
        schedule=schedule,
        total_steps=total_steps,
        rank=rank,
        world_size=world_size,
        device=device,
        resume_from=resume_from,
        messages=messages,
        precision=precision,
        flops=StepFlops(engine.module, engine.module.student),
    )


def initialize_engine(
    model: EmbeddingDistillationModel,
    recipe: EmbeddingRecipe,
    total_steps: int,
    world_size: int,
    precision: engines.TrainingPrecision | None = None,
):
    """The DeepSpeed engine over ``model`` (``mta.training.engine.initialize``).

    With ``loss.reference_code`` and ``train.grad_clip`` > 0 the gradient is clipped as the
    author's loop clips it (``train_asam.py``: ``clip_grad_norm_(student.parameters(), 1.0)``
    before each of SAM's two steps): DeepSpeed's clipping, one norm over every parameter, is off;
    just before each optimizer step the student's group alone is clipped to ``train.grad_clip``
    (the TAMD projections' gradient is not), and ASAM clips the student's part of its first
    gradient the same way (``model.student_gradient_clip``). One process only: the optimizer
    may hold a partition of the gradient on each.
    """
    train = recipe.train
    clip = train.grad_clip if recipe.loss.reference_code else 0.0
    if clip and world_size > 1:
        raise MtaError(
            f"loss.reference_code clips the student's gradient alone, as the author's one-GPU loop does; "
            f"that runs on one process, not {world_size}: launch one process, or set train.grad_clip=0 "
            "(no clipping, the same on every side)"
        )
    engine = engines.initialize(
        model,
        model.projector_parameters(),
        train.model_copy(update={"grad_clip": 0.0}) if clip else train,
        recipe.deepspeed,
        total_steps,
        world_size,
        precision,
    )
    if clip:
        optimizer = engine.optimizer
        while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            optimizer = optimizer.optimizer  # DeepSpeed's wrapper (ZeRO, bf16) around mta's AdamW

        def clip_the_student(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
            # The groups the step is about to update (ZeRO steps one group at a time).
            grads = [p for g in optimizer.param_groups if g.get("name") == "student" for p in g["params"]]
            grads = [p for p in grads if p.grad is not None]
            if grads:
                torch.nn.utils.clip_grad_norm_(grads, max_norm=clip)

        optimizer.register_step_pre_hook(clip_the_student)
        model.student_gradient_clip = clip
    return engine


def _summary(
    recipe: EmbeddingRecipe,
    objective: EmbeddingObjective,
    accumulation: int,
    world_size: int,
    schedule: StepSchedule,
    total_steps: int,
    splits: dict,
) -> list[str]:
    """What a person should know before the first step: batch, data, the terms and layers."""
    train, loss = recipe.train, recipe.loss
    lines = [
        f"global batch {train.batch_size} = {train.micro_batch_size} per device × {accumulation} accumulation × "
        f"{world_size} process(es); {total_steps} steps, {schedule.steps_per_epoch} per epoch over "
        f"{schedule.num_rows} texts; SimCSE and LASD compare the {train.micro_batch_size} texts of a micro batch",
    ]
    lines += [describe_embeddings(split, found) for split, found in splits.items() if found is not None]
    top = objective.num_layers
    terms = []
    if loss.simcse_weight:
        terms.append(f"{loss.simcse_weight:g}·SimCSE (τ {loss.simcse_temperature:g}, layer {top}, two dropout passes)")
    if loss.tamd_weight:
        anchored = ", ".join(str(layer) for layer in range(top - objective.anchored + 1, top + 1))
        terms.append(f"{loss.tamd_weight:g}·TAMD (layers {anchored} → the teacher)")
    if loss.lasd_weight:
        terms.append(
            f"{loss.lasd_weight:g}·LASD (layers 1..{top}, {loss.lasd_reduction} per pair"
            f"{', guide detached' if loss.lasd_detach else ''})"
        )
    lines.append(f"student pooling {recipe.student.pooling}; loss " + " + ".join(terms))
    if loss.reference_code:
        lines.append(
            "loss.reference_code: as the author's code (docs/method.md §9): projections drawn one per layer, "
            + (
                f"the student's gradient alone clipped to {train.grad_clip:g}, "
                if train.grad_clip
                else "no gradient clipping, "
            )
            + "the terms under the training autocast"
        )
    if train.asam is not None:
        lines.append(
            f"ASAM: ρ {train.asam.rho:g}, η {train.asam.eta:g}, T_w on {train.asam.scope} parameters "
            "(two passes per step)"
        )
    return lines


# --------------------------------------------------------------------------- --dry-run


def plan_embedding_run(recipe: EmbeddingRecipe, world_size: int = 1):
    """``mta.training.dry_run.plan_run`` for ``task: embedding``: the student on the meta device
    (from ``student.config``, its ``tiny`` description, a local directory or the Hugging Face
    cache), the TAMD projections, batch and memory; the teacher is never loaded for training, so
    it is planned only as a note (its embeddings are data)."""
    from transformers import AutoModel

    if world_size < 1:
        raise MtaError(f"world size must be at least 1, got {world_size}")
    train = recipe.train
    accumulation = train.accumulation_steps(world_size)
    config, source = _encoder_config(recipe.student, recipe, "student")
    check_text_length(recipe, config)
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    limit = position_limit(config)
    student = ModelPlan(
        role="student",
        name=recipe.student.path,
        config_source=source,
        architecture=type(model).__name__,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        vocab_rows=model.get_input_embeddings().num_embeddings,
        parameters=parameter_count(model),
        dtype=recipe.student.dtype,
        max_positions=limit[0] if limit else None,
        **mlp_shape(config, model),
    )
    notes: list[str] = []
    teacher_dim = None
    if recipe.teacher is not None:
        try:
            teacher_config, _ = _encoder_config(recipe.teacher, recipe, "teacher")
            teacher_dim = teacher_config.hidden_size
        except MtaError as error:
            notes.append(f"teacher: {error}")
    loss = recipe.loss
    if loss.tamd_weight and loss.tamd_layers > student.num_layers:
        raise MtaError(
            f"loss.tamd_layers={loss.tamd_layers} anchors more layers than the student has "
            f"({student.num_layers}); use at most {student.num_layers}"
        )
    projectors = 0
    if loss.tamd_weight:
        if teacher_dim is None:
            notes.append(
                "TAMD's projections are d_S × d_T each; d_T is the teacher embeddings' width, known when they are read"
            )
        else:
            projectors = loss.tamd_layers * student.hidden_size * teacher_dim
        first = student.num_layers - loss.tamd_layers + 1
        notes.append(f"TAMD anchors student layers {first}..{student.num_layers} (bias-free d_S→d_T projections)")
    notes.append(
        f"student pooling {recipe.student.pooling}; teacher embeddings: data.train "
        f"({recipe.data.train})" + (f", built at first use with {recipe.teacher.path}" if recipe.teacher else "")
    )
    if train.asam is not None:
        notes.append(f"ASAM (ρ {train.asam.rho:g}): two forward and backward passes per step, one copy of the weights")
    if loss.reference_code:
        notes.append(
            "loss.reference_code: the author's code (docs/method.md §9); its clipping of the student's "
            "gradient alone runs on one process"
        )
    notes.extend(data_notes(recipe))
    memory = estimate_memory(
        student,
        None,
        trainable_extra=projectors,
        aligned_teacher_layers=0,
        precision=train.precision,
        zero_stage=train.zero_stage,
        teacher_zero3=False,
        world_size=world_size,
        micro_batch_size=train.micro_batch_size,
        sequence_length=recipe.data.max_length,
    )
    # An encoder has no LM head: no logits. SimCSE's second pass keeps its own activations.
    passes = 2 if loss.simcse_weight else 1
    memory = dataclasses.replace(memory, activations=int((memory.activations - memory.logits) * passes), logits=0)
    return RunPlan(
        name=recipe.name,
        student=student,
        teacher=None,
        layers=[],
        projector_parameters=projectors,
        world_size=world_size,
        micro_batch_size=train.micro_batch_size,
        accumulation_steps=accumulation,
        global_batch=train.micro_batch_size * accumulation * world_size,
        zero_stage=train.zero_stage,
        teacher_zero3=False,
        precision=train.precision,
        memory=memory,
        notes=notes,
        projectors="TAMD projection",
    )


def _encoder_config(spec: EncoderSpec, recipe: EmbeddingRecipe, role: str):
    """The encoder's architecture config, offline: ``<role>.config``, ``<role>.tiny`` (the
    ``BertConfig`` ``build_tiny_encoder`` writes), a local directory, the Hugging Face cache."""
    from transformers import BertConfig

    if spec.tiny is not None and spec.config is None:
        tiny = spec.tiny
        return BertConfig(
            vocab_size=tiny.vocab_size,
            hidden_size=tiny.hidden_size,
            num_hidden_layers=tiny.num_layers,
            num_attention_heads=tiny.num_heads,
            intermediate_size=4 * tiny.hidden_size,
            max_position_embeddings=max(512, recipe.data.max_length),
        ), "tiny: built at first use"
    return load_model_config(spec, recipe, role)
