"""MTA's terms inside TRL's ``DistillationTrainer`` (``pip install 'mta-distill[trl]'``; docs/trl.md).

:class:`MTADistillationTrainer` adds ``dsa_weight·DSA + hra_weight·HRA`` (docs/method.md §3) to
TRL's on-policy loss on the same forwards (the backbone calls also return every layer's hidden
states), with the completions' spans parsed by :class:`mta.SpanParser` while the models run. The
HRA projectors are the student's submodule ``mta_projectors``, so every engine shards and saves
them with it. Both weights 0 is TRL's trainer step for step. What is refused and why (another
tokenizer, FSDP1, ``projector_lr`` beside a DeepSpeed optimizer) and the config's ``mta``
section: docs/trl.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import pydantic
import torch
from transformers import TrainerCallback
from trl import DistillationConfig, DistillationTrainer

from mta.api import AnnotateSettings, Collator, GeneratedRow, LayerPair, MTALoss, SpanBatch, SpanParser
from mta.distributed import full_state_dict
from mta.errors import MtaError
from mta.files import reading_artefact

TESTED_TRL = ">=1.10,<1.17"  # the `trl` extra's range; 1.16 is the version the tests pin
PROJECTORS = "mta_projectors.safetensors"  # in each checkpoint-N/ directory
# The TRL methods this trainer overrides, with the parameters TRL 1.16 gives them: a test checks
# both TRL's and ours against this list (tests/test_trl_plugin.py).
OVERRIDDEN: dict[str, tuple[str, ...]] = {
    "__init__": (
        "self",
        "model",
        "teacher_model",
        "args",
        "train_dataset",
        "eval_dataset",
        "processing_class",
        "callbacks",
        "optimizers",
        "quantization_config",
        "peft_config",
        "tools",
    ),
    "_prepare_inputs": ("self", "generation_batch"),
    "_get_last_hidden_state": (
        "self",
        "unwrapped_model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "pixel_values",
        "image_grid_thw",
        "pixel_attention_mask",
        "spatial_shapes",
        "image_sizes",
        "token_type_ids",
        "mm_token_type_ids",
        "image_position_ids",
    ),
    "_compute_loss": ("self", "unwrapped_student", "inputs", "num_items_in_batch"),
    "create_optimizer": ("self", "model"),
    "_save_checkpoint": ("self", "model", "trial"),
    "_load_from_checkpoint": ("self", "resume_from_checkpoint", "model"),
    "_prepare_for_training": ("self", "max_steps", "train_dataloader", "resume_from_checkpoint"),
    "train": ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
}
PROJECTORS_MODULE = "mta_projectors"  # the MTALoss's name as a submodule of the trained student
PENDING = "mta_spans"  # the key of a micro batch's parsed (pending) spans in TRL's inputs


class MTASection(pydantic.BaseModel):
    """The ``mta`` section of :class:`MTADistillationConfig`: the recipe keys of the same names
    (``loss.dsa_weight``, ``loss.hra_weight``, ``loss.layers``, ``loss.importance``,
    ``train.projector_lr``, ``data.spacy_model``, ``data.word_spans``, ``data.span_rule``)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    recipe: str | None = pydantic.Field(None, description="take the values of this recipe (keys here win)")
    dsa_weight: float = pydantic.Field(2.0, ge=0)
    hra_weight: float = pydantic.Field(0.2, ge=0)
    layers: Literal["auto"] | list[LayerPair] = "auto"
    importance: Literal["attention", "uniform"] = "attention"
    projector_lr: float | None = pydantic.Field(None, gt=0, description="None: the student's learning_rate")
    spacy_model: str = "en_core_web_sm"
    word_spans: Literal["phrase", "all"] = "phrase"
    span_rule: Literal["paper", "reference"] = "paper"
    span_workers: int = pydantic.Field(1, ge=0, description="span parser processes; 0: in the training process")

    @classmethod
    def of(cls, value: MTASection | Mapping[str, Any] | str | None) -> MTASection:
        """The section from a mapping, its JSON text, or None (every default); ``MtaError``
        naming each bad key."""
        if isinstance(value, MTASection):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise MtaError(f"mta: not a JSON object ({error.msg} at column {error.colno})") from error
        given = dict(value or {})
        if given.get("recipe"):
            given = {**_recipe_values(str(given["recipe"])), **given}
        try:
            return cls.model_validate(given)
        except pydantic.ValidationError as error:
            problems = "; ".join(f"mta.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
            raise MtaError(problems) from None


def _recipe_values(path: str) -> dict[str, Any]:
    """The section's keys as a recipe sets them (its resolved values: defaults included)."""
    from mta.training.config.catalog import find_recipe
    from mta.training.config.loading import load_recipe

    recipe = load_recipe(find_recipe(path).path)
    loss, data = recipe.loss, recipe.data
    return {
        "dsa_weight": loss.dsa_weight,
        "hra_weight": loss.hra_weight,
        "layers": loss.layers,
        "importance": loss.importance,
        "projector_lr": recipe.train.projector_lr,
        "spacy_model": data.spacy_model,
        "word_spans": data.word_spans,
        "span_rule": data.span_rule,
    }


@dataclass
class MTADistillationConfig(DistillationConfig):
    """TRL's ``DistillationConfig`` plus ``mta``: :class:`MTASection`'s keys (a mapping, or its
    JSON text from the command line)."""

    mta: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "MTA's section: dsa_weight, hra_weight, layers, importance, projector_lr, spacy_model, "
            "word_spans, span_rule, span_workers, or recipe (a recipe file whose values are the defaults)."
        },
    )


class CloseSpanParser(TrainerCallback):
    """Stops the span parser's worker processes when training ends (a later use restarts them)."""

    def __init__(self, trainer: MTADistillationTrainer):
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.close_span_parser()


class MTADistillationTrainer(DistillationTrainer):
    """``trl.DistillationTrainer`` with MTA's DSA + HRA added (module docstring). Takes what it
    takes; ``args`` is an :class:`MTADistillationConfig` (a plain ``DistillationConfig``: MTA's
    defaults)."""

    _tag_names = ["trl", "distillation", "mta"]

    def __init__(
        self,
        model,
        teacher_model=None,
        args=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
    ):
        section = MTASection.of(getattr(args, "mta", None))
        if args is not None:
            check_launch(args)
        if processing_class is not None and teacher_model is not None:  # before TRL's own vocabulary check
            _check_same_tokenizer(getattr(processing_class, "tokenizer", processing_class), teacher_model)
        super().__init__(
            model,
            teacher_model,
            args,
            train_dataset,
            eval_dataset,
            processing_class,
            callbacks,
            optimizers,
            quantization_config,
            peft_config,
            tools,
        )
        check_engine(self, section)
        self.mta_section = section
        # Both weights 0: TRL's trainer exactly (no hidden states, spans, projectors or mta/* logs).
        self.mta_on = bool(section.dsa_weight or section.hra_weight)
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        _check_same_tokenizer(tokenizer, self.teacher_model)
        student = self.accelerator.unwrap_model(self.model)
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        self.mta_loss: MTALoss | None = None
        if self.mta_on:
            with torch.random.fork_rng(devices=[]):  # the projectors' start: args.seed's, on every rank alike
                torch.manual_seed(self.args.seed)
                self.mta_loss = MTALoss.for_models(
                    student,
                    teacher,
                    vocab_size=len(tokenizer),
                    same_tokenizer=True,
                    layers=section.layers,
                    base=None,
                    dsa_weight=section.dsa_weight,
                    hra_weight=section.hra_weight,
                    importance=section.importance,
                ).to(self.accelerator.device)
            attach_projectors(self.model, self.mta_loss)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        granularities = self.mta_loss.granularities if self.mta_loss is not None else ()
        self.mta_collator = Collator(student_pad_id=pad, teacher_pad_id=pad, granularities=granularities)
        self.mta_tokenizer = tokenizer
        self.span_settings = AnnotateSettings(
            teacher=tokenizer.name_or_path,
            student=tokenizer.name_or_path,
            spacy_model=section.spacy_model,
            word_spans=section.word_spans,
            span_rule=section.span_rule,
            template="none",
        )
        self._span_parser: SpanParser | None = None
        self._mta_hidden: dict[str, tuple[torch.Tensor, ...]] = {}
        self._mta_parsed: object = None  # the buffered generation batch whose spans are submitted
        self._mta_sequences: float | None = None  # that batch's rows over all processes / processes
        self.add_callback(CloseSpanParser(self))

    # ----------------------------------------------------------------------- spans

    @property
    def span_parser(self) -> SpanParser:
        """The span parser (started at first use: after the models are loaded, before training)."""
        if self._span_parser is None:
            self._span_parser = SpanParser(self.span_settings, workers=self.mta_section.span_workers).start()
        return self._span_parser

    def close_span_parser(self) -> None:
        if self._span_parser is not None:
            self._span_parser.close()
            self._span_parser = None

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """TRL's ``train``; this rank's span parser is closed however it ends (an error, Ctrl-C;
        a signal that kills the process takes its workers with it: ``mta.SpanParser``'s workers
        die with their parent)."""
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        finally:
            self.close_span_parser()

    def generated_rows(self, inputs: Mapping[str, Any]) -> list[GeneratedRow]:
        """TRL's micro batch as rows for the span parser: each row's prompt ids (its padding
        dropped), what was generated (up to the completion mask's end) and the prompt's text."""
        prompts = _unpadded(inputs["prompt_ids"], inputs["prompt_mask"])
        completions = _unpadded(inputs["completion_ids"], inputs["completion_mask"])
        eos = self.mta_tokenizer.eos_token_id
        return [
            GeneratedRow(
                self.mta_tokenizer.decode(prompt),
                prompt,
                completion,
                finished=bool(completion) and completion[-1] == eos,
                id=index,
                turns=True,  # a tool-calling completion holds end-of-turn tokens: span boundaries
            )
            for index, (prompt, completion) in enumerate(zip(prompts, completions, strict=True))
        ]

    def spans_of(self, inputs: Mapping[str, Any]) -> dict[str, SpanBatch]:
        """The micro batch's spans as token ranges in TRL's positions (``[prompt | completion]``,
        the prompt left-padded): the parsed ranges shifted by each row's prompt padding."""
        pending = inputs.get(PENDING)
        result = pending.result() if pending is not None else self.span_parser.parse(self.generated_rows(inputs))
        if result.batch.column("id").to_pylist() != list(range(len(inputs["prompt_ids"]))):
            raise RuntimeError("the span parser returned rows other than the micro batch's")
        spans = self.mta_collator(result.batch).spans  # the record batch as the parser gave it
        mask = inputs["prompt_mask"]
        shift = (mask.shape[1] - mask.sum(dim=1)).to(torch.long).cpu()[:, None]  # [B, 1] the prompt's padding
        device = inputs["prompt_ids"].device
        return {
            name: replace(
                batch,
                student_start=(batch.student_start + shift) * batch.mask,
                student_end=(batch.student_end + shift) * batch.mask,
                teacher_start=(batch.teacher_start + shift) * batch.mask,
                teacher_end=(batch.teacher_end + shift) * batch.mask,
            ).to(device)
            for name, batch in spans.items()
        }

    # ----------------------------------------------------------------------- TRL's steps

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if self.mta_on and self.model.training and self._buffered_inputs is not self._mta_parsed:
            # A new generation batch: submit every micro batch's spans now; each is awaited
            # after its own forwards (spans_of). Its rows over every process divide the MTA
            # term's per-sequence sums, as its tokens divide TRL's (num_items_in_batch).
            rows = sum(len(micro_batch["prompt_ids"]) for micro_batch in self._buffered_inputs)
            total = self.accelerator.gather(torch.tensor([rows], device=self.accelerator.device)).sum()
            self._mta_sequences = float(total) / self.accelerator.num_processes  # DDP averages
            for micro_batch in self._buffered_inputs:
                micro_batch[PENDING] = self.span_parser.submit(self.generated_rows(micro_batch))
            self._mta_parsed = self._buffered_inputs
        return inputs

    def _get_last_hidden_state(
        self,
        unwrapped_model,
        input_ids,
        attention_mask,
        logits_to_keep,
        pixel_values=None,
        image_grid_thw=None,
        pixel_attention_mask=None,
        spatial_shapes=None,
        image_sizes=None,
        token_type_ids=None,
        mm_token_type_ids=None,
        image_position_ids=None,
    ):
        options = dict(
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            pixel_attention_mask=pixel_attention_mask,
            spatial_shapes=spatial_shapes,
            image_sizes=image_sizes,
            token_type_ids=token_type_ids,
            mm_token_type_ids=mm_token_type_ids,
            image_position_ids=image_position_ids,
        )
        if not self.mta_on:
            return super()._get_last_hidden_state(unwrapped_model, input_ids, attention_mask, logits_to_keep, **options)
        side = "teacher" if unwrapped_model is self.accelerator.unwrap_model(self.teacher_model) else "student"
        with all_hidden_states(unwrapped_model) as captured:
            last = super()._get_last_hidden_state(unwrapped_model, input_ids, attention_mask, logits_to_keep, **options)
        self._mta_hidden[side] = captured["hidden_states"]
        return last

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        if not self.mta_on:
            return super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)
        self._mta_hidden = {}
        loss, entropy_sum, valid = super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)
        # Training: each term is this micro batch's per-sequence sum over the generation batch's
        # sequences (per process), so the micro batches add up to its per-sequence mean however
        # it is split, as TRL's token sums over num_items_in_batch add up to its token mean.
        # Evaluation: this batch's own means.
        sequences = self._mta_sequences if self.model.training else None
        terms = self.mta_terms(inputs, sequences)
        mode = "train" if self.model.training else "eval"
        # Logged per micro batch, and averaged when logged: the generation batch's mean.
        share = len(self._buffered_inputs) if sequences is not None else 1
        for name, value in terms.items():
            self._metrics[mode][f"mta/{name}"].append(value.item() * share)
        self._mta_hidden = {}
        return loss + terms["total"].to(loss.dtype), entropy_sum, valid

    def mta_terms(self, inputs: Mapping[str, Any], num_sequences: float | None = None) -> dict[str, torch.Tensor]:
        """``{"dsa", "hra", "total"}`` of the micro batch, from the hidden states its two
        forwards left (``total`` weighted); num_sequences: as :meth:`mta.MTALoss.trajectory`'s."""
        if self.mta_loss is None or set(self._mta_hidden) != {"student", "teacher"}:
            raise RuntimeError("both forwards must run before MTA's terms (TRL's _compute_loss changed?)")
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        return self.mta_loss.trajectory(
            self._mta_hidden["student"], self._mta_hidden["teacher"], mask, mask, self.spans_of(inputs), num_sequences
        )

    # ----------------------------------------------------------------------- the projectors

    @property
    def sharded(self) -> bool:
        """True under DeepSpeed or FSDP: the engine holds (and checkpoints) the projectors with the
        student, as shards or partitions."""
        return bool(self.is_deepspeed_enabled or self.is_fsdp_enabled)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.mta_loss is None:
            return optimizer
        return projector_group(optimizer, self.mta_loss, self.mta_section.projector_lr or self.args.learning_rate)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.mta_loss is None:  # TRL's checkpoint exactly
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        state = full_state_dict(self.mta_loss)  # every rank: a gather under ZeRO-3 / FSDP2
        if self.args.should_save and folder.is_dir():
            write_projectors(folder / PROJECTORS, self.mta_loss, state)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self.mta_loss is None:
            return
        path = projectors_file(resume_from_checkpoint)
        if self.sharded:  # FSDP: the engine's own checkpoint, just loaded, restored them with the student
            check_projectors(path, self.mta_loss)
        else:
            read_projectors(path, self.mta_loss)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        prepared = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if resume_from_checkpoint is not None and self.is_deepspeed_enabled and self.mta_loss is not None:
            # DeepSpeed's load_checkpoint (TRL never calls _load_from_checkpoint under it) restored the
            # projectors with the student; the checkpoint must still be the plug-in's, for this layout.
            check_projectors(projectors_file(resume_from_checkpoint), self.mta_loss)
        return prepared


LAYOUT_KEY = "mta_layout"  # the projectors file's metadata: the layer map and the hidden sizes
_PROJECTORS_REBUILD = "resume from another checkpoint, or start without resume_from_checkpoint"


def write_projectors(path: Path, loss: MTALoss, state: Mapping[str, torch.Tensor] | None = None) -> None:
    """``loss``'s projectors as safetensors at ``path`` (atomically), with what they were made for
    (``MTALoss.layout``: the layer map, both hidden sizes) in the metadata. ``state``: their whole
    values when an engine shards them (``mta.distributed.full_state_dict``, gathered by every rank)."""
    from safetensors.torch import save

    from mta.files import atomic_write_bytes

    if state is None:
        state = loss.state_dict()
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}
    atomic_write_bytes(path, save(tensors, metadata={LAYOUT_KEY: json.dumps(loss.layout)}))


def projectors_file(checkpoint: str | Path) -> Path:
    """``checkpoint``'s projectors file; ``MtaError`` when it has none (not the plug-in's, or cut short)."""
    path = Path(checkpoint) / PROJECTORS
    if not path.is_file():
        raise MtaError(
            f"{checkpoint} has no {PROJECTORS}: it was not written by MTADistillationTrainer, or its "
            "save was cut short; resume from another checkpoint, or start without resume_from_checkpoint"
        )
    return path


def read_projectors(path: Path, loss: MTALoss) -> None:
    """Load the projectors at ``path`` into ``loss`` when they were made for its layout (the layer
    map and hidden sizes, as ``mta distill``'s resume refuses a changed ``loss.layers``); a
    mismatch, or a file that does not read back, is one ``MtaError`` naming the file."""
    state = check_projectors(path, loss)
    with reading_artefact(path, _PROJECTORS_REBUILD):
        loss.load_state_dict(state)  # copied onto the projectors' device


def check_projectors(path: Path, loss: MTALoss) -> dict[str, torch.Tensor]:
    """The projectors at ``path`` when they were made for ``loss``'s layout (``read_projectors``'
    checks, without loading: under DeepSpeed and FSDP the engine's checkpoint restores them)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with reading_artefact(path, _PROJECTORS_REBUILD):
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        stored = json.loads(metadata[LAYOUT_KEY]) if LAYOUT_KEY in metadata else None
        state = load_file(str(path))
    now = loss.layout
    if stored != now:
        said = "records no layout (an older mta wrote it)" if stored is None else f"was made for {stored}"
        raise MtaError(
            f"{path} {said}, and this trainer's projectors are for {now}: the saved projectors would load onto "
            "other layers. Resume with the layers (mta.layers) and models it was trained with, or start without "
            "resume_from_checkpoint"
        )
    return state


def attach_projectors(model: torch.nn.Module, loss: MTALoss) -> None:
    """Make ``loss`` (its HRA projectors) a submodule of the trained ``model`` before the engine
    wraps it, so DDP reduces their gradients, DeepSpeed ZeRO partitions them and FSDP2 shards them
    with the student, in its optimizer, gradient clipping and checkpoints. The model's saved
    weights leave them out (``_keys_to_ignore_on_save``: the keys transformers' ``save_pretrained``
    drops; a peft model saves its adapter alone), so what TRL saves loads with transformers alone."""
    model.add_module(PROJECTORS_MODULE, loss)
    keys = {f"{PROJECTORS_MODULE}.{name}" for name in loss.state_dict()}
    model._keys_to_ignore_on_save = set(getattr(model, "_keys_to_ignore_on_save", None) or ()) | keys


def projector_group(optimizer: torch.optim.Optimizer, loss: MTALoss, lr: float) -> torch.optim.Optimizer:
    """``optimizer`` (the Trainer's, built from the model's parameters, the projectors among them)
    with the projectors moved into a group of their own: ``lr``, no weight decay."""
    projectors = [p for p in loss.parameters() if p.requires_grad]
    if not projectors:
        return optimizer
    mine = {id(p) for p in projectors}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in mine]
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
    optimizer.add_param_group({"params": projectors, "lr": lr, "weight_decay": 0.0})
    return optimizer


CPU_LAUNCH = 'docs/trl.md, "On a CPU"'


def check_launch(args: Any) -> None:
    """Refuse, before TRL loads anything, an ``accelerate launch`` whose engine this process will
    not run: on a CPU accelerate 1.15 gives DeepSpeed no backend (TrainingArguments then counts one
    process, and TRL's teacher engine fails on its batch-size assertion), and attaches its FSDP
    plugin to GPU groups only (a CPU group would train unsharded: each rank alone, or as DDP)."""
    import os

    from accelerate.utils import DistributedType

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    state = getattr(args, "distributed_state", None)
    kind = getattr(state, "distributed_type", None)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and args.world_size != launched:
        raise MtaError(
            f"accelerate launched {launched} DeepSpeed processes and this one counts {args.world_size}: accelerate "
            "gives DeepSpeed no process-group backend without a GPU. Launch on GPUs, or on a CPU join the group "
            "on gloo first: MTADistillationConfig(..., **mta.integrations.trl.join_cpu_launch()) "
            f"({CPU_LAUNCH})"
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and kind in (
        DistributedType.NO,
        DistributedType.MULTI_CPU,
    ):
        raise MtaError(
            f"accelerate launched FSDP, and this process's group ({kind.value}) is one accelerate does not shard: it "
            "attaches FSDP to GPU groups only, so the ranks would train unsharded. Launch on GPUs, or use "
            f"examples/accelerate/zero3.yaml on a CPU ({CPU_LAUNCH})"
        )


def join_cpu_launch() -> dict[str, Any]:
    """For an ``accelerate launch`` of DeepSpeed on CPUs (tests, benchmarks): the options to give
    the config (``accelerator_config.use_configured_state``), after joining the launch's process
    group on gloo, so accelerate counts every rank (:func:`check_launch`). Call it before each
    trainer's config: accelerate builds its state afresh for each (it refuses a second
    DeepSpeed Accelerator). Also keeps DeepSpeed from JIT-compiling its shared-memory all-reduce
    (minutes of g++ on first use; gloo's all-reduce is plenty on a CPU), as ``mta distill`` does."""
    import deepspeed.ops
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    AcceleratorState._reset_state(reset_partial_state=False)
    PartialState(backend="gloo")
    return {"accelerator_config": {"use_configured_state": True}}


def check_engine(trainer: DistillationTrainer, section: MTASection) -> None:
    """Refuse what cannot run: a DeepSpeed config that builds its own optimizer (DeepSpeed makes
    it from every parameter alike, so ``projector_lr`` could not apply) beside an explicit
    ``projector_lr``; FSDP1 (it flattens the projectors into the student's flat parameters, so
    they can have no group, nor be saved on their own; TRL recommends FSDP2)."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if trainer.is_deepspeed_enabled and plugin is not None and "optimizer" in plugin.deepspeed_config:
        if section.projector_lr is not None:
            raise MtaError(
                "mta.projector_lr cannot apply: the DeepSpeed config has an `optimizer` section, so DeepSpeed builds "
                "one parameter group of everything. Drop the section (TRL's AdamW is then used, with the projectors' "
                "own group), or drop mta.projector_lr (the projectors then train at the student's learning rate)"
            )
    fsdp = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if trainer.is_fsdp_enabled and fsdp is not None and getattr(fsdp, "fsdp_version", 1) != 2:
        raise MtaError(
            "MTADistillationTrainer runs under FSDP2 (fsdp_version: 2), not FSDP1, which flattens the HRA projectors "
            "into the student's flat parameters (no group of their own, no projectors file): set "
            "`fsdp_version: 2` in the accelerate config (examples/accelerate/fsdp2.yaml), or use DeepSpeed "
            "ZeRO-3 (examples/accelerate/zero3.yaml)"
        )


def _unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row of ``ids [B, T]`` without its padding (where ``mask`` is 0), as a list."""
    kept = ids[mask.bool()].split(mask.sum(dim=1).tolist())  # row-major: each row's kept ids in order
    return [row.tolist() for row in kept]


@contextmanager
def all_hidden_states(model: torch.nn.Module) -> Iterator[dict[str, tuple[torch.Tensor, ...]]]:
    """Within the block, the backbone of ``model`` (what TRL's ``_get_last_hidden_state`` calls:
    ``model.base_model``, a peft model's underlying one) also returns every layer's hidden states,
    yielded as ``{"hidden_states": ...}`` once it has run."""
    from peft import PeftModel

    inner = model.base_model.model if isinstance(model, PeftModel) else model
    backbone = inner.base_model
    captured: dict[str, tuple[torch.Tensor, ...]] = {}

    def ask(module, args, kwargs):
        return args, {**kwargs, "output_hidden_states": True}

    def keep(module, args, kwargs, output):
        captured["hidden_states"] = tuple(output.hidden_states)

    handles = [
        backbone.register_forward_pre_hook(ask, with_kwargs=True),
        backbone.register_forward_hook(keep, with_kwargs=True),
    ]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def _check_same_tokenizer(tokenizer: Any, teacher: str | torch.nn.Module) -> None:
    """Refuse a teacher (a name or directory, or a model) whose own tokenizer (loaded from where
    it came from, when it has one) is not the student's: TRL feeds both models the same ids."""
    from mta.models.tokenizers import load_tokenizer, tokenizer_fingerprint

    if isinstance(teacher, (str, Path)):
        source: Any = str(teacher)
    else:
        source = getattr(getattr(teacher, "config", None), "_name_or_path", None) or getattr(
            teacher, "name_or_path", None
        )
    try:
        teacher_tokenizer = load_tokenizer(source) if source else None
    except Exception:  # no tokenizer beside the teacher's weights: nothing to compare
        teacher_tokenizer = None
    if teacher_tokenizer is not None and tokenizer_fingerprint(teacher_tokenizer) != tokenizer_fingerprint(tokenizer):
        raise MtaError(
            f"the teacher ({source}) has another tokenizer than the student ({tokenizer.name_or_path}); TRL's "
            "DistillationTrainer feeds both models the same ids. Distil across tokenizers with `mta distill` "
            "(recipes/cross-tokenizer.yaml), which annotates each side with its own tokenizer"
        )


__all__ = [
    "MTADistillationConfig",
    "MTADistillationTrainer",
    "MTASection",
    "OVERRIDDEN",
    "PROJECTORS_MODULE",
    "attach_projectors",
    "check_engine",
    "check_launch",
    "join_cpu_launch",
    "check_projectors",
    "projector_group",
    "projectors_file",
    "TESTED_TRL",
    "read_projectors",
    "write_projectors",
]
