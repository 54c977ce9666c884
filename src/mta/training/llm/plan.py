"""``task: llm``'s plan: a recipe and its models' configs (no weights) resolved into the one
``RunPlan`` that ``mta distill --dry-run`` prints and ``mta.training.llm.build`` builds the run from:
models, layer pairs (MTA's, FDD's, SRA's), length checks, batch split, precision, where the
teacher's side comes from, off-policy settings, memory estimate and notes.

The dry run finds the configs offline (``mta.training.dry_run.load_model_config``: a recipe's
``<role>.config``, a tiny model's description, a local directory, the Hugging Face cache); a run
plans once its models are loaded, from their own configs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from transformers import PretrainedConfig

from mta.distributed import local_device
from mta.dtypes import resolve_precision
from mta.errors import MtaError
from mta.losses.sra import tokenizers_shared_vocabulary
from mta.models.tokenizers import load_tokenizer
from mta.training.config.layers import (
    LayerIndexPair,
    LayerPair,
    resolve_fdd_layers,
    resolve_layer_map,
    resolve_sra_layers,
)
from mta.training.config.model_checks import check_sequence_lengths
from mta.training.config.schema import UNIT_BASES, Recipe, unset_variables
from mta.training.dry_run import (
    FUSED_AUTOGRAD_FP32_BUFFERS,
    FUSED_FP32_BUFFERS,
    ModelPlan,
    RunPlan,
    data_notes,
    estimate_memory,
    load_model_config,
    plan_from_config,
)


@dataclass(frozen=True)
class LayerPlan:
    """The layer pairs of MTA's, FDD's and SRA's terms, and the projectors they train."""

    layers: list[LayerPair]
    fdd_layers: list[LayerIndexPair]
    sra_layers: list[LayerIndexPair]
    projector_parameters: int


def plan_llm_run(
    recipe: Recipe, world_size: int = 1, loaded: Mapping[str, tuple[PretrainedConfig, str]] | None = None
) -> RunPlan:
    """``mta.training.dry_run.plan_run`` for ``task: llm``: what ``mta distill --dry-run`` prints
    and what ``mta.training.llm.build`` builds the run from. ``loaded``: the configs (and where
    they loaded from) of the models a run loaded, by role; the dry run finds them offline.

    Raises ``MtaError`` when a config cannot be found offline, ``data.max_length`` (or the dev
    samples) needs more positions than a model has, a layer pair points past a model's depth, or
    the global batch cannot be split over ``world_size`` devices.
    """
    if world_size < 1:
        raise MtaError(f"world size must be at least 1, got {world_size}")
    train = recipe.train
    accumulation = train.accumulation_steps(world_size)
    student, teacher = plan_models(recipe, loaded or {})
    pairs = plan_layers(recipe, student, teacher)
    memory = estimate_memory(
        student,
        teacher,
        trainable_extra=pairs.projector_parameters,
        aligned_teacher_layers=len({pair.teacher for pair in pairs.layers}),
        # auto: what it means on this machine (bf16 on a GPU or a CPU with bf16 instructions)
        precision=resolve_precision(train.precision, local_device()),
        zero_stage=train.zero_stage,
        teacher_zero3=train.teacher_zero3,
        world_size=world_size,
        micro_batch_size=train.micro_batch_size,
        sequence_length=recipe.data.max_length,
        # The fused base loss holds one chunk of logits at a time (loss.fused_head).
        logit_chunk=recipe.loss.chunk_size if recipe.fused_head_runs else None,
        fused_buffers=FUSED_AUTOGRAD_FP32_BUFFERS if recipe.loss.base == "distillm2" else FUSED_FP32_BUFFERS,
        eager_attention=eager_attention(recipe, pairs.sra_layers),
    )
    return RunPlan(
        name=recipe.name,
        student=student,
        teacher=teacher,
        layers=pairs.layers,
        projector_parameters=pairs.projector_parameters,
        world_size=world_size,
        micro_batch_size=train.micro_batch_size,
        accumulation_steps=accumulation,
        global_batch=train.micro_batch_size * accumulation * world_size,
        zero_stage=train.zero_stage,
        teacher_zero3=train.teacher_zero3,
        precision=train.precision,
        memory=memory,
        notes=plan_notes(recipe, student, teacher),
        fdd_layers=pairs.fdd_layers,
        sra_layers=pairs.sra_layers,
        teacher_source=teacher_source(recipe),
        off_policy=recipe.off_policy.mode,
        off_policy_new_tokens=recipe.off_policy_max_new_tokens if recipe.off_policy.mode != "off" else None,
        summary=layer_lines(recipe, pairs.layers, pairs.fdd_layers),
    )


def eager_attention(recipe: Recipe, sra_layers: list[LayerIndexPair]) -> bool:
    """Whether both models run eager attention: SRA's last-token-attention centre reads their
    attention rows (``build_objective`` switches them; the plan counts the scores)."""
    return bool(sra_layers) and recipe.loss.sra_centre == "last_token_attention"


def plan_models(
    recipe: Recipe, loaded: Mapping[str, tuple[PretrainedConfig, str]]
) -> tuple[ModelPlan, ModelPlan | None]:
    """The student and the teacher as the run builds them, from the configs of the models loaded
    or else found offline (a recipe's ``<role>.config`` stands in for its model there); first of
    all, a length no model can take is refused."""
    configs = {
        role: loaded[role] if role in loaded else load_model_config(spec, recipe, role)
        for role, spec in (("student", recipe.student), ("teacher", recipe.teacher))
        if spec is not None
    }
    for role, (config, _) in configs.items():
        check_sequence_lengths(
            recipe.data,
            config,
            role,
            model=getattr(recipe, role).path,
            source=recipe.source,
            sample_new_tokens=recipe.dev_sample_new_tokens if role == "student" else 0,
        )
    student = plan_from_config(recipe.student, "student", *configs["student"])
    teacher = plan_from_config(recipe.teacher, "teacher", *configs["teacher"]) if recipe.teacher else None
    return student, teacher


def plan_layers(recipe: Recipe, student: ModelPlan, teacher: ModelPlan | None) -> LayerPlan:
    """The layer pairs each term reads (none without a teacher: the schema refuses the terms) and
    the projectors: one ``nn.Linear(d_S, d_T)`` with bias per HRA pair and per SRA pair."""
    if teacher is None:
        return LayerPlan([], [], [], 0)
    loss, depths = recipe.loss, (student.num_layers, teacher.num_layers)
    layers = resolve_layer_map(loss.layers, *depths) if loss.trajectory_terms else []
    fdd_layers = resolve_fdd_layers(loss.fdd_layers, *depths) if loss.fdd_weight else []
    sra_layers = resolve_sra_layers(loss.sra_layers, *depths) if loss.sra_weight else []
    projectors = (len(layers) if "hra" in loss.trajectory_terms else 0) + len(sra_layers)
    return LayerPlan(layers, fdd_layers, sra_layers, projectors * (student.hidden_size + 1) * teacher.hidden_size)


def plan_notes(recipe: Recipe, student: ModelPlan, teacher: ModelPlan | None) -> list[str]:
    """What a person should know of the plan: SRA's shared vocabulary, vocabularies of different
    sizes, LoRA's adapters, missing data, the teacher cache's size."""
    notes: list[str] = []
    if teacher is not None and recipe.loss.sra_weight:
        notes.append(_shared_vocabulary_note(recipe))
    notes.extend(cross_tokenizer_notes(recipe))
    logit_loss = recipe.loss.base not in ("ce", *UNIT_BASES)  # uld / gold compare their own vocabularies
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
    return notes


def _shared_tokens(recipe: Recipe) -> tuple[int, int, int] | None:
    """``(shared tokens, student vocabulary, teacher vocabulary)`` when both tokenizers are local
    directories, else None (they are counted when they load)."""
    teacher = recipe.teacher
    assert teacher is not None, "asked for SRA or a unit base only, which the schema refuses without a teacher"
    paths = [
        recipe.resolve(spec.tokenizer_path, role) for role, spec in (("teacher", teacher), ("student", recipe.student))
    ]
    if not all((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file() for path in paths):
        return None
    teacher_tokenizer, student_tokenizer = (load_tokenizer(path) for path in paths)
    student_ids, _ = tokenizers_shared_vocabulary(student_tokenizer, teacher_tokenizer)
    return len(student_ids), len(student_tokenizer), len(teacher_tokenizer)


def _shared_vocabulary_note(recipe: Recipe) -> str:
    """SRA's shared vocabulary size when both tokenizers are local directories (else when they load)."""
    if not recipe.loss.sra_logit_weight:
        return "SRA: span logit term off (loss.sra_logit_weight=0)"
    counted = _shared_tokens(recipe)
    if counted is None:
        return "SRA: the tokenizers' shared vocabulary is counted when they load (not at hand for a dry run)"
    if counted[0] == 0:
        return "SRA: the tokenizers share no token; the span logit term will be off"
    return f"SRA: {counted[0]:,} tokens shared by the two vocabularies (its span logit term)"


def cross_tokenizer_notes(recipe: Recipe) -> list[str]:
    """``loss.base: uld / gold``: the vocabularies' overlap (when the tokenizers are at hand) and
    how the aligned units cover the responses of data.train's annotated rows (when annotated:
    an annotate directory, or the run's data/ cache of a file)."""
    if recipe.loss.base not in UNIT_BASES or recipe.teacher is None:
        return []
    import pyarrow.compute as pc

    from mta.data.annotations import read_annotations
    from mta.data.artefact_schema import BOUNDARY_SPANS, PROMPT_LEN
    from mta.data.token_ranges import unit_counts
    from mta.store.layout import holds_artefact

    base = recipe.loss.base
    counted = _shared_tokens(recipe)
    notes = [
        f"{base}: the tokenizers' shared vocabulary is counted when they load (not at hand for a dry run)"
        if counted is None
        else f"{base}: {counted[0]:,} tokens shared by the two vocabularies ({counted[0] / max(counted[1], 1):.1%} of "
        f"the student's {counted[1]:,}, {counted[0] / max(counted[2], 1):.1%} of the teacher's {counted[2]:,})"
        + ("; the KL compares those, ULD the rest" if base == "gold" else "")
    ]
    written = recipe.data.train
    path = None if unset_variables(written) else recipe.resolve(written, "data.train")
    if path is not None and path.is_file():  # rows annotated on first use, into the run's data/ cache
        path = recipe.resolve(recipe.output_dir, "output_dir") / "data" / "train"
    if path is None or not (path.is_dir() and holds_artefact(path)):
        return [*notes, f"{base}: the aligned units are counted on data.train's annotated rows (not annotated yet)"]
    table = read_annotations(path).table
    column = table.column(BOUNDARY_SPANS) if BOUNDARY_SPANS in table.column_names else None
    if column is None or column.null_count:
        return [*notes, f"{base}: data.train's annotations have no boundary_spans (the aligned units); annotate again"]
    column = column.combine_chunks()
    per_row = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    units = pc.list_flatten(column)
    columns = {name: units.field(name).to_numpy(zero_copy_only=False) for name in units.type.names}
    prompt = {side: np.repeat(table.column(PROMPT_LEN[side]).to_numpy(), per_row) for side in ("student", "teacher")}
    counts = unit_counts(
        np.stack([columns["teacher_start"], columns["teacher_end"]], axis=1),
        np.stack([columns["student_start"], columns["student_end"]], axis=1),
        (columns["student_start"] >= prompt["student"]) & (columns["teacher_start"] >= prompt["teacher"]),
    )
    return [
        *notes,
        f"{base}: {counts['units']:,} aligned units in the responses of data.train's {table.num_rows:,} rows; "
        f"{counts['student_tokens_in_single'] / max(counts['student_tokens'], 1):.1%} of the student's and "
        f"{counts['teacher_tokens_in_single'] / max(counts['teacher_tokens'], 1):.1%} of the teacher's response "
        "tokens in them lie in single-token units (one token on both sides)",
    ]


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
    top_k = min(spec.head, teacher.vocab_rows)
    samples = spec.samples if spec.logits == "sampled" else 0

    def size_of(tokens: int, responses: int, rows: int) -> SizeEstimate:
        return estimate_bytes(
            reads,
            top_k=top_k,
            storage=spec.storage,
            hidden_size=teacher.hidden_size,
            tokens=tokens,
            responses=responses,
            rows=rows,
            samples=samples,
            states=spec.states,
            vocab_size=teacher.vocab_rows,
        )

    what = f"layers {', '.join(map(str, reads.layers)) or 'none'}" + (f", k = {top_k}" if reads.logits else "")
    what += (f" + {samples} draws" if samples and reads.logits else "") + f", states {spec.states}"
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
                "at most: Parquet's dictionary encoding and zstd store them in less, 8-bit states in about 0.6; "
                + ", ".join(f"{human_bytes(v)} {k.replace('_', ' ')}" for k, v in size.per_token().items())
                + ")"
            )
        else:
            length = recipe.data.max_length
            responses = length - recipe.data.max_prompt_length
            size = size_of(length, responses, 1)
            notes.append(
                f"teacher cache, {key} ({teacher.name}, {what}, {spec.storage}): at most {human_bytes(size.total)} a "
                f"row at data.max_length={length} ({key} is not annotated yet: the total follows its rows)"
            )
    online = "generated and replayed micro batches" if recipe.off_policy.mode != "off" else None
    notes.append(
        f"teacher cache: gold micro batches read {spec.dir}; "
        + (f"the teacher is loaded for the {online}" if online else "the teacher's weights are never loaded")
    )
    return notes


def teacher_source(recipe: Recipe) -> str | None:
    """Where the run takes the teacher's side of a micro batch from: ``"online"`` (the teacher's
    forward), ``"cache"`` (``teacher_cache.dir``; its weights are never loaded), ``"cache +
    online"`` (the cache for gold micro batches, the teacher for generated and replayed ones), or
    None without a teacher (SFT)."""
    if recipe.teacher is None:
        return None
    if recipe.teacher_cache.dir is None:
        return "online"
    return "cache" if recipe.off_policy.mode == "off" else "cache + online"


def layer_lines(
    recipe: Recipe, layer_pairs: Sequence[LayerPair], fdd_pairs: Sequence[LayerIndexPair] = ()
) -> list[str]:
    """The run log's lines on the aligned layers (MTA's, and FDD's through the logit lens)."""
    lines = []
    if layer_pairs:
        lines.append(
            "aligned layers (student→teacher): "
            + ", ".join(f"{p.student}→{p.teacher} {p.granularity}" for p in layer_pairs)
        )
    if fdd_pairs:
        lines.append(
            f"FDD through the logit lens at T={recipe.loss.fdd_temperature} on "
            f"{'all tokens' if recipe.loss.fdd_tokens == 'all' else 'response tokens'}"
            f"{', after the final norm' if recipe.loss.fdd_final_norm else ''}: "
            + ", ".join(f"{p.student}→{p.teacher}" for p in fdd_pairs)
        )
    return lines
