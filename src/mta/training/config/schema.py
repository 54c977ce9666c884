"""Recipes: one YAML file names everything a distillation run needs, validated against code.

This module holds what every task's recipe shares (``Strict``, ``TrainSpec``, ``RecipeChecks``)
and the LLM recipe (``Recipe``, ``task: llm``); the embedding recipe is ``mta.embedding.recipe``
(TALAS). A file is read by ``mta.training.config.loading.load_recipe``, which picks the schema by
``task`` (``mta.task_registry``); ``key=value`` overrides (``mta.training.config.overrides``) are
applied before validation so they are checked exactly like the file; the recipe against the
models' configs and tokenizers is ``mta.training.config.model_checks``.

Paths in a recipe (data, configs, tokenizers, models, output) are resolved when used, by
``Recipe.resolve``: ``~`` and ``$VAR`` / ``${VAR}`` are expanded from the environment (an unset
variable is an error that names it, never a silently literal ``$VAR`` directory); an absolute
path, or a relative one that exists from the working directory, is taken as written; otherwise
a relative path that exists beside the recipe file is taken from there (so ``configs/gpt2.json``
in the shipped ``gpt2.yaml`` means ``recipes/configs/gpt2.json``); anything else, such as
an output directory still to be created or a hub name like ``gpt2``, stays relative to the working
directory (also for a shipped recipe: its runs never land inside the installed package).

The ``deepspeed:`` passthrough is checked by ``mta.training.config.deepspeed_settings``. Numbers
must be finite everywhere.
"""

from __future__ import annotations

import logging
import os
import re
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mta.data.prompts import Template
from mta.errors import MtaError
from mta.training.config.deepspeed_settings import deepspeed_problem

log = logging.getLogger(__name__)

BaseLossName = Literal["ce", "fkl", "rkl", "skl", "srkl", "jsd", "tvd", "distillm2", "uld", "gold"]
# The base losses that compare logits across two vocabularies, on aligned units (mta.losses.cross_tokenizer).
UNIT_BASES = ("uld", "gold")
Precision = Literal["fp32", "bf16", "fp16"]
# train.precision: auto is bf16 where the device computes it natively (mta.dtypes), else fp32.
TrainPrecision = Literal["auto", "fp32", "bf16", "fp16"]
Granularity = Literal["word", "phrase"]


class Strict(BaseModel):
    # allow_inf_nan=False: `lr: .inf`, `.nan` or `1e400` is an error, never a silent NaN run.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TinyModel(Strict):
    """Build a random model from this description at first use (CPU runs and tests)."""

    model_type: Literal["llama", "gpt2", "qwen2"] = Field("llama", description="the random model's architecture")
    num_layers: int = Field(4, ge=1, description="transformer blocks")
    hidden_size: int = Field(32, ge=4, description="the hidden states' width")
    num_heads: int = Field(4, ge=1, description="attention heads per block")
    tokenizer_corpus: str = Field(description="JSONL whose text trains the byte-level BPE")
    vocab_size: int = Field(512, ge=300, description="the BPE's vocabulary size")
    seed: int = Field(0, description="seed of the random weights")


class LoraSpec(Strict):
    """A LoRA student (``mta.training.lora``): adapters trained, the rest frozen, exports merged."""

    r: int = Field(16, ge=1, description="the adapters' rank")
    alpha: float = Field(64.0, gt=0, description="LoRA's alpha: the update is scaled by alpha / r")
    dropout: float = Field(0.1, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: Literal["all-linear"] | list[str] | None = Field(
        None,
        description="the layers adapted, by the last part of their name (q_proj, v_proj); "
        "all-linear: every linear layer but the output head; null: peft's default for the "
        "architecture (q_proj, v_proj for OPT / Llama / Qwen; c_attn for GPT-2)",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("name at least one module, or null for peft's default")
        return value


class ModelSpec(Strict):
    path: str = Field(description="hub name or local directory of a Hugging Face causal LM")
    tokenizer: str | None = Field(None, description="tokenizer name or directory; default: path")
    dtype: Precision = Field(
        "fp32", description="the dtype the weights load in; a student's is fp32 or train.precision's"
    )
    config: str | None = Field(
        None, description="architecture config JSON (relative to the recipe) for offline --dry-run"
    )
    tiny: TinyModel | None = Field(
        None,
        description="build a random model of this shape at first use, under output_dir/models/ (CPU runs "
        "and tests); null: load path",
    )
    lora: LoraSpec | None = Field(
        None,
        description="student only: train LoRA adapters {r, alpha, dropout, target_modules}; null: full fine-tuning",
    )
    license: str | None = Field(
        None,
        description="student only: the license the trained student's model card names (a Hub license id, e.g. "
        "apache-2.0); null: the start model's own where its files record one",
    )

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path


class DataSpec(Strict):
    train: str = Field(
        description="annotate output directory, or rows annotated on first use: a JSONL, Parquet "
        "or CSV file, a datasets save_to_disk directory, or a Hugging Face Hub dataset id "
        "(owner/name; an existing local path of that spelling wins)"
    )
    dev: str | None = Field(
        None,
        description="the dev rows, as data.train: dev loss, samples and best/ at each evaluation "
        "(train.eval_interval); null: no dev evaluation",
    )
    train_split: str = Field("train", description="the split data.train reads when it is a Hub dataset id")
    dev_split: str = Field("validation", description="the split data.dev reads when it is a Hub dataset id")
    subset: str | None = Field(
        None, description="the subset (datasets' config name) of a Hub dataset id; null: its default"
    )
    revision: str | None = Field(
        None,
        description="the branch, tag or commit of a Hub dataset id (null: main); the annotations record the commit",
    )
    max_length: int = Field(256, ge=8, description="tokens per row (prompt + response, EOS included) on each side")
    max_prompt_length: int = Field(
        128, ge=1, description="prompt tokens on each side; a longer prompt is skipped (or cut: truncate_prompt)"
    )
    word_spans: Literal["phrase", "all"] = Field(
        "phrase",
        description="the word spans: phrase (the words inside phrases, the published variant) or "
        "all (every word that is not punctuation)",
    )
    span_rule: Literal["paper", "reference"] = Field(
        "paper",
        description="token membership and word spans: paper (docs/method.md §1) or "
        "reference (the authors' code: a token is in [a, b) when start + 1 >= a and end <= b; a "
        "word runs to the start of the next one); an artefact must be built with the same rule",
    )
    spacy_model: str = Field("en_core_web_sm", description="the spaCy pipeline that finds the phrases")
    truncate_prompt: bool = Field(
        False, description="cut a prompt over max_prompt_length to fit instead of skipping the row"
    )
    template: Template = Field(
        "alpaca",
        description="how prompts are built from rows (mta.data.prompts): alpaca (the Alpaca "
        "prompt for rows without a 'prompt'), chat (the student tokenizer's chat template), "
        "none (each row's 'prompt' as given)",
    )
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="the input's columns read under the keys the row formats know, "
        "{format key: column}, e.g. {prompt: question, response: answer} (mta.data.sources)",
    )

    @field_validator("fields")
    @classmethod
    def _fields_known(cls, value: dict[str, str]) -> dict[str, str]:
        from mta.data.rows import field_problems

        problems = field_problems(value)
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @model_validator(mode="after")
    def _prompt_fits(self) -> DataSpec:
        if self.max_prompt_length >= self.max_length:
            raise ValueError("max_prompt_length must be smaller than max_length")
        if self.span_rule == "reference" and self.word_spans != "phrase":
            raise ValueError("span_rule=reference builds the authors' words of phrases; use word_spans=phrase")
        return self


class LayerPair(Strict):
    """One aligned layer pair, as ``output_hidden_states`` indices (0 = embeddings)."""

    student: int = Field(ge=0)
    teacher: int = Field(ge=0)
    granularity: Granularity = Field(description="the spans aligned: word or phrase")

    @model_validator(mode="before")
    @classmethod
    def _from_triple(cls, value: Any) -> Any:
        # YAML is friendlier as [student, teacher, granularity] triples.
        if isinstance(value, (list, tuple)):
            if len(value) != 3:
                raise ValueError(f"write a layer pair as [student, teacher, word|phrase], got {list(value)}")
            return dict(zip(("student", "teacher", "granularity"), value, strict=True))
        return value


# `auto` or explicit pairs; the discriminator picks the branch, so a typo in a pair is reported
# once, at its index, instead of also as "input should be 'auto'".
LayerMap = Annotated[
    Annotated[Literal["auto"], Tag("'auto'")] | Annotated[list[LayerPair], Tag("list[LayerPair]")],
    Discriminator(lambda value: "'auto'" if isinstance(value, str) else "list[LayerPair]"),
]


class LayerIndexPair(Strict):
    """A student and a teacher ``hidden_states`` index (FDD's logit-lens pairs, SRA's span pairs)."""

    student: int = Field(ge=0)
    teacher: int = Field(ge=0)

    @model_validator(mode="before")
    @classmethod
    def _from_pair(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            if len(value) != 2:
                raise ValueError(f"write the layer pair as [student, teacher], got {list(value)}")
            return dict(zip(("student", "teacher"), value, strict=True))
        return value


IndexPairMap = Annotated[
    Annotated[Literal["auto"], Tag("'auto'")] | Annotated[list[LayerIndexPair], Tag("list[LayerIndexPair]")],
    Discriminator(lambda value: "'auto'" if isinstance(value, str) else "list[LayerIndexPair]"),
]


class LossSpec(Strict):
    base: BaseLossName = Field(
        "srkl",
        description="the base loss on the response tokens (docs/method.md §5): ce (SFT on the reference), "
        "a teacher divergence, or distillm2 (pairs); across tokenizers ce, or uld / gold on the units both "
        "tokenisations agree on (docs/method.md §5b)",
    )
    base_weight: float = Field(1.0, ge=0, description="λ_base, the base loss's weight")
    temperature: float = Field(1.0, gt=0, description="divides the teacher's and the student's logits (no τ² factor)")
    skew_alpha: float = Field(0.1, ge=0, le=1, description="α of the skew KLs (skl, srkl, distillm2)")
    jsd_beta: float = Field(
        0.5,
        ge=0,
        le=1,
        description="β of jsd, the teacher's weight in the mixture; 0: forward KL(p‖q), 1: reverse KL(q‖p) "
        "(TRL's meaning of its β)",
    )
    dsa_weight: float = Field(2.0, ge=0, description="λ_DSA, MTA's span-geometry alignment; 0: off")
    hra_weight: float = Field(0.2, ge=0, description="λ_HRA, MTA's hidden-representation alignment; 0: off")
    layers: LayerMap = Field(
        "auto",
        description="`auto` (the docs/method.md §4 rule) or a list of [student, teacher, word|phrase] triples",
    )
    importance: Literal["attention", "uniform"] = Field(
        "attention",
        description="token weights within a span: attention importance (docs/method.md §2) or uniform (the ablation)",
    )
    reference_code: bool = Field(
        False,
        description="compute MTA as the authors' code does instead of the formulas "
        "(docs/method.md §8): importance over every row of a batch padded to data.max_length, DSA "
        "over all pairs of the batch, HRA counting a token once per span; with importance=uniform "
        "their uniform-weights ablation (importance pooling kept, pair and token weights uniform)",
    )
    chunk_size: int = Field(128, ge=1, description="sequence positions per logit-loss chunk")
    fused_head: bool = Field(
        True,
        description="the base loss from the models' final hidden states and LM heads, chunk_size response "
        "positions at a time, so the whole [batch, seq, vocab] logits never exist; false: from the whole logits "
        "(uld and gold, across two vocabularies, always read the whole logits)",
    )
    distillm2_beta: float = Field(
        1.0,
        ge=0,
        le=2,
        description="loss.base=distillm2: (2 − β)·skew KL on the teacher's responses + "
        "β·skew reverse KL on the student's",
    )
    fdd_weight: float = Field(0.0, ge=0, description="feature dynamics distillation (FDD); 0: off")
    fdd_layers: IndexPairMap = Field(
        "auto",
        description="[student, teacher] pairs read through the logit lens; auto: student layers "
        "L/3, L/2, 2L/3 (4, 6, 8 of 12) and the teacher layers at the same depth",
    )
    fdd_temperature: float = Field(
        2.0, gt=0, description="FDD's softmax temperature (the authors: 5.0 with FDD alone, 2.0 with FDD + MTA)"
    )
    fdd_final_norm: bool = Field(
        False, description="apply the final norm before the LM head (the authors: no, raw hidden states)"
    )
    fdd_tokens: Literal["response", "all"] = Field(
        "all", description="the positions FDD compares: all real tokens (the authors') or the response's"
    )
    sra_weight: float = Field(
        0.0, ge=0, description="SRA (span representation alignment on the spans both tokenizers agree on); 0: off"
    )
    sra_layers: Literal["last"] | list[LayerIndexPair] = Field(
        "last", description="[student, teacher] pairs whose span centres align; last: each model's last layer"
    )
    sra_centre: Literal["last_token_attention", "importance"] = Field(
        "last_token_attention",
        description="span centre weights: the attention row of the last real token "
        "(the public port's; runs attention eagerly) or docs/method.md §2 importance",
    )
    sra_scope: Literal["response", "all"] = Field("response", description="the spans SRA aligns")
    sra_geometry_weight: float = Field(50.0, ge=0, description="SRA's span-geometry term (the port's 50)")
    sra_logit_weight: float = Field(1.0, ge=0, description="SRA's span logit KL over the shared vocabulary")
    uld_weight: float = Field(
        1.5,
        ge=0,
        description="loss.base=uld / gold: the weight of ULD's Wasserstein-1 distance of the sorted unit "
        "distributions (gold: on the tokens the vocabularies do not share); the ULD authors' 1.5",
    )
    uld_ce_weight: float = Field(
        1.0,
        ge=0,
        description="loss.base=uld / gold: the weight of the cross-entropy on the reference inside the base loss "
        "(ULD's published CE + λ·W1: 1)",
    )
    shared_kl_weight: float = Field(
        1.0, ge=0, description="loss.base=gold: the weight of the divergence on the shared vocabulary"
    )
    shared_divergence: Literal["fkl", "srkl"] = Field(
        "fkl",
        description="loss.base=gold: the divergence on the renormalised shared vocabulary, forward KL or "
        "skew reverse KL (loss.skew_alpha)",
    )

    @property
    def trajectory_terms(self) -> tuple[str, ...]:
        """The MTA terms with a non-zero weight, of ``("dsa", "hra")``: the one place that decides
        whether MTA is on. An empty tuple means no layer is aligned and no projector is built."""
        return tuple(term for term in ("dsa", "hra") if getattr(self, f"{term}_weight"))

    @property
    def uses_fused_head(self) -> bool:
        """Whether the base loss runs on the fused path (``fused_head``): every base but the unit
        bases (uld, gold), which compare each side's whole logits over its own vocabulary."""
        return self.fused_head and self.base not in UNIT_BASES


# Refused by TrainSpec (train.asam with train.zero_stage=3) and again by mta.training.asam.Asam.for_engine.
ZERO3_REFUSAL = (
    "ASAM does not run under train.zero_stage=3: ZeRO-3 keeps each weight as shards that DeepSpeed "
    "gathers only inside its forward and backward, and reduces gradients into shards during backward, "
    "while ASAM needs the whole gradient at w without an optimizer step and perturbs the whole weights "
    "in place (DeepSpeed has no sharpness-aware step of its own). Use train.zero_stage 1 or 2 (ZeRO-2 "
    "partitions gradients and optimizer states; the weights stay whole), or train.asam=null"
)


class AsamSpec(Strict):
    """ASAM (Kwon et al., 2021) around the optimizer, for any recipe (``mta.training.asam``): each
    step's gradient is taken at w + ε, ε = ρ·T_w²·g / ‖T_w·g‖ with T_w = |w| + η, and applied to w."""

    rho: float = Field(0.05, gt=0, description="the radius ρ (TALAS's author: 0.05; Kwon et al.: 0.5)")
    eta: float = Field(
        0.0,
        ge=0,
        description="η in T_w = |w| + η (TALAS's author: 0, pytorch_optimizer's "
        "SAM(adaptive=True); the paper and Kwon et al.: 0.01)",
    )
    scope: Literal["all", "weights"] = Field(
        "all",
        description="the parameters T_w applies to: all (TALAS's author) or those whose name ends "
        "in 'weight' (Kwon et al.'s code); the others are perturbed as in SAM (T_w = 1)",
    )


class TrainSpec(Strict):
    optimizer: Literal["adamw"] = Field("adamw", description="torch AdamW, two groups: the student and the projectors")
    lr: float = Field(1e-4, gt=0, description="the student's base learning rate")
    projector_lr: float = Field(
        5e-4, gt=0, description="the projectors' base learning rate (HRA's; an embedding recipe's TAMD projections)"
    )
    weight_decay: float = Field(0.01, ge=0, description="AdamW's decoupled weight decay, on both groups")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's [β1, β2]")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="the learning-rate multiplier after warmup: cosine or linear to 0, or constant"
    )
    warmup_steps: int = Field(0, ge=0, description="steps of linear warmup to the base rates")
    batch_size: int = Field(16, ge=1, description="global batch: per device x accumulation x world")
    micro_batch_size: int = Field(8, ge=1, description="sequences per device per forward pass")
    epochs: float | None = Field(
        None, gt=0, description="the run's length in passes over data.train; give exactly one of epochs and max_steps"
    )
    max_steps: int | None = Field(
        None, ge=1, description="the run's length in optimizer steps; give exactly one of epochs and max_steps"
    )
    grad_clip: float = Field(1.0, ge=0, description="clip the gradient's global 2-norm to this; 0: no clipping")
    loss_reduction: Literal["global", "micro_batch"] = Field(
        "global",
        description="global: the base loss is the mean over every response token of the global batch "
        "(all micro batches on all processes), DSA, HRA, SRA the mean over its sequences, FDD over its "
        "positions, so the gradient does not depend on micro_batch_size, accumulation or processes; "
        "micro_batch: each micro batch's own mean, averaged (DistiLLM's and 0.2.0's convention; "
        "docs/method.md §5); task: llm only",
    )
    precision: TrainPrecision = Field(
        "fp32",
        description="auto: bf16 on a GPU with bf16 or a CPU with bf16 instructions, else fp32; "
        "bf16 on a CPU is autocast over fp32 weights; fp16 needs a GPU",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        1,
        description="DeepSpeed ZeRO: 0 off; 1 partitions the optimizer states over the processes, 2 also "
        "the gradients, 3 also the weights",
    )
    teacher_zero3: bool = Field(False, description="partition the teacher with ZeRO-3 too")
    log_interval: int = Field(
        10, ge=1, description="steps between train lines (metrics.jsonl, the progress line); the last step is logged"
    )
    eval_interval: int = Field(
        100,
        ge=1,
        description="steps between dev evaluations (with data.dev), also at step 0 and at the last step",
    )
    save_interval: int = Field(
        500, ge=1, description="steps between checkpoints (checkpoints/step-N/); the last step is saved"
    )
    keep_checkpoints: int = Field(2, ge=1, description="the newest checkpoints kept; this run's older ones are pruned")
    checkpoint_at_end: bool = Field(
        True,
        description="also checkpoint the last step (checkpoints/step-N/, to continue training from); false: "
        "final/ only, no optimizer state written at the end (the quick demo)",
    )
    num_sample_generations: int = Field(
        2, ge=0, le=8, description="dev prompts whose sampled continuation each evaluation logs (samples)"
    )
    sample_max_new_tokens: int = Field(48, ge=1, description="tokens sampled per dev prompt")
    select_by: Literal["loss", "rouge"] = Field(
        "loss",
        description="what OUT/best/ keeps (mta.training.lifecycle.selection): the lowest dev loss, or the "
        "highest dev ROUGE-L of sampled responses (the published numbers' selection), at each eval_interval",
    )
    select_rows: int = Field(500, ge=1, description="select_by=rouge: the first dev rows sampled, one seed")
    save_generated: bool = Field(
        False, description="also write the rows the student generates for training to OUT/generated/"
    )
    asam: AsamSpec | None = Field(
        None,
        description="sharpness-aware steps {rho, eta, scope} (mta.training.asam): two forward and "
        "backward passes of each accumulation window; null: off",
    )
    push_to_hub: str | None = Field(
        None,
        pattern=r"^[\w.-]+/[\w.-]+$",
        description="a Hub repository (user/name or org/name): final/ is pushed to it when the run ends, best/ to "
        "its branch `best`, as `mta push` pushes them; null: nothing is pushed",
    )
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="experiment trackers that also get every metrics.jsonl record, the recipe and "
        "the dev samples (mta.tracking): OUT/tensorboard/, W&B, MLflow; each needs pip install 'mta-distill[NAME]'",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_tracker_or_a_list(cls, value: Any) -> Any:
        # `train.report_to=tensorboard` or `=tensorboard,wandb` on the command line; repeats once.
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(dict.fromkeys(value))
        return value

    @model_validator(mode="after")
    def _length_given(self) -> TrainSpec:
        if (self.epochs is None) == (self.max_steps is None):
            raise ValueError("give exactly one of train.epochs and train.max_steps")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size {self.batch_size} is not a multiple of micro_batch_size {self.micro_batch_size}"
            )
        return self

    @model_validator(mode="after")
    def _asam_fits_zero(self) -> TrainSpec:
        if self.asam is not None and self.zero_stage == 3:
            raise PydanticCustomError("asam_setting", "{message}", {"message": ZERO3_REFUSAL, "within": ("asam",)})
        return self

    def accumulation_steps(self, world_size: int) -> int:
        """Accumulation that keeps the global batch what the recipe says at this world size."""
        per_step = self.micro_batch_size * world_size
        if self.batch_size % per_step:
            if self.batch_size % world_size:
                fix = f"use a train.batch_size that is a multiple of {world_size}"
            else:
                fix = f"set train.micro_batch_size to a divisor of {self.batch_size // world_size}"
            raise MtaError(
                f"train.batch_size={self.batch_size} cannot be split into micro batches of "
                f"{self.micro_batch_size} on {world_size} processes; {fix}"
            )
        return self.batch_size // per_step


OffPolicyMode = Literal["off", "adaptive", "always"]
OffPolicySchedule = Literal["decreasing", "constant", "increasing"]


class OffPolicySpec(Strict):
    """Student-generated responses during training (DistiLLM's adaptive off-policy sampling).

    What each mode does, and how the threshold moves, is ``mta.training.off_policy.policy``'s docstring;
    which base losses and tokenizers it works with is checked by ``Recipe`` (here) and by
    ``mta.training.config.model_checks.check_off_policy_fits`` (once the tokenizers are loaded).
    """

    mode: OffPolicyMode = Field(
        "off",
        description="off: the reference responses only; adaptive: DistiLLM's adaptive "
        "off-policy sampling with a replay buffer; always: every micro batch generated (on-policy)",
    )
    init_threshold: float = Field(0.0, ge=0, le=1, description="the threshold τ at step 0")
    threshold_step: float = Field(0.1, gt=0, le=1, description="what τ grows by when the dev loss rises by loss_eps")
    loss_eps: float = Field(0.1, ge=0, description="the dev-loss rise (over the last reference) that raises τ")
    schedule: OffPolicySchedule = Field(
        "decreasing",
        description="the share of τ that generates fresh rows: τ·(1 − t/T), τ/2 or τ·t/T",
    )
    buffer_size: int = Field(1000, ge=1, description="generated rows each process's replay buffer holds")
    max_new_tokens: int | None = Field(
        None, ge=1, description="tokens generated per response; null: data.max_length - data.max_prompt_length"
    )
    dev_rows: int | None = Field(
        None,
        ge=1,
        description="dev rows the threshold's cross-entropy is measured on (the first ones); "
        "null: the whole dev split (DistiLLM's scripts: --dev-num 1000)",
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _off_as_yaml_reads_it(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` (and `no`, `false`) as false: that is the mode `off`.
        if value is False:
            return "off"
        if value is True:
            raise ValueError(
                "YAML reads on / yes / true as true, which is not a mode; use one of 'off', 'adaptive' or 'always'"
            )
        return value


TOP_K_DEFAULT = 1024  # teacher_cache.top_k with logits: top_k
SAMPLED_HEAD_DEFAULT = 32  # teacher_cache.top_k with logits: sampled (bench/teacher_cache.py)
SAMPLES_DEFAULT = 32  # teacher_cache.samples (bench/teacher_cache.py)


class TeacherCacheSpec(Strict):
    """``teacher_cache:``: train from what ``mta teacher`` stored instead of running the teacher
    on the annotated rows (docs/teacher-cache.md)."""

    dir: str | None = Field(
        None,
        description="the `mta teacher` output read for the teacher's side of every annotated micro batch "
        "(train and dev); null: the teacher runs online. With off_policy.mode=off the teacher is never loaded",
    )
    logits: Literal["top_k", "sampled"] = Field(
        "top_k",
        description="top_k: the teacher's top_k next tokens per response position and the tail's mass, the rest "
        "spread evenly (biased beyond k); sampled: the top_k head plus `samples` tokens drawn from the rest of the "
        "teacher's distribution at loss.temperature: forward KLs estimated without bias, reverse-type losses from the "
        "head and draws with the rest at its mean log-probability (docs/teacher-cache.md)",
    )
    top_k: int | None = Field(
        None,
        ge=0,
        description=f"the teacher's most probable next tokens stored exactly per response position (logit losses); "
        f"default {TOP_K_DEFAULT} with logits=top_k (bench/teacher_cache.py: skew reverse KL within 0.5 % of the "
        f"online loss at 1024, 2.4 % at 64), {SAMPLED_HEAD_DEFAULT} with logits=sampled (the head; 0: draws only)",
    )
    samples: int = Field(
        SAMPLES_DEFAULT,
        ge=1,
        le=255,
        description="logits=sampled: tokens drawn per response position from the teacher's distribution beyond the "
        "head, with replacement (stored as distinct ids with counts)",
    )
    seed: int = Field(
        0, description="logits=sampled: the draws' seed, keyed per row (mta.generation.sampling.keyed_uniforms)"
    )
    states: Literal["storage", "int8_token", "int8_channel"] = Field(
        "int8_token",
        description="the hidden states' bytes: int8_token: 8 bits with an fp32 scale per token and layer (0.4x of "
        "fp16's bytes on disk, DSA within 0.15 %: bench/teacher_cache.py); storage: in `storage`'s precision (fp16 or "
        "fp32); int8_channel: 8 bits with a scale per channel, layer and row. A cache of storage states serves "
        "every choice",
    )
    storage: Literal["compact", "fp32"] = Field(
        "compact",
        description="compact: log-probabilities and hidden states kept at storage precision (states=storage) in fp16 "
        "(tails fp32); fp32: all fp32 (2x the bytes)",
    )

    @property
    def head(self) -> int:
        """``top_k`` as set, or its default for ``logits``."""
        if self.top_k is not None:
            return self.top_k
        return TOP_K_DEFAULT if self.logits == "top_k" else SAMPLED_HEAD_DEFAULT


_ENV_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def unset_variables(written: str) -> list[str]:
    """The environment variables a recipe path names (``$VAR``, ``${VAR}``) that are not set."""
    named = {name for groups in _ENV_VAR.findall(written) for name in groups if name}
    return sorted(named - set(os.environ))


class _DtypedStudent(Protocol):
    """A recipe's ``student:`` section as ``RecipeChecks`` reads it (``ModelSpec``, an encoder's spec)."""

    @property
    def dtype(self) -> Precision: ...


class RecipeChecks(Strict):
    """What every recipe schema (``Recipe``, ``EmbeddingRecipe``) checks and offers: its
    ``student.dtype`` against ``train.precision``, the ``deepspeed:`` passthrough, and paths."""

    if TYPE_CHECKING:  # fields each recipe schema declares itself (no fields here at run time)
        student: _DtypedStudent
        train: TrainSpec
        source: str | None

    @model_validator(mode="after")
    def _student_dtype_fits_the_precision(self) -> RecipeChecks:
        # DeepSpeed casts an fp32 student to the training precision and keeps fp32 master
        # weights; a 16-bit student trained in another precision would lose them silently.
        dtype, precision = self.student.dtype, self.train.precision
        if dtype not in ("fp32", precision):
            fix = (
                "use student.dtype=fp32" if precision in ("fp32", "auto") else f"use student.dtype=fp32 or {precision}"
            )
            raise ValueError(
                f"student.dtype={dtype} cannot train with train.precision={precision}; "
                f"{fix}, or train.precision={dtype}"
            )
        return self

    @field_validator("deepspeed", check_fields=False)
    @classmethod
    def _deepspeed_settings_are_checked(cls, settings: dict[str, Any]) -> dict[str, Any]:
        problem = deepspeed_problem(settings, TrainSpec.model_fields)
        if problem is not None:
            within, message = problem
            # `within` is the key path inside the mapping, for the error's line number.
            raise PydanticCustomError("deepspeed_setting", "{message}", {"message": message, "within": within})
        return settings

    def resolve(self, written: str, key: str | None = None) -> Path:
        """A path written in the recipe, with environment variables expanded (module docstring).

        ``key`` (e.g. ``"data.train"``) names the recipe key in the error for an unset variable.
        """
        missing = unset_variables(written)
        if missing:
            where = f"{self.source}: " if self.source else ""
            what = f"{key}={written!r}" if key else repr(written)
            exports = " ".join(f"{name}=..." for name in missing)
            raise MtaError(
                f"{where}{what} uses the environment variable {', '.join(missing)}, which is not "
                f"set; export {exports} (see the recipe's header comment) or override {key or 'it'}"
            )
        path = Path(os.path.expandvars(written)).expanduser()
        if path.is_absolute() or self.source is None or path.exists():
            return path
        beside = Path(self.source).parent / path
        return beside if beside.exists() else path


class Recipe(RecipeChecks):
    name: str = Field(description="the run's name: a label in run.json, the model card and the trackers")
    seed: int = Field(42, description="seeds the data order, dropout, the projectors' initialisation and sampling")
    output_dir: str = Field(
        description="the run's directory: checkpoints/, final/, best/, metrics.jsonl, and its caches"
    )
    task: Literal["llm", "embedding"] = Field(
        "llm",
        description="llm: distil a causal LM (this schema); embedding: a sentence-embedding "
        "encoder, TALAS (EmbeddingRecipe)",
    )
    teacher: ModelSpec | None = Field(None, description="null: plain SFT, no teacher loaded")
    student: ModelSpec = Field(description="the causal LM trained")
    data: DataSpec = Field(description="the rows trained and evaluated on, and how they are annotated")
    loss: LossSpec = Field(
        LossSpec(), description="the objective: the base loss, MTA's DSA and HRA, FDD, SRA (docs/method.md)"
    )
    train: TrainSpec = Field(description="optimizer, schedule, length, precision, ZeRO, intervals")
    off_policy: OffPolicySpec = Field(
        OffPolicySpec(), description="student-generated responses during training (DistiLLM); off by default"
    )
    teacher_cache: TeacherCacheSpec = Field(
        TeacherCacheSpec(), description="the teacher's outputs read from `mta teacher`'s artefact; off by default"
    )
    deepspeed: dict[str, Any] = Field(
        default_factory=dict,
        description="DeepSpeed settings the schema does not model, merged in verbatim",
    )
    source: str | None = Field(None, description="the file this recipe was read from")

    @model_validator(mode="after")
    def _llm_task(self) -> Recipe:
        if self.task != "llm":  # load_recipe reads task: embedding with EmbeddingRecipe
            raise ValueError("a task: embedding recipe is an EmbeddingRecipe (load_recipe picks the schema)")
        return self

    @model_validator(mode="after")
    def _teacher_needed(self) -> Recipe:
        if self.teacher is None and self.loss.base != "ce":
            raise ValueError(f"loss.base={self.loss.base} needs a teacher; use 'ce' for SFT")
        if self.teacher is None and self.loss.trajectory_terms:
            raise ValueError("dsa_weight and hra_weight must be 0 without a teacher")
        if self.teacher is None and self.loss.fdd_weight:
            raise ValueError("loss.fdd_weight must be 0 without a teacher (FDD follows the teacher's layers)")
        if self.teacher is None and self.loss.sra_weight:
            raise ValueError("loss.sra_weight must be 0 without a teacher")
        if (
            not self.loss.base_weight
            and not self.loss.trajectory_terms
            and not self.loss.fdd_weight
            and not self.loss.sra_weight
        ):
            raise ValueError(
                "loss.base_weight, loss.dsa_weight, loss.hra_weight and loss.fdd_weight are all 0: nothing to train"
            )
        return self

    @model_validator(mode="after")
    def _unit_base_trains(self) -> Recipe:
        problem = unit_base_problem(self.loss)
        if problem is not None:
            within, message = problem
            raise PydanticCustomError("unit_base_setting", "{message}", {"message": message, "within": within})
        return self

    @model_validator(mode="after")
    def _reduction_fits(self) -> Recipe:
        if self.loss.reference_code and self.train.loss_reduction == "global":
            raise PydanticCustomError(
                "reduction_setting",
                "{message}",
                {
                    "message": "loss.reference_code computes DSA and HRA as the authors' code does, one pool per "
                    "micro batch, which has no global-batch form: set train.loss_reduction=micro_batch with it",
                    "within": ("loss", "reference_code"),
                },
            )
        return self

    @model_validator(mode="after")
    def _pairs_fit(self) -> Recipe:
        if self.loss.base != "distillm2":
            return self
        problem = None
        if self.train.micro_batch_size % 2:
            problem = (
                ("train", "micro_batch_size"),
                (
                    f"loss.base=distillm2 trains on pairs (the teacher's and the student's response to one "
                    f"prompt), two rows of one micro batch: use an even train.micro_batch_size, not "
                    f"{self.train.micro_batch_size}"
                ),
            )
        elif self.off_policy.mode != "off":
            problem = (
                ("off_policy", "mode"),
                (
                    "loss.base=distillm2 trains on the pairs `mta generate` wrote (each round: generate, "
                    "annotate, distill); it does not sample during training: use off_policy.mode=off"
                ),
            )
        if problem is not None:
            within, message = problem
            raise PydanticCustomError("pairs_setting", "{message}", {"message": message, "within": within})
        return self

    @model_validator(mode="after")
    def _rouge_needs_dev_rows(self) -> Recipe:
        if self.train.select_by == "rouge" and self.data.dev is None:
            raise PydanticCustomError(
                "selection_setting",
                "{message}",
                {
                    "message": "select_by=rouge samples responses to dev prompts: set data.dev (e.g. "
                    "dolly/dev.jsonl; never the test set), or select_by=loss",
                    "within": ("train", "select_by"),
                },
            )
        return self

    @model_validator(mode="after")
    def _lora_on_the_student(self) -> Recipe:
        if self.teacher is not None and self.teacher.license is not None:
            raise PydanticCustomError(
                "license_setting",
                "{message}",
                {
                    "message": "the license names the trained student's card: set student.license, not teacher.license",
                    "within": ("teacher", "license"),
                },
            )
        if self.teacher is not None and self.teacher.lora is not None:
            raise PydanticCustomError(
                "lora_setting",
                "{message}",
                {
                    "message": "LoRA trains the student; the teacher is frozen: remove teacher.lora (a LoRA-tuned "
                    "teacher is given as its merged model directory)",
                    "within": ("teacher", "lora"),
                },
            )
        return self

    @model_validator(mode="after")
    def _generation_fits(self) -> Recipe:
        problem = off_policy_problem(self)
        if problem is not None:
            within, message = problem
            # `within` is the key the problem is about, for the error's line number.
            raise PydanticCustomError("generation_setting", "{message}", {"message": message, "within": within})
        return self

    @model_validator(mode="after")
    def _teacher_cache_fits(self) -> Recipe:
        problem = teacher_cache_problem(self)
        if problem is not None:
            within, message = problem
            raise PydanticCustomError("teacher_cache_setting", "{message}", {"message": message, "within": within})
        return self

    @property
    def dev_sample_new_tokens(self) -> int:
        """Tokens the student generates after each sampled dev prompt; 0 when none are drawn."""
        if self.data.dev is None or not self.train.num_sample_generations:
            return 0
        return self.train.sample_max_new_tokens

    @property
    def fused_head_runs(self) -> bool:
        """Whether the base loss runs on the fused path: ``loss.uses_fused_head``, unless a sampled
        teacher cache feeds it (the fused head reads a teacher's head or its top k, not draws)."""
        sampled = self.teacher_cache.dir is not None and self.teacher_cache.logits == "sampled"
        return self.loss.uses_fused_head and not sampled

    @property
    def off_policy_max_new_tokens(self) -> int:
        """Tokens the student may generate per training response (``off_policy.max_new_tokens``,
        default ``data.max_length - data.max_prompt_length``, the published ``SampleGenerator``'s
        budget): a generated row of the longest prompt still fits ``data.max_length``."""
        if self.off_policy.max_new_tokens is not None:
            return self.off_policy.max_new_tokens
        return self.data.max_length - self.data.max_prompt_length


def unit_base_problem(loss: LossSpec) -> tuple[tuple[str, ...], str] | None:
    """Why ``loss.base: uld`` / ``gold`` would train nothing with these weights, as ``(key path,
    message)``, or None."""
    if loss.base not in UNIT_BASES or not loss.base_weight:
        return None
    terms = {"uld_weight": loss.uld_weight, "uld_ce_weight": loss.uld_ce_weight}
    if loss.base == "gold":
        terms["shared_kl_weight"] = loss.shared_kl_weight
    if any(terms.values()):
        return None
    return ("loss", "uld_weight"), (
        f"loss.base={loss.base} with {', '.join(f'loss.{key}=0' for key in terms)} compares nothing; "
        "give one of them a positive weight (the ULD authors': uld_weight 1.5, uld_ce_weight 1), or set "
        "loss.base_weight=0"
    )


# --- the stored teacher --------------------------------------------------------------------


def teacher_cache_problem(recipe: Recipe) -> tuple[tuple[str, ...], str] | None:
    """Why ``recipe`` cannot train from (or build) a teacher cache, as ``(key path, message)``,
    or None: what the cache does not hold (docs/teacher-cache.md)."""
    spec = recipe.teacher_cache
    if spec.logits == "top_k" and spec.top_k == 0:
        return ("teacher_cache", "top_k"), (
            "top_k=0 keeps no token with logits=top_k (every token would get the tail's mean); set top_k >= 1, "
            "or logits=sampled to draw tokens from the whole distribution"
        )
    if recipe.teacher_cache.dir is None:
        return None
    online = "or set teacher_cache.dir=null to run the teacher online"
    if recipe.teacher is None:
        return ("teacher_cache", "dir"), "teacher_cache.dir stores a teacher's outputs, and the recipe has no teacher"
    if recipe.loss.fdd_weight:
        return ("loss", "fdd_weight"), (
            "FDD needs the online teacher: it applies the teacher's final norm and LM head to the hidden states of "
            "every FDD layer at every position, a vocabulary-wide distribution per layer and token (GPT-2's 50,257 "
            f"tokens: 100 KB a token and layer in fp16); set loss.fdd_weight=0, {online}"
        )
    if recipe.loss.reference_code:
        return ("loss", "reference_code"), (
            "the authors' token importance (loss.reference_code) reads the teacher's states at the batch's padding "
            f"positions, which `mta teacher` does not store; set loss.reference_code=false, {online}"
        )
    if recipe.loss.sra_weight and recipe.loss.sra_centre == "last_token_attention":
        return ("loss", "sra_centre"), (
            "sra_centre=last_token_attention reads the teacher's attention rows, which `mta teacher` does not store; "
            f"use sra_centre=importance, {online}"
        )
    if recipe.loss.sra_weight and recipe.loss.sra_logit_weight:
        return ("loss", "sra_logit_weight"), (
            "SRA's logit term applies the teacher's LM head to its span centres, which `mta teacher` does not store; "
            f"set loss.sra_logit_weight=0, {online}"
        )
    return None


# --- student-generated responses -----------------------------------------------------------

# Why generated text needs a teacher logit loss: the reason every refusal below gives.
ON_POLICY_NEEDS_LOGITS = (
    "on-policy distillation compares the teacher's and the student's next-token distributions on "
    "the student's own text; with loss.base=ce there is no teacher signal on generated text (it "
    "would train the student to repeat its own samples)"
)


def off_policy_problem(recipe: Recipe) -> tuple[tuple[str, ...], str] | None:
    """The first way ``recipe.off_policy`` does not fit the rest of the recipe, as ``(key path,
    message)``, or None. Checked when the recipe validates; what needs the tokenizers is
    ``mta.training.config.model_checks.check_off_policy_fits``."""
    spec = recipe.off_policy
    if spec.mode == "off":
        return None
    if recipe.teacher is None:
        return ("off_policy", "mode"), (
            f"{spec.mode!r} needs a teacher: {ON_POLICY_NEEDS_LOGITS}. Plain SFT (teacher: null) "
            "trains on the reference responses only; use off_policy.mode=off"
        )
    if recipe.loss.base == "ce":
        return ("off_policy", "mode"), (
            f"{spec.mode!r} needs a logit loss (loss.base srkl as DistiLLM, or fkl, rkl, skl, jsd, "
            f"tvd): {ON_POLICY_NEEDS_LOGITS}. Set loss.base, or off_policy.mode=off"
        )
    if recipe.loss.base in UNIT_BASES:
        return ("off_policy", "mode"), (
            f"loss.base={recipe.loss.base} compares the two models on the units both tokenisations agree on "
            "(annotate's boundary_spans), and generated rows carry no such units; use off_policy.mode=off"
        )
    budget = recipe.data.max_length - recipe.data.max_prompt_length
    if spec.max_new_tokens is not None and spec.max_new_tokens > budget:
        return ("off_policy", "max_new_tokens"), (
            f"{spec.max_new_tokens} new tokens after a prompt of up to data.max_prompt_length="
            f"{recipe.data.max_prompt_length} do not fit data.max_length={recipe.data.max_length}; "
            f"use at most {budget} (or null for exactly that)"
        )
    if spec.mode == "adaptive":
        if spec.buffer_size < recipe.train.micro_batch_size:
            return ("off_policy", "buffer_size"), (
                f"{spec.buffer_size} rows cannot fill a micro batch drawn from the replay buffer; "
                f"use at least train.micro_batch_size={recipe.train.micro_batch_size} "
                "(DistiLLM uses 1000)"
            )
        if recipe.data.dev is None and spec.init_threshold == 0:
            return ("off_policy", "mode"), (
                "'adaptive' raises the threshold only when the dev loss rises, and there is no "
                "data.dev: with off_policy.init_threshold=0 it would never generate. Set data.dev, "
                "or a fixed off_policy.init_threshold above 0"
            )
    return None


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The schema classes a field's annotation names (``Optional[ModelSpec]`` -> ``[ModelSpec]``):
    the sections below a key, for walking a recipe schema."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in models_in(arg)]
