"""Recipes: one YAML file names everything a distillation run needs, validated against code.

Unknown keys are errors, every error names the file, the key and what is allowed, and
``key=value`` overrides from the command line are applied before validation so they are
checked exactly like the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mta.errors import MtaError

BaseLossName = Literal["ce", "fkl", "rkl", "skl", "srkl", "jsd", "tvd"]
Precision = Literal["fp32", "bf16", "fp16"]
Granularity = Literal["word", "phrase"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyModel(Strict):
    """Build a random model from this description at first use (CPU runs and tests)."""

    model_type: Literal["llama", "gpt2", "qwen2"] = "llama"
    num_layers: int = Field(4, ge=1)
    hidden_size: int = Field(32, ge=4)
    num_heads: int = Field(4, ge=1)
    tokenizer_corpus: str = Field(description="JSONL whose text trains the byte-level BPE")
    vocab_size: int = Field(512, ge=300)
    seed: int = 0


class ModelSpec(Strict):
    path: str = Field(description="hub name or local directory of a Hugging Face causal LM")
    tokenizer: Optional[str] = Field(None, description="tokenizer name or directory; default: path")
    dtype: Precision = "fp32"
    config: Optional[str] = Field(
        None, description="architecture config JSON (relative to the recipe) for offline --dry-run"
    )
    tiny: Optional[TinyModel] = None

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path


class DataSpec(Strict):
    train: str = Field(description="annotate output directory, or a JSONL annotated on first use")
    dev: Optional[str] = None
    max_length: int = Field(256, ge=8)
    max_prompt_length: int = Field(128, ge=1)
    word_spans: Literal["phrase", "all"] = "phrase"
    spacy_model: str = "en_core_web_sm"
    truncate_prompt: bool = False

    @model_validator(mode="after")
    def _prompt_fits(self) -> "DataSpec":
        if self.max_prompt_length >= self.max_length:
            raise ValueError("max_prompt_length must be smaller than max_length")
        return self


class LayerPair(Strict):
    student: int = Field(ge=0)
    teacher: int = Field(ge=0)
    granularity: Granularity


class LossSpec(Strict):
    base: BaseLossName = "srkl"
    base_weight: float = Field(1.0, ge=0)
    temperature: float = Field(1.0, gt=0)
    skew_alpha: float = Field(0.1, ge=0, le=1)
    jsd_beta: float = Field(0.5, gt=0, lt=1)
    dsa_weight: float = Field(2.0, ge=0)
    hra_weight: float = Field(0.2, ge=0)
    layers: Union[Literal["auto"], list[LayerPair]] = "auto"
    importance: Literal["attention", "uniform"] = "attention"
    chunk_size: int = Field(128, ge=1, description="sequence positions per logit-loss chunk")

    @model_validator(mode="before")
    @classmethod
    def _layers_from_triples(cls, values: Any) -> Any:
        # YAML is friendlier as [student, teacher, granularity] triples.
        layers = values.get("layers") if isinstance(values, dict) else None
        if isinstance(layers, list):
            values = dict(values)
            values["layers"] = [
                dict(zip(("student", "teacher", "granularity"), item))
                if isinstance(item, (list, tuple))
                else item
                for item in layers
            ]
        return values


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
    precision: Precision = "fp32"
    zero_stage: Literal[0, 1, 2, 3] = 1
    teacher_zero3: bool = Field(False, description="partition the teacher with ZeRO-3 too")
    log_interval: int = Field(10, ge=1)
    eval_interval: int = Field(100, ge=1)
    save_interval: int = Field(500, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    num_sample_generations: int = Field(2, ge=0, le=8)
    sample_max_new_tokens: int = Field(48, ge=1)

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

    def accumulation_steps(self, world_size: int) -> int:
        """Accumulation that keeps the global batch what the recipe says at this world size."""
        per_step = self.micro_batch_size * world_size
        if self.batch_size % per_step:
            raise MtaError(
                f"train.batch_size={self.batch_size} cannot be split into micro batches of "
                f"{self.micro_batch_size} on {world_size} processes; choose a micro_batch_size "
                f"that divides {self.batch_size // world_size if self.batch_size >= world_size else 1}"
            )
        return self.batch_size // per_step


class Recipe(Strict):
    name: str
    seed: int = 42
    output_dir: str
    teacher: Optional[ModelSpec] = Field(None, description="null: plain SFT, no teacher loaded")
    student: ModelSpec
    data: DataSpec
    loss: LossSpec = LossSpec()
    train: TrainSpec
    deepspeed: dict[str, Any] = Field(default_factory=dict, description="passed through verbatim")
    source: Optional[str] = Field(None, description="the file this recipe was read from")

    @model_validator(mode="after")
    def _teacher_needed(self) -> "Recipe":
        if self.teacher is None and self.loss.base != "ce":
            raise ValueError(f"loss.base={self.loss.base} needs a teacher; use 'ce' for SFT")
        if self.teacher is None and (self.loss.dsa_weight or self.loss.hra_weight):
            raise ValueError("dsa_weight and hra_weight must be 0 without a teacher")
        return self

    def resolve(self, relative: str) -> Path:
        """A path written in the recipe, taken relative to the recipe file when not absolute."""
        path = Path(relative).expanduser()
        if path.is_absolute() or self.source is None or path.exists():
            return path
        beside = Path(self.source).parent / path
        return beside if beside.exists() else path


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings to a nested dict; values are parsed as YAML scalars."""
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise MtaError(f"override '{override}' is not of the form key.path=value")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise MtaError(f"override '{override}': '{part}' is not a mapping")
            node = child
        node[leaf] = yaml.safe_load(text)
    return raw


def _format_validation_error(source: str, error: ValidationError) -> str:
    lines = [f"{source}: invalid recipe"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key (check its spelling and the section it is in)"
        lines.append(f"  {key}: {message}")
    return "\n".join(lines)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override and validate a recipe; raise ``MtaError`` naming the key on any problem."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise MtaError(f"recipe file not found: {path}") from error
    except yaml.YAMLError as error:
        raise MtaError(f"{path}: not valid YAML: {error}") from error
    if not isinstance(raw, dict):
        raise MtaError(f"{path}: a recipe is a YAML mapping, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides)
    raw.setdefault("source", str(path))
    try:
        return Recipe.model_validate(raw)
    except ValidationError as error:
        raise MtaError(_format_validation_error(str(path), error)) from error


def recipe_to_yaml(recipe: Recipe) -> str:
    """The fully resolved recipe (defaults filled in), as saved beside every checkpoint."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
