"""The embedding recipe (``task: embedding``, TALAS): ``EmbeddingRecipe`` and its sections.

It shares the LLM recipe's ``train:`` section (``TrainSpec``) and checks (``RecipeChecks``,
``mta.training.config.schema``); ``load_recipe`` reads a ``task: embedding`` file with it through
the task registry (``mta.embedding.task``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from mta.training.config.schema import Precision, RecipeChecks, Strict, TrainSpec

# Keys of the shared train: section that only LLM distillation reads (an embedding recipe that
# sets one to anything but its default is refused; the defaults stay in its resolved recipe, unread).
LLM_ONLY_TRAIN_KEYS = (
    "select_by",  # an embedding run keeps no best/
    "teacher_zero3",
    "num_sample_generations",
    "sample_max_new_tokens",
    "save_generated",
    "select_rows",
    "loss_reduction",  # TALAS's in-batch contrastive terms are per micro batch
)


class TinyEncoder(Strict):
    """Build a random BERT encoder (``mta.embedding.tiny_encoders``) and a WordPiece tokenizer trained
    on ``tokenizer_corpus`` at first use (CPU runs and tests)."""

    model_type: Literal["bert"] = Field("bert", description="the random encoder's architecture")
    num_layers: int = Field(4, ge=1, description="transformer blocks")
    hidden_size: int = Field(32, ge=4, description="the hidden states' width")
    num_heads: int = Field(4, ge=1, description="attention heads per block")
    tokenizer_corpus: str = Field(description="JSONL whose text trains the WordPiece tokenizer")
    vocab_size: int = Field(512, ge=100, description="the WordPiece vocabulary size")
    seed: int = Field(0, description="seed of the random weights")


class EncoderSpec(Strict):
    path: str = Field(
        description="hub name or local directory of a Hugging Face encoder (AutoModel) or a sentence-transformers model"
    )
    tokenizer: str | None = Field(None, description="tokenizer name or directory; default: path")
    dtype: Precision = Field(
        "fp32", description="the dtype the weights load in; a student's is fp32 or train.precision's"
    )
    config: str | None = Field(
        None, description="architecture config JSON (relative to the recipe) for offline --dry-run"
    )
    tiny: TinyEncoder | None = Field(
        None,
        description="build a random encoder of this shape at first use, under output_dir/models/ (CPU runs "
        "and tests); null: load path",
    )

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path


class StudentEncoderSpec(EncoderSpec):
    pooling: Literal["cls_attention", "mean", "cls"] = Field(
        "cls_attention",
        description="how each layer's states become its sentence embedding, and the "
        "exported model's pooling: cls_attention (TALAS's author: attention with the CLS state as the "
        "query), mean or cls (mta.embedding.pooling.pool)",
    )


class TeacherEncoderSpec(EncoderSpec):
    pooling: Literal["auto", "mean", "cls", "max", "last", "cls_attention"] = Field(
        "auto",
        description="the teacher's pooling when its embeddings are built at first use: auto "
        "(its sentence-transformers config, else mean), or a mode (TALAS's author: cls for BGE-M3, "
        "last for Qwen3-Embedding)",
    )


class EmbeddingDataSpec(Strict):
    train: str = Field(
        description="an `mta embed` output directory (the teacher's embeddings), or rows embedded with "
        "the recipe's teacher at first use into OUT/embeddings/train: a JSONL, Parquet or CSV file or "
        "a datasets save_to_disk directory"
    )
    dev: str | None = Field(None, description="the same for the dev loss; null: no dev evaluation")
    max_length: int = Field(
        256,
        ge=2,
        description="tokens per text, special tokens included: the "
        "student's, and the teacher's when it embeds at first use (TALAS's author: 256)",
    )
    text_field: str | None = Field(
        None,
        description="the column holding each row's text; null: text, else instruction + input + "
        "response, else prompt + response (mta.embedding.embed)",
    )


class EmbeddingLossSpec(Strict):
    """λ1·SimCSE + λ2·TAMD + λ3·LASD (mta.losses.talas; TALAS's defaults: 0.001 / 0.75 / 1)."""

    simcse_weight: float = Field(
        0.001, ge=0, description="λ1: SimCSE, the batch encoded twice with dropout, InfoNCE on the last layer"
    )
    tamd_weight: float = Field(
        0.75, ge=0, description="λ2: TAMD, 1 − cos(W_l e_l, e_teacher) on the top tamd_layers layers"
    )
    lasd_weight: float = Field(
        1.0, ge=0, description="λ3: LASD, each layer's in-batch cosine matrix pulled towards the layer above's"
    )
    tamd_layers: int = Field(2, ge=1, description="K: the top student layers anchored to the teacher (TALAS: 2)")
    lasd_detach: bool = Field(
        False, description="detach the upper layer's matrix (the guide); the author's code does not"
    )
    lasd_reduction: Literal["mean", "sum"] = Field(
        "mean",
        description="per layer pair: the mean over the B² entries (the author's F.mse_loss) or "
        "their sum (eq. 5's squared Frobenius norm, B² times larger)",
    )
    simcse_temperature: float = Field(0.1, gt=0, description="τ of SimCSE (the author's script: 0.1)")
    reference_code: bool = Field(
        False,
        description="train as the author's code where mta differs on purpose (docs/method.md §9): the TAMD "
        "projections drawn as his build_projection_layer (one per layer, the top tamd_layers kept); the "
        "gradient clipped to train.grad_clip on the student's parameters alone, the projections' unclipped, "
        "before each of ASAM's two passes (one process only); the terms under the training autocast",
    )

    @model_validator(mode="after")
    def _something_to_train(self) -> EmbeddingLossSpec:
        if not (self.simcse_weight or self.tamd_weight or self.lasd_weight):
            raise ValueError("simcse_weight, tamd_weight and lasd_weight are all 0: nothing to train")
        return self


class EmbeddingRecipe(RecipeChecks):
    """A sentence-embedding distillation (``task: embedding``, TALAS): an encoder student learns
    a teacher's stored sentence embeddings (``mta embed``; built at first use from ``teacher``
    when ``data`` names rows). The teacher model itself is never loaded for training."""

    # The shared train: keys this task does not read (refused unless at their defaults).
    UNREAD_TRAIN_KEYS: ClassVar[tuple[str, ...]] = LLM_ONLY_TRAIN_KEYS

    name: str = Field(description="the run's name: a label in run.json, the model card and the trackers")
    seed: int = Field(42, description="seeds the data order, dropout, the projections' initialisation")
    output_dir: str = Field(
        description="the run's directory: checkpoints/, final/, metrics.jsonl, and its caches (embeddings/)"
    )
    task: Literal["embedding"] = Field(description="embedding: a sentence-embedding encoder (TALAS; this schema)")
    teacher: TeacherEncoderSpec | None = Field(
        None,
        description="the embedding teacher, loaded only to embed data rows at first use; null: "
        "data names `mta embed` directories",
    )
    student: StudentEncoderSpec = Field(description="the encoder trained")
    data: EmbeddingDataSpec = Field(description="the texts trained and evaluated on, with the teacher's embeddings")
    loss: EmbeddingLossSpec = Field(EmbeddingLossSpec(), description="λ1·SimCSE + λ2·TAMD + λ3·LASD (mta.losses.talas)")
    train: TrainSpec = Field(description="optimizer, schedule, length, precision, ZeRO, intervals")
    deepspeed: dict[str, Any] = Field(
        default_factory=dict,
        description="DeepSpeed settings the schema does not model, merged in verbatim",
    )
    source: str | None = Field(None, description="the file this recipe was read from")

    @model_validator(mode="after")
    def _no_llm_train_keys(self) -> EmbeddingRecipe:
        fields = TrainSpec.model_fields
        named = [
            key
            for key in LLM_ONLY_TRAIN_KEYS
            if key in fields and getattr(self.train, key) != fields[key].get_default(call_default_factory=True)
        ]
        if named:
            raise PydanticCustomError(
                "task_setting",
                "{message}",
                {
                    "message": f"{named[0]} is a key of task: llm recipes (generation and the LLM teacher); "
                    "a task: embedding recipe does not read it: remove it",
                    "within": ("train", named[0]),
                },
            )
        return self

    @property
    def dev_sample_new_tokens(self) -> int:
        """No generation: an encoder has nothing to sample."""
        return 0
