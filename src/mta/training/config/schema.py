"""Recipes: one YAML file names everything a distillation run needs, validated against code.

Unknown keys are errors, every error names the file, the line, the key and what is allowed, and
``key=value`` overrides from the command line are applied before validation so they are
checked exactly like the file.

Paths in a recipe (data, configs, tokenizers, models, output) are resolved when used, by
``Recipe.resolve``: ``~`` and ``$VAR`` / ``${VAR}`` are expanded from the environment (an unset
variable is an error that names it, never a silently literal ``$VAR`` directory); an absolute
path, or a relative one that exists from the working directory, is taken as written; otherwise
a relative path that exists beside the recipe file is taken from there (so ``configs/gpt2.json``
in the shipped ``gpt2.yaml`` means ``recipes/configs/gpt2.json``); anything else, such as
an output directory still to be created or a hub name like ``gpt2``, stays relative to the working
directory (also for a shipped recipe: its runs never land inside the installed package).

YAML is read by ``mta.training.config.yaml_reader`` (hostile documents refused before anything is built),
and the ``deepspeed:`` passthrough is checked by ``mta.training.config.deepspeed_settings``. Numbers must be
finite everywhere.
"""

from __future__ import annotations

import logging
import os
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mta.data.prompts import Template
from mta.errors import MtaError, close_match
from mta.training.config.deepspeed_settings import deepspeed_problem
from mta.training.config.extends import key_locations, merged_recipe, recipe_chain
from mta.training.config.yaml_reader import BoundedLoader, Refused, load_yaml, yaml_text

log = logging.getLogger(__name__)

BaseLossName = Literal["ce", "fkl", "rkl", "skl", "srkl", "jsd", "tvd", "distillm2"]
Precision = Literal["fp32", "bf16", "fp16"]
# train.precision: auto is bf16 where the device computes it natively (mta.dtypes), else fp32.
TrainPrecision = Literal["auto", "fp32", "bf16", "fp16"]
Granularity = Literal["word", "phrase"]


class Strict(BaseModel):
    # allow_inf_nan=False: `lr: .inf`, `.nan` or `1e400` is an error, never a silent NaN run.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TinyModel(Strict):
    """Build a random model from this description at first use (CPU runs and tests)."""

    model_type: Literal["llama", "gpt2", "qwen2"] = "llama"
    num_layers: int = Field(4, ge=1)
    hidden_size: int = Field(32, ge=4)
    num_heads: int = Field(4, ge=1)
    tokenizer_corpus: str = Field(description="JSONL whose text trains the byte-level BPE")
    vocab_size: int = Field(512, ge=300)
    seed: int = 0


class LoraSpec(Strict):
    """A LoRA student (``mta.training.lora``): adapters trained, the rest frozen, exports merged."""

    r: int = Field(16, ge=1, description="the adapters' rank")
    alpha: float = Field(64.0, gt=0, description="LoRA's alpha: the update is scaled by alpha / r")
    dropout: float = Field(0.1, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: Optional[Union[Literal["all-linear"], list[str]]] = Field(
        None, description="the layers adapted, by the last part of their name (q_proj, v_proj); "
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
    tokenizer: Optional[str] = Field(None, description="tokenizer name or directory; default: path")
    dtype: Precision = "fp32"
    config: Optional[str] = Field(
        None, description="architecture config JSON (relative to the recipe) for offline --dry-run"
    )
    tiny: Optional[TinyModel] = None
    lora: Optional[LoraSpec] = Field(
        None, description="student only: train LoRA adapters {r, alpha, dropout, target_modules}; "
        "null: full fine-tuning"
    )

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path


class DataSpec(Strict):
    train: str = Field(
        description="annotate output directory, or rows annotated on first use: a JSONL, Parquet "
        "or CSV file, or a datasets save_to_disk directory"
    )
    dev: Optional[str] = None
    max_length: int = Field(256, ge=8)
    max_prompt_length: int = Field(128, ge=1)
    word_spans: Literal["phrase", "all"] = "phrase"
    span_rule: Literal["paper", "reference"] = Field(
        "paper", description="token membership and word spans: paper (docs/method.md §1) or "
        "reference (the authors' code: a token is in [a, b) when start + 1 >= a and end <= b; a "
        "word runs to the start of the next one); an artefact must be built with the same rule"
    )
    spacy_model: str = "en_core_web_sm"
    truncate_prompt: bool = False
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
    def _prompt_fits(self) -> "DataSpec":
        if self.max_prompt_length >= self.max_length:
            raise ValueError("max_prompt_length must be smaller than max_length")
        if self.span_rule == "reference" and self.word_spans != "phrase":
            raise ValueError("span_rule=reference builds the authors' words of phrases; use word_spans=phrase")
        return self


class LayerPair(Strict):
    """One aligned layer pair, as ``output_hidden_states`` indices (0 = embeddings)."""

    student: int = Field(ge=0)
    teacher: int = Field(ge=0)
    granularity: Granularity

    @model_validator(mode="before")
    @classmethod
    def _from_triple(cls, value: Any) -> Any:
        # YAML is friendlier as [student, teacher, granularity] triples.
        if isinstance(value, (list, tuple)):
            if len(value) != 3:
                raise ValueError(
                    f"write a layer pair as [student, teacher, word|phrase], got {list(value)}"
                )
            return dict(zip(("student", "teacher", "granularity"), value))
        return value


# `auto` or explicit pairs; the discriminator picks the branch, so a typo in a pair is reported
# once, at its index, instead of also as "input should be 'auto'".
LayerMap = Annotated[
    Union[
        Annotated[Literal["auto"], Tag("'auto'")],
        Annotated[list[LayerPair], Tag("list[LayerPair]")],
    ],
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
            return dict(zip(("student", "teacher"), value))
        return value


IndexPairMap = Annotated[
    Union[
        Annotated[Literal["auto"], Tag("'auto'")],
        Annotated[list[LayerIndexPair], Tag("list[LayerIndexPair]")],
    ],
    Discriminator(lambda value: "'auto'" if isinstance(value, str) else "list[LayerIndexPair]"),
]


class LossSpec(Strict):
    base: BaseLossName = "srkl"
    base_weight: float = Field(1.0, ge=0)
    temperature: float = Field(1.0, gt=0)
    skew_alpha: float = Field(0.1, ge=0, le=1)
    jsd_beta: float = Field(0.5, gt=0, lt=1)
    dsa_weight: float = Field(2.0, ge=0)
    hra_weight: float = Field(0.2, ge=0)
    layers: LayerMap = Field(
        "auto",
        description="`auto` (the docs/method.md §4 rule) or a list of "
        "[student, teacher, word|phrase] triples",
    )
    importance: Literal["attention", "uniform"] = "attention"
    reference_code: bool = Field(
        False, description="compute MTA as the authors' code does instead of the formulas "
        "(docs/method.md §8): importance over every row of a batch padded to data.max_length, DSA "
        "over all pairs of the batch, HRA counting a token once per span; with importance=uniform "
        "their uniform-weights ablation (importance pooling kept, pair and token weights uniform)"
    )
    chunk_size: int = Field(128, ge=1, description="sequence positions per logit-loss chunk")
    distillm2_beta: float = Field(
        1.0, ge=0, le=2, description="loss.base=distillm2: (2 − β)·skew KL on the teacher's responses + "
        "β·skew reverse KL on the student's"
    )
    fdd_weight: float = Field(0.0, ge=0, description="feature dynamics distillation (FDD); 0: off")
    fdd_layers: IndexPairMap = Field(
        "auto", description="[student, teacher] pairs read through the logit lens; auto: student layers "
        "L/3, L/2, 2L/3 (4, 6, 8 of 12) and the teacher layers at the same depth"
    )
    fdd_temperature: float = Field(2.0, gt=0, description="FDD's softmax temperature (the authors: 5.0 "
                                   "with FDD alone, 2.0 with FDD + MTA)")
    fdd_final_norm: bool = Field(False, description="apply the final norm before the LM head (the "
                                 "authors: no, raw hidden states)")
    fdd_tokens: Literal["response", "all"] = Field(
        "all", description="the positions FDD compares: all real tokens (the authors') or the response's"
    )
    sra_weight: float = Field(0.0, ge=0, description="SRA (span representation alignment on the spans "
                              "both tokenizers agree on); 0: off")
    sra_layers: Union[Literal["last"], list[LayerIndexPair]] = Field(
        "last", description="[student, teacher] pairs whose span centres align; last: each model's last layer"
    )
    sra_centre: Literal["last_token_attention", "importance"] = Field(
        "last_token_attention", description="span centre weights: the attention row of the last real token "
        "(the public port's; runs attention eagerly) or docs/method.md §2 importance"
    )
    sra_scope: Literal["response", "all"] = Field("response", description="the spans SRA aligns")
    sra_geometry_weight: float = Field(50.0, ge=0, description="SRA's span-geometry term (the port's 50)")
    sra_logit_weight: float = Field(1.0, ge=0, description="SRA's span logit KL over the shared vocabulary")

    @property
    def alignment_terms(self) -> tuple[str, ...]:
        """The MTA terms with a non-zero weight, of ``("dsa", "hra")``: the one place that decides
        whether MTA is on. An empty tuple means no layer is aligned and no projector is built."""
        return tuple(term for term in ("dsa", "hra") if getattr(self, f"{term}_weight"))


class AsamSpec(Strict):
    """ASAM (Kwon et al., 2021) around the optimizer, for any recipe (``mta.training.asam``): each
    step's gradient is taken at w + ε, ε = ρ·T_w²·g / ‖T_w·g‖ with T_w = |w| + η, and applied to w."""

    rho: float = Field(0.05, gt=0, description="the radius ρ (TALAS's author: 0.05; Kwon et al.: 0.5)")
    eta: float = Field(0.0, ge=0, description="η in T_w = |w| + η (TALAS's author: 0, pytorch_optimizer's "
                       "SAM(adaptive=True); the paper and Kwon et al.: 0.01)")
    scope: Literal["all", "weights"] = Field(
        "all", description="the parameters T_w applies to: all (TALAS's author) or those whose name ends "
        "in 'weight' (Kwon et al.'s code); the others are perturbed as in SAM (T_w = 1)"
    )


class TrainSpec(Strict):
    optimizer: Literal["adamw"] = "adamw"
    lr: float = Field(1e-4, gt=0)
    projector_lr: float = Field(5e-4, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    batch_size: int = Field(16, ge=1, description="global batch: per device x accumulation x world")
    micro_batch_size: int = Field(8, ge=1, description="sequences per device per forward pass")
    epochs: Optional[float] = Field(None, gt=0)
    max_steps: Optional[int] = Field(None, ge=1)
    grad_clip: float = Field(1.0, ge=0)
    precision: TrainPrecision = Field(
        "fp32", description="auto: bf16 on a GPU with bf16 or a CPU with bf16 instructions, else fp32; "
        "bf16 on a CPU is autocast over fp32 weights; fp16 needs a GPU",
    )
    zero_stage: Literal[0, 1, 2, 3] = 1
    teacher_zero3: bool = Field(False, description="partition the teacher with ZeRO-3 too")
    log_interval: int = Field(10, ge=1)
    eval_interval: int = Field(100, ge=1)
    save_interval: int = Field(500, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    num_sample_generations: int = Field(2, ge=0, le=8)
    sample_max_new_tokens: int = Field(48, ge=1)
    select_by: Literal["loss", "rouge"] = Field(
        "loss", description="what OUT/best/ keeps (mta.training.lifecycle.selection): the lowest dev loss, or the "
        "highest dev ROUGE-L of sampled responses (the published numbers' selection), at each eval_interval"
    )
    select_rows: int = Field(500, ge=1, description="select_by=rouge: the first dev rows sampled, one seed")
    save_generated: bool = Field(
        False, description="also write the rows the student generates for training to OUT/generated/"
    )
    asam: Optional[AsamSpec] = Field(
        None, description="sharpness-aware steps {rho, eta, scope} (mta.training.asam): two forward and "
        "backward passes of each accumulation window; null: off"
    )
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="experiment trackers that also get every metrics.jsonl record, the recipe and "
        "the dev samples (mta.tracking): OUT/tensorboard/, W&B, MLflow; each needs pip install 'mta[NAME]'",
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
    def _length_given(self) -> "TrainSpec":
        if (self.epochs is None) == (self.max_steps is None):
            raise ValueError("give exactly one of train.epochs and train.max_steps")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size {self.batch_size} is not a multiple of micro_batch_size "
                f"{self.micro_batch_size}"
            )
        return self

    @model_validator(mode="after")
    def _asam_fits_zero(self) -> "TrainSpec":
        if self.asam is not None and self.zero_stage == 3:
            from mta.training.asam import ZERO3_REFUSAL

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


GenerationMode = Literal["off", "adaptive", "always"]
GenerationSchedule = Literal["decreasing", "constant", "increasing"]


class GenerationSpec(Strict):
    """Student-generated responses during training (DistiLLM's adaptive off-policy sampling).

    What each mode does, and how the threshold moves, is ``mta.training.sampling.policy``'s docstring;
    which base losses and tokenizers it works with is checked by ``Recipe`` (here) and by
    ``check_generation_fits`` (once the tokenizers are loaded).
    """

    mode: GenerationMode = Field(
        "off",
        description="off: the reference responses only; adaptive: DistiLLM's adaptive "
        "off-policy sampling with a replay buffer; always: every micro batch generated (on-policy)",
    )
    init_threshold: float = Field(0.0, ge=0, le=1, description="the threshold τ at step 0")
    threshold_step: float = Field(
        0.1, gt=0, le=1, description="what τ grows by when the dev loss rises by loss_eps"
    )
    loss_eps: float = Field(
        0.1, ge=0, description="the dev-loss rise (over the last reference) that raises τ"
    )
    schedule: GenerationSchedule = Field(
        "decreasing",
        description="the share of τ that generates fresh rows: τ·(1 − t/T), τ/2 or τ·t/T",
    )
    buffer_size: int = Field(1000, ge=1, description="generated rows each process's replay buffer holds")
    max_new_tokens: Optional[int] = Field(
        None, ge=1, description="tokens generated per response; null: data.max_length - data.max_prompt_length"
    )
    dev_rows: Optional[int] = Field(
        None, ge=1, description="dev rows the threshold's cross-entropy is measured on (the first ones); "
        "null: the whole dev split (DistiLLM's scripts: --dev-num 1000)"
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _off_as_yaml_reads_it(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` (and `no`, `false`) as false: that is the mode `off`.
        if value is False:
            return "off"
        if value is True:
            raise ValueError(
                "YAML reads on / yes / true as true, which is not a mode; use one of 'off', "
                "'adaptive' or 'always'"
            )
        return value


_ENV_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def unset_variables(written: str) -> list[str]:
    """The environment variables a recipe path names (``$VAR``, ``${VAR}``) that are not set."""
    named = {name for groups in _ENV_VAR.findall(written) for name in groups if name}
    return sorted(named - set(os.environ))


class RecipeChecks(Strict):
    """What every recipe schema (``Recipe``, ``EmbeddingRecipe``) checks and offers: its
    ``student.dtype`` against ``train.precision``, the ``deepspeed:`` passthrough, and paths."""

    @model_validator(mode="after")
    def _student_dtype_fits_the_precision(self):
        # DeepSpeed casts an fp32 student to the training precision and keeps fp32 master
        # weights; a 16-bit student trained in another precision would lose them silently.
        dtype, precision = self.student.dtype, self.train.precision
        if dtype not in ("fp32", precision):
            fix = "use student.dtype=fp32" if precision in ("fp32", "auto") else f"use student.dtype=fp32 or {precision}"
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
    name: str
    seed: int = 42
    output_dir: str
    task: Literal["llm", "embedding"] = Field(
        "llm", description="llm: distil a causal LM (this schema); embedding: a sentence-embedding "
        "encoder, TALAS (EmbeddingRecipe)"
    )
    teacher: Optional[ModelSpec] = Field(None, description="null: plain SFT, no teacher loaded")
    student: ModelSpec
    data: DataSpec
    loss: LossSpec = LossSpec()
    train: TrainSpec
    generation: GenerationSpec = GenerationSpec()
    deepspeed: dict[str, Any] = Field(
        default_factory=dict,
        description="DeepSpeed settings the schema does not model, merged in verbatim",
    )
    source: Optional[str] = Field(None, description="the file this recipe was read from")

    @model_validator(mode="after")
    def _llm_task(self) -> "Recipe":
        if self.task != "llm":  # load_recipe reads task: embedding with EmbeddingRecipe
            raise ValueError("a task: embedding recipe is an EmbeddingRecipe (load_recipe picks the schema)")
        return self

    @model_validator(mode="after")
    def _teacher_needed(self) -> "Recipe":
        if self.teacher is None and self.loss.base != "ce":
            raise ValueError(f"loss.base={self.loss.base} needs a teacher; use 'ce' for SFT")
        if self.teacher is None and self.loss.alignment_terms:
            raise ValueError("dsa_weight and hra_weight must be 0 without a teacher")
        if self.teacher is None and self.loss.fdd_weight:
            raise ValueError("loss.fdd_weight must be 0 without a teacher (FDD follows the teacher's layers)")
        if self.teacher is None and self.loss.sra_weight:
            raise ValueError("loss.sra_weight must be 0 without a teacher")
        if not self.loss.base_weight and not self.loss.alignment_terms and not self.loss.fdd_weight \
                and not self.loss.sra_weight:
            raise ValueError(
                "loss.base_weight, loss.dsa_weight, loss.hra_weight and loss.fdd_weight are all 0: nothing to train"
            )
        return self

    @model_validator(mode="after")
    def _pairs_fit(self) -> "Recipe":
        if self.loss.base != "distillm2":
            return self
        problem = None
        if self.train.micro_batch_size % 2:
            problem = ("train", "micro_batch_size"), (
                f"loss.base=distillm2 trains on pairs (the teacher's and the student's response to one "
                f"prompt), two rows of one micro batch: use an even train.micro_batch_size, not "
                f"{self.train.micro_batch_size}"
            )
        elif self.generation.mode != "off":
            problem = ("generation", "mode"), (
                "loss.base=distillm2 trains on the pairs `mta generate` wrote (each round: generate, "
                "annotate, distill); it does not sample during training: use generation.mode=off"
            )
        if problem is not None:
            within, message = problem
            raise PydanticCustomError("pairs_setting", "{message}", {"message": message, "within": within})
        return self

    @model_validator(mode="after")
    def _rouge_needs_dev_rows(self) -> "Recipe":
        if self.train.select_by == "rouge" and self.data.dev is None:
            raise PydanticCustomError("selection_setting", "{message}", {
                "message": "select_by=rouge samples responses to dev prompts: set data.dev (e.g. "
                "dolly/dev.jsonl; never the test set), or select_by=loss", "within": ("train", "select_by"),
            })
        return self

    @model_validator(mode="after")
    def _lora_on_the_student(self) -> "Recipe":
        if self.teacher is not None and self.teacher.lora is not None:
            raise PydanticCustomError("lora_setting", "{message}", {
                "message": "LoRA trains the student; the teacher is frozen: remove teacher.lora (a LoRA-tuned "
                "teacher is given as its merged model directory)", "within": ("teacher", "lora"),
            })
        return self

    @model_validator(mode="after")
    def _generation_fits(self) -> "Recipe":
        problem = generation_problem(self)
        if problem is not None:
            within, message = problem
            # `within` is the key the problem is about, for the error's line number.
            raise PydanticCustomError("generation_setting", "{message}", {"message": message, "within": within})
        return self

    @property
    def dev_sample_new_tokens(self) -> int:
        """Tokens the student generates after each sampled dev prompt; 0 when none are drawn."""
        if self.data.dev is None or not self.train.num_sample_generations:
            return 0
        return self.train.sample_max_new_tokens

    @property
    def generation_max_new_tokens(self) -> int:
        """Tokens the student may generate per training response (``generation.max_new_tokens``,
        default ``data.max_length - data.max_prompt_length``, the published ``SampleGenerator``'s
        budget): a generated row of the longest prompt still fits ``data.max_length``."""
        if self.generation.max_new_tokens is not None:
            return self.generation.max_new_tokens
        return self.data.max_length - self.data.max_prompt_length



# --- student-generated responses -----------------------------------------------------------

# Why generated text needs a teacher logit loss: the reason every refusal below gives.
ON_POLICY_NEEDS_LOGITS = (
    "on-policy distillation compares the teacher's and the student's next-token distributions on "
    "the student's own text; with loss.base=ce there is no teacher signal on generated text (it "
    "would train the student to repeat its own samples)"
)


def generation_problem(recipe: "Recipe") -> Optional[tuple[tuple[str, ...], str]]:
    """The first way ``recipe.generation`` does not fit the rest of the recipe, as ``(key path,
    message)``, or None. Checked when the recipe validates; what needs the tokenizers is
    ``check_generation_fits``."""
    spec = recipe.generation
    if spec.mode == "off":
        return None
    if recipe.teacher is None:
        return ("generation", "mode"), (
            f"{spec.mode!r} needs a teacher: {ON_POLICY_NEEDS_LOGITS}. Plain SFT (teacher: null) "
            "trains on the reference responses only; use generation.mode=off"
        )
    if recipe.loss.base == "ce":
        return ("generation", "mode"), (
            f"{spec.mode!r} needs a logit loss (loss.base srkl as DistiLLM, or fkl, rkl, skl, jsd, "
            f"tvd): {ON_POLICY_NEEDS_LOGITS}. Set loss.base, or generation.mode=off"
        )
    budget = recipe.data.max_length - recipe.data.max_prompt_length
    if spec.max_new_tokens is not None and spec.max_new_tokens > budget:
        return ("generation", "max_new_tokens"), (
            f"{spec.max_new_tokens} new tokens after a prompt of up to data.max_prompt_length="
            f"{recipe.data.max_prompt_length} do not fit data.max_length={recipe.data.max_length}; "
            f"use at most {budget} (or null for exactly that)"
        )
    if spec.mode == "adaptive":
        if spec.buffer_size < recipe.train.micro_batch_size:
            return ("generation", "buffer_size"), (
                f"{spec.buffer_size} rows cannot fill a micro batch drawn from the replay buffer; "
                f"use at least train.micro_batch_size={recipe.train.micro_batch_size} "
                "(DistiLLM uses 1000)"
            )
        if recipe.data.dev is None and spec.init_threshold == 0:
            return ("generation", "mode"), (
                "'adaptive' raises the threshold only when the dev loss rises, and there is no "
                "data.dev: with generation.init_threshold=0 it would never generate. Set data.dev, "
                "or a fixed generation.init_threshold above 0"
            )
    return None


def check_generation_fits(recipe: "Recipe", same_tokenizer: bool) -> None:
    """Refuse student generation where the loaded tokenizers leave no teacher logit loss.

    The trainer calls it once the tokenizers are loaded (``same_tokenizer``: the teacher's and the
    student's vocabulary fingerprints are equal). Across tokenizers the base loss can only be ce
    on the reference (docs/method.md §5), so generated text would have no teacher signal. Raises
    ``MtaError`` naming the keys; passes when ``generation.mode`` is off.
    """
    if recipe.generation.mode == "off" or same_tokenizer:
        return
    where = f"{recipe.source}: " if recipe.source else ""
    raise MtaError(
        f"{where}generation.mode={recipe.generation.mode} needs the teacher and the student to share "
        f"a tokenizer, and these differ ({recipe.teacher.tokenizer_path} vs "
        f"{recipe.student.tokenizer_path}): across tokenizers there is no logit loss, and "
        f"{ON_POLICY_NEEDS_LOGITS}. Set generation.mode=off, or use a teacher with the student's tokenizer"
    )


# --- embedding recipes (task: embedding) --------------------------------------------------

# Keys of the shared train: section that only LLM distillation reads (an embedding recipe that
# sets one to anything but its default is refused; the defaults stay in its resolved recipe, unread).
LLM_ONLY_TRAIN_KEYS = ("teacher_zero3", "num_sample_generations", "sample_max_new_tokens", "save_generated",
                       "select_rows")


class TinyEncoder(Strict):
    """Build a random BERT encoder (``mta.embedding.tiny_encoders``) and a WordPiece tokenizer trained
    on ``tokenizer_corpus`` at first use (CPU runs and tests)."""

    model_type: Literal["bert"] = "bert"
    num_layers: int = Field(4, ge=1)
    hidden_size: int = Field(32, ge=4)
    num_heads: int = Field(4, ge=1)
    tokenizer_corpus: str = Field(description="JSONL whose text trains the WordPiece tokenizer")
    vocab_size: int = Field(512, ge=100)
    seed: int = 0


class EncoderSpec(Strict):
    path: str = Field(description="hub name or local directory of a Hugging Face encoder (AutoModel) "
                      "or a sentence-transformers model")
    tokenizer: Optional[str] = Field(None, description="tokenizer name or directory; default: path")
    dtype: Precision = "fp32"
    config: Optional[str] = Field(
        None, description="architecture config JSON (relative to the recipe) for offline --dry-run"
    )
    tiny: Optional[TinyEncoder] = None

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path


class StudentEncoderSpec(EncoderSpec):
    pooling: Literal["cls_attention", "mean", "cls"] = Field(
        "cls_attention", description="how each layer's states become its sentence embedding, and the "
        "exported model's pooling: cls_attention (TALAS's author: attention with the CLS state as the "
        "query), mean or cls (mta.embedding.encoder.pool)"
    )


class TeacherEncoderSpec(EncoderSpec):
    pooling: Literal["auto", "mean", "cls", "max", "last", "cls_attention"] = Field(
        "auto", description="the teacher's pooling when its embeddings are built at first use: auto "
        "(its sentence-transformers config, else mean), or a mode (TALAS's author: cls for BGE-M3, "
        "last for Qwen3-Embedding)"
    )


class EmbeddingDataSpec(Strict):
    train: str = Field(
        description="an `mta embed` output directory (the teacher's embeddings), or rows embedded with "
        "the recipe's teacher at first use into OUT/embeddings/train: a JSONL, Parquet or CSV file or "
        "a datasets save_to_disk directory"
    )
    dev: Optional[str] = Field(None, description="the same for the dev loss; null: no dev evaluation")
    max_length: int = Field(256, ge=2, description="tokens per text, special tokens included: the "
                            "student's, and the teacher's when it embeds at first use (TALAS's author: 256)")
    text_field: Optional[str] = Field(
        None, description="the column holding each row's text; null: text, else instruction + input + "
        "response, else prompt + response (mta.embedding.teacher_embeddings)"
    )


class EmbeddingLossSpec(Strict):
    """λ1·SimCSE + λ2·TAMD + λ3·LASD (mta.losses.talas; TALAS's defaults: 0.001 / 0.75 / 1)."""

    simcse_weight: float = Field(0.001, ge=0, description="λ1: SimCSE, the batch encoded twice with "
                                 "dropout, InfoNCE on the last layer")
    tamd_weight: float = Field(0.75, ge=0, description="λ2: TAMD, 1 − cos(W_l e_l, e_teacher) on the "
                               "top tamd_layers layers")
    lasd_weight: float = Field(1.0, ge=0, description="λ3: LASD, each layer's in-batch cosine matrix "
                               "pulled towards the layer above's")
    tamd_layers: int = Field(2, ge=1, description="K: the top student layers anchored to the teacher "
                             "(TALAS: 2)")
    lasd_detach: bool = Field(False, description="detach the upper layer's matrix (the guide); the "
                              "author's code does not")
    lasd_reduction: Literal["mean", "sum"] = Field(
        "mean", description="per layer pair: the mean over the B² entries (the author's F.mse_loss) or "
        "their sum (eq. 5's squared Frobenius norm, B² times larger)"
    )
    simcse_temperature: float = Field(0.1, gt=0, description="τ of SimCSE (the author's script: 0.1)")

    @model_validator(mode="after")
    def _something_to_train(self) -> "EmbeddingLossSpec":
        if not (self.simcse_weight or self.tamd_weight or self.lasd_weight):
            raise ValueError("simcse_weight, tamd_weight and lasd_weight are all 0: nothing to train")
        return self


class EmbeddingRecipe(RecipeChecks):
    """A sentence-embedding distillation (``task: embedding``, TALAS): an encoder student learns
    a teacher's stored sentence embeddings (``mta embed``; built at first use from ``teacher``
    when ``data`` names rows). The teacher model itself is never loaded for training."""

    name: str
    seed: int = 42
    output_dir: str
    task: Literal["embedding"]
    teacher: Optional[TeacherEncoderSpec] = Field(
        None, description="the embedding teacher, loaded only to embed data rows at first use; null: "
        "data names `mta embed` directories"
    )
    student: StudentEncoderSpec
    data: EmbeddingDataSpec
    loss: EmbeddingLossSpec = EmbeddingLossSpec()
    train: TrainSpec
    deepspeed: dict[str, Any] = Field(
        default_factory=dict,
        description="DeepSpeed settings the schema does not model, merged in verbatim",
    )
    source: Optional[str] = Field(None, description="the file this recipe was read from")

    @model_validator(mode="after")
    def _no_llm_train_keys(self) -> "EmbeddingRecipe":
        fields = TrainSpec.model_fields
        named = [key for key in LLM_ONLY_TRAIN_KEYS
                 if key in fields and getattr(self.train, key) != fields[key].get_default(call_default_factory=True)]
        if getattr(self.train, "select_by", "loss") == "rouge":
            named.insert(0, "select_by")
        if named:
            raise PydanticCustomError("task_setting", "{message}", {
                "message": f"{named[0]} is a key of task: llm recipes (generation and the LLM teacher); "
                "a task: embedding recipe does not read it: remove it", "within": ("train", named[0]),
            })
        return self

    @property
    def dev_sample_new_tokens(self) -> int:
        """No generation: an encoder has nothing to sample."""
        return 0


AnyRecipe = Union[Recipe, EmbeddingRecipe]
TASK_SCHEMAS: dict[str, type[BaseModel]] = {"llm": Recipe, "embedding": EmbeddingRecipe}


class _TaskOnly(BaseModel):
    """A recipe's ``task`` alone, checked first: against the wrong schema every other key would
    be an error too."""

    model_config = ConfigDict(extra="ignore")
    task: Literal["llm", "embedding"] = Recipe.model_fields["task"]


def recipe_schema(raw: Any) -> type[BaseModel]:
    """The schema a recipe mapping is read with: by its ``task`` (default llm; a value that is no
    task is reported by ``Recipe``'s own check of the key)."""
    task = raw.get("task", "llm") if isinstance(raw, dict) else "llm"
    return TASK_SCHEMAS.get(task, Recipe) if isinstance(task, str) else Recipe


# --- the recipe against the models --------------------------------------------------------

# Config keys that bound a model's positions, by the name the config itself uses.
POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions")


def position_limit(config: Any) -> Optional[tuple[int, str]]:
    """``(positions, config key)`` a Hugging Face model config allows, or None if it has no limit
    (a model without ``max_position_embeddings`` / ``n_positions``)."""
    own = vars(config) if hasattr(config, "__dict__") else {}
    # The config's own key first: GPT-2's config also answers to max_position_embeddings.
    for read in (own.get, lambda attribute: getattr(config, attribute, None)):
        for attribute in POSITION_LIMIT_KEYS:
            value = read(attribute)
            if type(value) is int and value > 0:
                return value, attribute
    return None


def check_sequence_lengths(
    data: DataSpec, config: Any, role: str, *, model: Optional[str] = None,
    sample_new_tokens: int = 0, source: Optional[str] = None,
) -> None:
    """Refuse ``data.max_length`` beyond the positions ``config`` (the ``role`` model's) has.

    ``role`` is ``"student"`` or ``"teacher"``; ``model`` names it in the message (default: the
    config's ``name_or_path``). ``sample_new_tokens``: the dev samples the student generates
    (``Recipe.dev_sample_new_tokens``) extend a prompt of up to ``data.max_prompt_length``
    tokens, so those must fit too. ``source`` (the recipe file) starts the message. Raises
    ``MtaError`` naming the key, the model and its limit; a config without a limit passes.
    """
    found = position_limit(config)
    if found is None:
        return
    limit, attribute = found
    name = model or getattr(config, "name_or_path", "") or getattr(config, "model_type", "") or role
    what = f"the {role} ({name}) has {limit:,} positions ({attribute} in its config)"
    where = f"{source}: " if source else ""
    if data.max_length > limit:
        raise MtaError(
            f"{where}data.max_length={data.max_length:,} is longer than {what}; set data.max_length to at "
            f"most {limit:,} (and data.max_prompt_length below it)"
        )
    sampled = data.max_prompt_length + sample_new_tokens
    if sample_new_tokens and sampled > limit:
        raise MtaError(
            f"{where}dev samples need up to data.max_prompt_length + train.sample_max_new_tokens = "
            f"{data.max_prompt_length:,} + {sample_new_tokens:,} = {sampled:,} positions, more than "
            f"{what}; lower train.sample_max_new_tokens to at most "
            f"{max(limit - data.max_prompt_length, 0):,} (or train.num_sample_generations=0)"
        )


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings to a nested mapping, in order; values are YAML scalars.

    Missing mappings on the way are created (``deepspeed.zero_optimization.offload_param.device=
    cpu``), a numeric part indexes a list (``loss.layers.0.teacher=20``) and the recipe's
    validation then checks the result exactly like a value written in the file.
    """
    for override in overrides:
        key, sep, text = override.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise MtaError(
                f"override {override!r} is not of the form key.path=value (e.g. train.lr=5e-5)"
            )
        value = load_yaml(text, f"override {override!r}")
        node: Any = raw
        for depth, part in enumerate(parts):
            here = ".".join(parts[: depth + 1])
            last = depth == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise MtaError(
                        f"override {override!r}: {here} indexes a list of {len(node)} items; "
                        f"use an index from 0 to {len(node) - 1}"
                    )
                part = int(part)
            elif not isinstance(node, dict):
                raise MtaError(
                    f"override {override!r}: {'.'.join(parts[:depth])} is a value, not a mapping"
                )
            if last:
                node[part] = value
            else:
                if isinstance(node, dict) and node.get(part) is None:
                    node[part] = {}
                node = node[part]
    return raw


def _section_model(path: tuple[str | int, ...], root: type[BaseModel] | None = None) -> type[BaseModel] | None:
    """The schema class that a (pydantic) error location points into, for listing its keys
    (``root``: the recipe schema, default ``Recipe``)."""
    model: type[BaseModel] = root or Recipe
    for part in path:
        if isinstance(part, int) or part not in model.model_fields:
            continue
        nested = _models_in(model.model_fields[part].annotation)
        if not nested:
            return None
        model = nested[0]
    return model


def _field_description(path: tuple[str | int, ...], root: type[BaseModel] | None = None) -> str | None:
    model = _section_model(path[:-1], root) if path else None
    field = model.model_fields.get(str(path[-1])) if model else None
    return field.description if field else None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models_in(arg)]


def _key_lines(text: str) -> dict[tuple[Any, ...], int]:
    """1-based line of every key and list item of a YAML document, by its key path.

    Keys are taken as YAML reads them (``1:`` is the int 1, as in the loaded mapping); a node
    reached again through an alias is not walked twice.
    """
    lines: dict[tuple[Any, ...], int] = {}
    walked: set[int] = set()
    loader = BoundedLoader(text)

    def walk(node: yaml.Node, path: tuple[Any, ...]) -> None:
        if id(node) in walked:
            return
        walked.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                try:
                    key = loader.construct_object(key_node)
                except yaml.YAMLError:
                    key = key_node.value
                child = path + (key,)
                lines[child] = key_node.start_mark.line + 1
                walk(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                lines[path + (index,)] = item.start_mark.line + 1
                walk(item, path + (index,))

    try:
        root = loader.get_single_node()
        if root is not None:
            walk(root, ())
    except (yaml.YAMLError, Refused, RecursionError):
        pass
    finally:
        loader.dispose()
    return lines


def _file_path(item: dict[str, Any], raw: Any) -> tuple[Any, ...]:
    """The key path of an error in the file's terms: pydantic's location without the parts that
    are not keys of the file (union branch tags such as ``list[LayerPair]``, ``[key]``), plus
    the path inside a free-form mapping that a validator reported (``ctx['within']``)."""
    loc = tuple(item["loc"]) + tuple((item.get("ctx") or {}).get("within", ()))
    path: list[Any] = []
    node = raw
    for position, part in enumerate(loc):
        if part == "[key]":
            continue
        if isinstance(node, dict) and part not in node:
            # pydantic spells some keys as text (a `null:` key is located as "None").
            part = next((key for key in node if not isinstance(key, str) and str(key) == part), part)
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and type(part) is int and 0 <= part < len(node):
            node = node[part]
        elif (isinstance(part, str) and part.isidentifier()) or type(part) is int or (
            # The key an unknown-key error is about is always a key of the file.
            position == len(loc) - 1 and item["type"] in ("extra_forbidden", "invalid_key")
        ):
            node = None  # a schema key the file does not have (a missing key)
        else:
            continue
        path.append(part)
    return tuple(path)


def _key_text(path: tuple[Any, ...]) -> str:
    """``train.lr``; a key that is not a plain name is quoted (``'train lr'``) or spelt as YAML
    (``null``, ``true``), so the reader sees exactly what the file says."""
    def part_text(part: Any) -> str:
        if part is None or isinstance(part, bool):
            return yaml_text(part)
        if isinstance(part, str) and re.fullmatch(r"[\w-]+", part) or type(part) is int:
            return str(part)
        return repr(part)

    return ".".join(part_text(part) for part in path)


def _unknown_key(path: tuple[Any, ...], root: type[BaseModel] | None = None) -> str:
    model = _section_model(path[:-1], root)
    if model is None:
        return "unknown key (check its spelling and the section it is in)"
    allowed = ", ".join(model.model_fields)
    key = str(path[-1])
    other_task = _other_task_with_key(path, root or Recipe)
    if other_task:
        this_task = next(task for task, schema in TASK_SCHEMAS.items() if schema is (root or Recipe))
        return (f"unknown key in a task: {this_task} recipe: {key} is a key of task: {other_task} recipes "
                f"(allowed here: {allowed})")
    match = close_match(key, model.model_fields)
    if match:
        return f"unknown key: did you mean {match}? (allowed here: {allowed})"
    elsewhere = _sections_with_key(key, root)
    if elsewhere:
        return f"unknown key here: {key} is a key of {' and '.join(elsewhere)} (allowed here: {allowed})"
    return f"unknown key (check its spelling and the section it is in); allowed here: {allowed}"


def _other_task_with_key(path: tuple[Any, ...], root: type[BaseModel]) -> str | None:
    """The other task whose schema has the key at ``path`` (``loss.dsa_weight`` in an embedding
    recipe: llm), or None."""
    for task, schema in TASK_SCHEMAS.items():
        if schema is root:
            continue
        model = _section_model(path[:-1], schema)
        if model is not None and str(path[-1]) in model.model_fields and (
            len(path) == 1 or str(path[0]) in schema.model_fields
        ):
            return task
    return None


def _sections_with_key(key: str, root: type[BaseModel] | None = None) -> list[str]:
    found = []

    def search(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            if name == key and prefix:
                found.append(prefix.rstrip("."))
            for nested in _models_in(field.annotation):
                search(nested, f"{prefix}{name}.")

    search(root or Recipe, "")
    return found


def _describe(item: dict[str, Any], path: tuple[Any, ...], root: type[BaseModel] | None = None) -> str:
    kind, given = item["type"], item.get("input")
    if kind == "extra_forbidden" or (kind == "invalid_key" and _section_model(path[:-1], root)):
        return _unknown_key(path, root)
    if kind == "invalid_key" or tuple(item["loc"][-1:]) == ("[key]",):
        return f"a key must be a name (got {given!r}); quote it if it is one"
    if kind == "literal_error":
        hint = _field_description(path, root)
        return f"{given!r} is not allowed; use one of {item['ctx']['expected']}" + (
            f" ({hint})" if hint else ""
        )
    if kind == "missing":
        return "required key is missing"
    if kind == "finite_number":
        return f"must be a finite number (got {given!r})"
    message = item["msg"].removeprefix("Value error, ")
    if kind.endswith(("_type", "_parsing")) or kind.startswith(("greater", "less")):
        message += f" (got {given!r})"
    return message


def _format_validation_error(
    source: str, error: ValidationError, text: str = "", overridden: dict[str, str] | None = None,
    raw: Any = None, locations: dict[tuple[Any, ...], str] | None = None, *,
    schema: type[BaseModel] | None = None,
) -> str:
    """One line per problem: ``line N: key: what is wrong and what is allowed``.

    ``text`` (the file) gives the line numbers, ``overridden`` (``key -> 'key=value'``) names the
    override a key came from instead, ``raw`` (the mapping that was validated) keeps keys that
    are not names, such as ``train lr`` or ``1``. ``locations`` (``{key path: "line N"}``, or
    ``"PARENT.yaml line N"`` for a key an extended recipe set) replaces ``text``'s lines.
    ``schema``: the recipe class validated (default ``Recipe``; ``recipe_schema``).
    """
    if locations is None:
        locations = {path: f"line {line}" for path, line in (_key_lines(text) if text else {}).items()}
    overridden = overridden or {}
    lines = [f"{source}: invalid recipe"]
    for item in error.errors():
        path = _file_path(item, raw)
        key = _key_text(path)
        parts = tuple(str(part) for part in path)
        origin = next(
            (f" (from override {override!r})" for name, override in overridden.items()
             if _override_covers(tuple(name.split(".")), parts)),
            "",
        )
        location = next(
            (locations[path[:depth]] for depth in range(len(path), 0, -1) if path[:depth] in locations),
            None,
        )
        where = f"{location}: " if location and not origin else ""
        # Whole-recipe checks (loc empty) name their keys in the message itself.
        named = f"{key}: " if key else ""
        lines.append(f"  {where}{named}{_describe(item, path, schema)}{origin}")
    return "\n".join(lines)


def _override_covers(override: tuple[str, ...], key: tuple[str, ...]) -> bool:
    """Whether an error at ``key`` comes from the override of ``override``: the override set
    the key or a mapping above it, or (inside the free-form deepspeed: mapping, where whole
    sections are refused) a key below it."""
    if key[: len(override)] == override:
        return True
    return len(key) > 1 and key[0] == "deepspeed" and override[: len(key)] == key


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> AnyRecipe:
    """Read (with the parents it ``extends``), override and validate a recipe; raise ``MtaError``
    naming the file, line and key on any problem."""
    path = Path(path)
    chain = recipe_chain(path)
    raw = apply_overrides(merged_recipe(chain), overrides)
    raw.setdefault("source", str(path))
    overridden = {item.partition("=")[0].strip(): item for item in overrides}
    schema = recipe_schema(raw)  # task: embedding -> EmbeddingRecipe
    try:
        _TaskOnly.model_validate(raw)
        return schema.model_validate(raw)
    except ValidationError as error:
        locations = key_locations(chain, _key_lines)
        raise MtaError(_format_validation_error(str(path), error, "", overridden, raw, locations,
                                                schema=schema)) from error


def recipe_to_yaml(recipe: AnyRecipe) -> str:
    """The fully resolved recipe (defaults filled in), as saved beside every checkpoint."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
