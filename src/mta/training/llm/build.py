"""``task: llm``'s run, built from its plan (``mta.training.llm.plan``) by small builders.

``build_llm_run`` claims the output directory, loads the models and the data, plans (the same
``RunPlan`` ``mta distill --dry-run`` prints), and then builds, each from that plan: the
objective, the annotated examples, the teacher cache, the engine, the off-policy sampler, the
frozen teacher and the log lines a person reads before the first step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from mta import distributed
from mta.data.annotate import AnnotateSettings
from mta.data.annotations import Annotations
from mta.data.artefact_schema import reannotate_command
from mta.data.online_spans import SpanParser
from mta.errors import MtaError
from mta.losses.sra import tokenizers_shared_vocabulary
from mta.models.tokenizers import tokenizer_fingerprint
from mta.reporting import Reporter
from mta.task_registry import Task
from mta.training import engine as engines
from mta.training import lora
from mta.training.batching import AnnotatedExamples, StepSchedule
from mta.training.config import resume_rules
from mta.training.config.model_checks import check_off_policy_fits
from mta.training.config.schema import UNIT_BASES, Recipe
from mta.training.dry_run import RunPlan
from mta.training.lifecycle import checkpointing, run_directory
from mta.training.lifecycle.selection import Selector
from mta.training.lifecycle.utilisation import StepFlops
from mta.training.llm.plan import eager_attention, plan_llm_run
from mta.training.logit_lens import LogitLens
from mta.training.model_loading import (
    LoadedConfig,
    LoadedModel,
    hidden_size,
    load_causal_lm,
    load_config_and_tokenizer,
    num_layers,
)
from mta.training.objective import DistillationModel, DistillationObjective
from mta.training.off_policy.micro_batches import OffPolicyBatches
from mta.training.teacher import FrozenTeacher
from mta.training.teacher_cache.content import TeacherIdentity, TeacherReads, teacher_precision
from mta.training.teacher_cache.read import CachedTeacher, open_teacher_caches
from mta.training.train_data import load_split
from mta.training.trainer import SPAN_WORKERS, Run

log = logging.getLogger(__name__)


@dataclass
class LoadedSides:
    """The models, tokenizers and data of a run, as loaded: the teacher's weights only when the
    plan runs it online (its config and tokenizer always, when there is a teacher)."""

    student: LoadedModel
    teacher: LoadedModel | None  # the teacher's weights
    teacher_side: LoadedModel | LoadedConfig  # the artefact's teacher side (SFT: the student's)
    splits: dict[str, Annotations | None]
    same_tokenizer: bool

    @property
    def teacher_config(self) -> PretrainedConfig | None:
        """The teacher's config; None without a teacher (SFT)."""
        if self.teacher is not None:
            return self.teacher.model.config
        return self.teacher_side.config if isinstance(self.teacher_side, LoadedConfig) else None

    @property
    def teacher_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.teacher_side.tokenizer

    @property
    def configs(self) -> dict[str, tuple[PretrainedConfig, str]]:
        """The loaded models' configs and where each loaded from, by role (the teacher's only when
        there is one)."""
        found = {"student": (self.student.model.config, self.student.path)}
        if (teacher := self.teacher_config) is not None:
            found["teacher"] = (teacher, self.teacher_side.path)
        return found


def build_llm_run(
    recipe: Recipe, reporter: Reporter, task: Task, *, resume: str | None = None, overwrite: bool = False
) -> Run:
    """Claim the output directory, load models and data, plan, check they fit together, and
    start the DeepSpeed engine; ``task`` (``task: llm``'s) goes on the run."""
    rank, world_size = engines.init_distributed()
    device = distributed.local_device()
    precision = engines.resolve_training_precision(recipe.train, device)  # fp16 on a CPU: refused now
    if device.type == "cpu":
        engines.keep_freed_memory()  # each step reuses the large blocks the last one freed
    output_dir = recipe.resolve(recipe.output_dir, "output_dir")
    owner = run_directory.claim(output_dir, recipe.name, resume=resume, overwrite=overwrite)
    resume_from = checkpointing.resolve_resume(resume, output_dir)
    # Before any model loads: a resume may change only what cannot change the run's meaning.
    resumed_with = resume_rules.check_resume(resume_from, recipe) if resume_from is not None else None

    sides = load_sides(recipe, reporter if rank == 0 else None)
    plan = plan_llm_run(recipe, world_size, sides.configs)
    if sides.teacher is not None and precision.frozen_dtype is not None and sides.teacher.model.dtype == torch.float32:
        # CPU bf16: held in bf16, its products are bf16 anyway. The ignore: transformers declares
        # PreTrainedModel.to with @wraps(nn.Module.to), which mypy reads unbound (dtype taken as self).
        sides.teacher.model.to(precision.frozen_dtype)  # type: ignore[arg-type]
    check_off_policy_fits(recipe, sides.same_tokenizer)

    objective = build_objective(recipe, plan, sides)
    train, dev = build_examples(recipe, plan, sides)
    # Before the engine starts: a cache that does not serve this recipe is refused at once.
    teacher_cache = open_cache(recipe, sides, objective, precision.name)
    schedule = StepSchedule(len(train), recipe.train.micro_batch_size, plan.accumulation_steps, world_size)
    total_steps = schedule.total_steps(recipe.train.epochs, recipe.train.max_steps)
    model = DistillationModel(sides.student.model, objective, fdd_final_norm=recipe.loss.fdd_final_norm)
    engine = engines.initialize(
        model,
        model.projector_parameters(),
        recipe.train,
        recipe.deepspeed,
        total_steps,
        world_size,
        precision=precision,
    )
    model.register_partitioned_head()  # ZeRO-3: the fused loss's head, gathered once per step
    off_policy = build_off_policy(recipe, plan, sides, engine.module.student, total_steps)
    teacher = build_teacher(recipe, sides.teacher.model, objective, world_size, device) if sides.teacher else None

    messages = [precision.describe(), *run_summary(recipe, plan, schedule, total_steps, sides)]
    messages += cache_lines(recipe, teacher_cache, teacher_online=teacher is not None)
    messages += resumed_with.log_lines() if resumed_with is not None else []
    messages += lora_lines(recipe, sides.student.model)
    dev_split, tokenizer = sides.splits["dev"], sides.student.tokenizer
    return Run(
        recipe=recipe,
        task=task,
        plan=plan,
        output_dir=output_dir,
        run_id=owner.run_id,
        engine=engine,
        teacher=teacher,
        tokenizer=tokenizer,
        train=train,
        dev=dev,
        schedule=schedule,
        total_steps=total_steps,
        rank=rank,
        world_size=world_size,
        device=device,
        resume_from=resume_from,
        off_policy=off_policy,
        teacher_cache=teacher_cache,
        messages=messages,
        selector=Selector(recipe, output_dir, owner.run_id, dev_table=dev_split.table, tokenizer=tokenizer)
        if dev_split is not None
        else None,
        precision=precision,
        flops=StepFlops(engine.module, engine.module.student, teacher),
    )


def load_sides(recipe: Recipe, reporter: Reporter | None) -> LoadedSides:
    """The student, the teacher as the plan needs it, and the annotated splits (annotated on first
    use for these tokenizers). Rank 0 builds tiny models and annotates data first; the others then
    find them cached. With a teacher cache and no generated micro batches the teacher's weights
    are never loaded: its config and tokenizer are."""
    teacher_runs = recipe.teacher is not None and (recipe.teacher_cache.dir is None or recipe.off_policy.mode != "off")
    with distributed.main_process_first():
        student = load_causal_lm(recipe.student, recipe, "student")
        teacher = load_causal_lm(recipe.teacher, recipe, "teacher") if recipe.teacher and teacher_runs else None
        teacher_side: LoadedModel | LoadedConfig = teacher or (
            load_config_and_tokenizer(recipe.teacher, recipe, "teacher") if recipe.teacher is not None else student
        )
        # SFT: the artefact's teacher side is the student's tokenizer.
        fingerprints = {
            "student": tokenizer_fingerprint(student.tokenizer),
            "teacher": tokenizer_fingerprint(teacher_side.tokenizer),
        }
        splits = {
            split: load_split(
                recipe,
                split,
                teacher_tokenizer=teacher_side.tokenizer_source,
                student_tokenizer=student.tokenizer_source,
                fingerprints=fingerprints,
                reporter=reporter,
            )
            for split in ("train", "dev")
        }
    same = fingerprints["teacher"] == fingerprints["student"]
    return LoadedSides(student, teacher, teacher_side, splits, same_tokenizer=same)


def build_objective(recipe: Recipe, plan: RunPlan, sides: LoadedSides) -> DistillationObjective:
    """The loss of the plan's layer pairs (MTA's, FDD's, SRA's) on these models."""
    student, teacher_config = sides.student.model, sides.teacher_config
    shared_vocab = None
    if plan.sra_layers:
        shared_vocab = shared_vocabulary(sides.student.tokenizer, sides.teacher_tokenizer, recipe.loss.sra_logit_weight)
    if eager_attention(recipe, plan.sra_layers):  # the port's centre weights: the models' attention rows
        for side in (sides.student, sides.teacher):
            if side is not None:  # a cached teacher refuses this centre (the schema)
                side.model.set_attn_implementation("eager")
    if recipe.loss.base == "gold" and shared_vocab is None:  # the hybrid's shared tokens (docs/method.md §5b)
        shared_vocab = tokenizers_shared_vocabulary(sides.student.tokenizer, sides.teacher_tokenizer)
    # Projector initialisation (nn.Linear defaults) follows the recipe's seed.
    torch.manual_seed(recipe.seed)
    return DistillationObjective(
        recipe.loss,
        plan.layers,
        student_hidden_size=hidden_size(student),
        teacher_hidden_size=hidden_size(teacher_config) if teacher_config is not None else None,
        same_tokenizer=sides.same_tokenizer,
        vocab_size=len(sides.student.tokenizer),
        fdd_pairs=plan.fdd_layers,
        sra_pairs=plan.sra_layers,
        shared_vocab=shared_vocab,
        teacher_vocab_size=len(sides.teacher_tokenizer),
        partitioned_heads=recipe.train.zero_stage == 3 or recipe.train.teacher_zero3,
        fused_head=recipe.fused_head_runs,
    )


def build_examples(
    recipe: Recipe, plan: RunPlan, sides: LoadedSides
) -> tuple[AnnotatedExamples, AnnotatedExamples | None]:
    """The train and dev rows as the loop batches them; DistiLLM-2 refused without pair rows."""
    train_split, dev_split = sides.splits["train"], sides.splits["dev"]
    assert train_split is not None, "data.train is a required recipe key: load_split returns its rows"
    train = examples_of(train_split, recipe, plan, sides)
    if recipe.loss.base == "distillm2" and train.pair_ids is None:
        raise MtaError(
            f"loss.base=distillm2 trains on pair rows, and data.train ({recipe.data.train}) holds none: "
            "write pairs with `mta generate PROMPTS.jsonl --teacher T --student S -o PAIRS.jsonl` "
            "and set data.train to PAIRS.jsonl (annotated on first use)"
        )
    return train, examples_of(dev_split, recipe, plan, sides) if dev_split is not None else None


def examples_of(annotations: Annotations, recipe: Recipe, plan: RunPlan, sides: LoadedSides) -> AnnotatedExamples:
    """One split's annotated rows as the loop batches them, with the spans the plan's layers read."""
    return AnnotatedExamples(
        annotations.table,
        student_pad_id=sides.student.tokenizer.pad_token_id,
        teacher_pad_id=sides.teacher_tokenizer.pad_token_id,
        with_teacher=sides.teacher_config is not None,
        granularities=granularities(plan),
        boundary=bool(recipe.loss.sra_weight) or recipe.loss.base in UNIT_BASES,
        rebuild=reannotate_command(annotations.manifest, annotations.directory),
    )


def granularities(plan: RunPlan) -> tuple[str, ...]:
    """The span granularities the plan's aligned layers read."""
    return tuple(sorted({pair.granularity for pair in plan.layers}))


def open_cache(
    recipe: Recipe, sides: LoadedSides, objective: DistillationObjective, precision: str
) -> CachedTeacher | None:
    """The teacher cache of ``teacher_cache.dir`` for this recipe's splits, refused at once if it
    does not serve it; None without one."""
    teacher_config = sides.teacher_config
    if recipe.teacher_cache.dir is None or recipe.teacher is None or teacher_config is None:
        return None
    return open_teacher_caches(
        recipe,
        {"train": sides.splits["train"], "dev": sides.splits["dev"]},
        reads=TeacherReads(tuple(objective.teacher_layers), objective.needs_teacher_logits),
        teacher=TeacherIdentity.of(
            sides.teacher_side.path,
            sides.teacher_tokenizer,
            teacher_config,
            teacher_precision(precision, recipe),
        ),
    )


def build_off_policy(
    recipe: Recipe, plan: RunPlan, sides: LoadedSides, student: PreTrainedModel, total_steps: int
) -> OffPolicyBatches | None:
    """DistiLLM's off-policy sampler (``off_policy:``), its span parser started; None when off."""
    if plan.off_policy == "off":
        return None
    train_split = sides.splits["train"]
    assert train_split is not None, "data.train is a required recipe key"
    settings = AnnotateSettings.from_recipe(
        recipe, teacher=sides.teacher_side.tokenizer_source, student=sides.student.tokenizer_source
    )
    parser = SpanParser(settings, workers=SPAN_WORKERS if distributed.available_cores() > 1 else 0).start()
    tokenizer = sides.student.tokenizer
    return OffPolicyBatches(
        recipe,
        train_split.table,
        model=student,
        tokenizer=tokenizer,
        pad_ids={"student": tokenizer.pad_token_id, "teacher": sides.teacher_tokenizer.pad_token_id},
        with_teacher=sides.teacher_config is not None,
        granularities=granularities(plan),
        parser=parser,
        total_steps=total_steps,
    )


def build_teacher(
    recipe: Recipe, model: PreTrainedModel, objective: DistillationObjective, world_size: int, device: torch.device
) -> Any:
    """The frozen teacher, asked only for what the objective reads (through the logit lens for
    FDD and SRA's logit term), on the device or partitioned with ZeRO-3 (``train.teacher_zero3``)."""
    lens = (
        LogitLens(model, final_norm=recipe.loss.fdd_final_norm or objective.fdd is None, num_layers=num_layers(model))
        if objective.fdd is not None or objective.sra_logits
        else None
    )
    teacher = FrozenTeacher(
        model,
        objective.teacher_layers,
        objective.needs_teacher_logits,
        lens,
        attention_layers=objective.attention_layers["teacher"],
        fused=objective.fused_head,
    )
    if recipe.train.teacher_zero3:
        return engines.teacher_zero3_engine(teacher, recipe.train.micro_batch_size, world_size)
    return teacher.to(device)


def shared_vocabulary(
    student_tokenizer: PreTrainedTokenizerBase, teacher_tokenizer: PreTrainedTokenizerBase, logit_weight: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """SRA's shared vocabulary (computed once per run), or None when the logit term is off or the
    tokenizers share no token (the log says which)."""
    if not logit_weight:
        return None
    student_ids, teacher_ids = tokenizers_shared_vocabulary(student_tokenizer, teacher_tokenizer)
    if len(student_ids) == 0:
        log.warning("SRA: the two tokenizers share no token; the span logit term is off")
        return None
    log.info("SRA: %d tokens shared by the two vocabularies", len(student_ids))
    return student_ids, teacher_ids


def run_summary(
    recipe: Recipe, plan: RunPlan, schedule: StepSchedule, total_steps: int, sides: LoadedSides
) -> list[str]:
    """What a person should know before the first step: batch, data, tokenizer mode, and the
    plan's lines on the layers."""
    lines = [
        f"global batch {recipe.train.batch_size} = {recipe.train.micro_batch_size} per device "
        f"× {plan.accumulation_steps} accumulation × {plan.world_size} process(es); {total_steps} steps, "
        f"{schedule.steps_per_epoch} per epoch over {schedule.num_rows} rows",
    ]
    lines += [
        rows_note(split, annotations.manifest) for split, annotations in sides.splits.items() if annotations is not None
    ]
    if sides.teacher_config is None:
        lines.append("no teacher: plain SFT on the reference responses")
    elif sides.same_tokenizer:
        lines.append(
            f"teacher and student share a tokenizer: base loss {recipe.loss.base} on the "
            f"{len(sides.student.tokenizer)}-token vocabulary" + (", token-level HRA" if plan.layers else "")
        )
    else:
        base = (
            f"base {recipe.loss.base} on the units both tokenisations agree on"
            if recipe.loss.base in UNIT_BASES
            else "no logit loss (base ce on the reference)"
        )
        lines.append(
            f"teacher and student tokenizers differ: {base}, "
            "each model pools spans on its own tokens, DSA on span geometry, HRA on span representations"
        )
    return lines + plan.summary


def cache_lines(recipe: Recipe, cache: CachedTeacher | None, *, teacher_online: bool) -> list[str]:
    """Where the teacher's side is read from, when a teacher cache serves the run."""
    if cache is None:
        return []
    return [
        f"teacher: read from {recipe.teacher_cache.dir} for the rows of "
        + ", ".join(f"{split} ({len(rows)} rows)" for split, rows in cache.caches.items())
        + ("; online for the generated micro batches" if teacher_online else "; its weights are not loaded")
    ]


def lora_lines(recipe: Recipe, student: PreTrainedModel) -> list[str]:
    """A LoRA student's adapters against its frozen weights."""
    if recipe.student.lora is None:
        return []
    adapters = lora.trainable_parameters(student)
    total = sum(p.numel() for p in student.parameters())
    return [lora.describe(recipe.student.lora, adapters, total - adapters)]


def rows_note(split: str, manifest: Mapping[str, Any]) -> str:
    """One split's annotated rows, and what was skipped and why."""
    rows = manifest.get("rows", {})
    note = f"{split}: {rows.get('written', '?')} annotated rows"
    if rows.get("skipped"):
        reasons = ", ".join(f"{count} {reason}" for reason, count in manifest.get("skipped", {}).items())
        note += f" ({rows['skipped']} of {rows.get('read', '?')} skipped: {reasons})"
    return note
