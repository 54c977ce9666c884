"""Recipes: one YAML file names everything a distillation run needs, validated against code.

Unknown keys are errors, every error names the file, the line, the key and what is allowed, and
``key=value`` overrides from the command line are applied before validation so they are
checked exactly like the file.

Paths in a recipe (data, configs, tokenizers, models, output) are resolved when used, by
``Recipe.resolve``: ``~`` and ``$VAR`` / ``${VAR}`` are expanded from the environment (an unset
variable is an error that names it, never a silently literal ``$VAR`` directory); an absolute
path, or a relative one that exists from the working directory, is taken as written; otherwise
a relative path that exists beside the recipe file is taken from there (so ``configs/gpt2.json``
in the shipped ``gpt2.yaml`` means ``src/mta/recipes/configs/gpt2.json``); anything else, such as
an output directory still to be created or a hub name like ``gpt2``, stays relative to the working
directory (also for a shipped recipe: its runs never land inside the installed package).
"""

from __future__ import annotations

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
    model_validator,
)

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
    chunk_size: int = Field(128, ge=1, description="sequence positions per logit-loss chunk")

    @property
    def alignment_terms(self) -> tuple[str, ...]:
        """The MTA terms with a non-zero weight, of ``("dsa", "hra")``: the one place that decides
        whether MTA is on. An empty tuple means no layer is aligned and no projector is built."""
        return tuple(term for term in ("dsa", "hra") if getattr(self, f"{term}_weight"))


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
            if self.batch_size % world_size:
                fix = f"use a train.batch_size that is a multiple of {world_size}"
            else:
                fix = f"set train.micro_batch_size to a divisor of {self.batch_size // world_size}"
            raise MtaError(
                f"train.batch_size={self.batch_size} cannot be split into micro batches of "
                f"{self.micro_batch_size} on {world_size} processes; {fix}"
            )
        return self.batch_size // per_step


# DeepSpeed keys the schema sets itself, with the recipe key to use instead: a passthrough value
# would silently disagree with the printed global batch, precision or ZeRO stage.
DEEPSPEED_KEYS_OWNED_BY_RECIPE = {
    "train_batch_size": "train.batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.batch_size and train.micro_batch_size",
    "gradient_clipping": "train.grad_clip",
    "bf16": "train.precision",
    "fp16": "train.precision",
    "optimizer": "train.optimizer, train.lr, train.betas and train.weight_decay",
    "scheduler": "train.schedule and train.warmup_steps",
    "zero_optimization.stage": "train.zero_stage",
}

_ENV_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def unset_variables(written: str) -> list[str]:
    """The environment variables a recipe path names (``$VAR``, ``${VAR}``) that are not set."""
    named = {name for groups in _ENV_VAR.findall(written) for name in groups if name}
    return sorted(named - set(os.environ))


class Recipe(Strict):
    name: str
    seed: int = 42
    output_dir: str
    teacher: Optional[ModelSpec] = Field(None, description="null: plain SFT, no teacher loaded")
    student: ModelSpec
    data: DataSpec
    loss: LossSpec = LossSpec()
    train: TrainSpec
    deepspeed: dict[str, Any] = Field(
        default_factory=dict,
        description="DeepSpeed settings the schema does not model, merged in verbatim",
    )
    source: Optional[str] = Field(None, description="the file this recipe was read from")

    @model_validator(mode="after")
    def _teacher_needed(self) -> "Recipe":
        if self.teacher is None and self.loss.base != "ce":
            raise ValueError(f"loss.base={self.loss.base} needs a teacher; use 'ce' for SFT")
        if self.teacher is None and self.loss.alignment_terms:
            raise ValueError("dsa_weight and hra_weight must be 0 without a teacher")
        if not self.loss.base_weight and not self.loss.alignment_terms:
            raise ValueError("loss.base_weight, loss.dsa_weight and loss.hra_weight are all 0: nothing to train")
        return self

    @model_validator(mode="after")
    def _student_dtype_fits_the_precision(self) -> "Recipe":
        # DeepSpeed casts an fp32 student to the training precision and keeps fp32 master
        # weights; a 16-bit student trained in another precision would lose them silently.
        dtype, precision = self.student.dtype, self.train.precision
        if dtype not in ("fp32", precision):
            raise ValueError(
                f"student.dtype={dtype} cannot train with train.precision={precision}; "
                f"use student.dtype=fp32 or {precision}, or train.precision={dtype}"
            )
        return self

    @model_validator(mode="after")
    def _deepspeed_does_not_shadow_the_schema(self) -> "Recipe":
        for key, recipe_key in DEEPSPEED_KEYS_OWNED_BY_RECIPE.items():
            section, _, leaf = key.rpartition(".")
            node = self.deepspeed.get(section, {}) if section else self.deepspeed
            if isinstance(node, dict) and leaf in node:
                raise ValueError(
                    f"deepspeed.{key} is set by the recipe from {recipe_key}; "
                    f"set it there and remove it from the deepspeed: mapping"
                )
        return self

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
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise MtaError(
                f"override {override!r}: the value is not valid YAML: {error}"
            ) from error
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


def _section_model(path: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The schema class that a (pydantic) error location points into, for listing its keys."""
    model: type[BaseModel] = Recipe
    for part in path:
        if isinstance(part, int) or part not in model.model_fields:
            continue
        nested = _models_in(model.model_fields[part].annotation)
        if not nested:
            return None
        model = nested[0]
    return model


def _field_description(path: tuple[str | int, ...]) -> str | None:
    model = _section_model(path[:-1]) if path else None
    field = model.model_fields.get(str(path[-1])) if model else None
    return field.description if field else None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models_in(arg)]


def _key_lines(text: str) -> dict[tuple[str | int, ...], int]:
    """1-based line of every key and list item of a YAML document, by its key path."""
    lines: dict[tuple[str | int, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[str | int, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                child = path + (key_node.value,)
                lines[child] = key_node.start_mark.line + 1
                walk(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                lines[path + (index,)] = item.start_mark.line + 1
                walk(item, path + (index,))

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, ())
    return lines


def _describe(item: dict[str, Any], path: tuple[str | int, ...]) -> str:
    kind, given = item["type"], item.get("input")
    if kind == "extra_forbidden":
        model = _section_model(path[:-1])
        allowed = f"; allowed here: {', '.join(model.model_fields)}" if model else ""
        return f"unknown key (check its spelling and the section it is in){allowed}"
    if kind == "literal_error":
        hint = _field_description(path)
        return f"{given!r} is not allowed; use one of {item['ctx']['expected']}" + (
            f" ({hint})" if hint else ""
        )
    if kind == "missing":
        return "required key is missing"
    message = item["msg"].removeprefix("Value error, ")
    if kind.endswith(("_type", "_parsing")) or kind.startswith(("greater", "less")):
        message += f" (got {given!r})"
    return message


def _format_validation_error(
    source: str, error: ValidationError, text: str = "", overridden: dict[str, str] | None = None
) -> str:
    lines_by_key = _key_lines(text)
    overridden = overridden or {}
    lines = [f"{source}: invalid recipe"]
    for item in error.errors():
        # Drop union-branch tags such as "list[LayerPair]" that are not keys of the file.
        path = tuple(
            part for part in item["loc"] if isinstance(part, int) or str(part).isidentifier()
        )
        key = ".".join(str(part) for part in path)
        origin = next(
            (f" (from override {override!r})" for name, override in overridden.items()
             if key == name or key.startswith(name + ".")),
            "",
        )
        line = next(
            (lines_by_key[path[:depth]] for depth in range(len(path), 0, -1)
             if path[:depth] in lines_by_key),
            None,
        )
        where = f"line {line}: " if line and not origin else ""
        # Whole-recipe checks (loc empty) name their keys in the message itself.
        named = f"{key}: " if key else ""
        lines.append(f"  {where}{named}{_describe(item, path)}{origin}")
    return "\n".join(lines)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override and validate a recipe; raise ``MtaError`` naming the key on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as error:
        raise MtaError(f"recipe file not found: {path}") from error
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise MtaError(f"{path}: not valid YAML: {error}") from error
    if not isinstance(raw, dict):
        raise MtaError(f"{path}: a recipe is a YAML mapping, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides)
    raw.setdefault("source", str(path))
    overridden = {item.partition("=")[0].strip(): item for item in overrides}
    try:
        return Recipe.model_validate(raw)
    except ValidationError as error:
        raise MtaError(_format_validation_error(str(path), error, text, overridden)) from error


def recipe_to_yaml(recipe: Recipe) -> str:
    """The fully resolved recipe (defaults filled in), as saved beside every checkpoint."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
