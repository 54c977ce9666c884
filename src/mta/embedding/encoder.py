"""A sentence encoder: an ``AutoModel`` encoder, its tokenizer and how its states become one vector.

The pooling modes and their maths are :mod:`mta.embedding.pooling`'s. ``auto`` (the default of
every caller) reads a sentence-transformers directory's own pipeline
(:func:`mta.embedding.export.read_sentence_transformers_config`: ``modules.json`` naming
``Transformer -> Pooling [-> Normalize]``, ``1_Pooling/config.json``'s mode, the Normalize module,
and ``sentence_bert_config.json``'s ``max_seq_length``). A directory without ``modules.json`` (a
plain Hugging Face encoder, a hub name) pools with ``mean`` and does not normalise. A pipeline
with other modules (``Dense``, ``LayerNorm``, ...) or another pooling mode (weighted mean,
sqrt-length mean) is refused naming the module: its vectors would not be the model's. An explicit
mode overrides the configured one (normalisation still follows the config unless ``normalize`` is
given).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mta.embedding.export import read_sentence_transformers_config
from mta.embedding.pooling import AUTO, POOLINGS, PoolingConfig, pool
from mta.errors import MtaError

DEFAULT_MAX_LENGTH = 256  # TALAS's teacher and student length ([A] prepare_embedding.py, train_asam.py)

# What an encoder may be, for the errors that cannot load one.
ENCODER_SOURCES = (
    "give a local Hugging Face or sentence-transformers directory, or a hub name in the Hugging Face cache"
)


def resolve_pooling(model: str | Path, pooling: str = AUTO, normalize: bool | None = None) -> PoolingConfig:
    """The pooling to use for ``model``: its sentence-transformers config under ``auto`` (mean
    for a plain encoder), else the named mode; ``normalize`` None follows the config."""
    configured = read_sentence_transformers_config(model) if Path(model).expanduser().is_dir() else None
    if pooling == AUTO:
        base = configured or PoolingConfig(mode="mean", normalize=False, source="default")
    elif pooling in POOLINGS:
        base = PoolingConfig(
            mode=pooling,
            normalize=configured.normalize if configured else False,
            source="option",
            max_seq_length=configured.max_seq_length if configured else None,
        )
    else:
        raise MtaError(f"pooling '{pooling}': choose one of {AUTO}, {', '.join(POOLINGS)}")
    if normalize is not None and normalize != base.normalize:
        base = PoolingConfig(
            base.mode, normalize, "option" if base.source == "default" else base.source, base.max_seq_length
        )
    return base


class SentenceEncoder:
    """An encoder in eval mode on ``device`` with its tokenizer and pooling: ``encode(texts)``.

    ``max_length`` tokens per text, special tokens included (longer texts are cut, as
    sentence-transformers cuts them). Embeddings come back as float32 on the CPU.
    """

    def __init__(self, model, tokenizer, pooling: PoolingConfig, max_length: int, device: torch.device):
        self.model = model
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.max_length = max_length
        self.device = device

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """The padded batch ``model(**batch)`` takes (``return_tensors="pt"``, on the device)."""
        batch = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        return {key: value.to(self.device) for key, value in batch.items()}

    def lengths(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text after truncation (what decides the padded length of a batch)."""
        lengths: list[int] = []
        for start in range(0, len(texts), 8192):  # blocks: only the lengths are kept
            encoded = self.tokenizer(
                list(texts[start : start + 8192]), truncation=True, max_length=self.max_length, return_length=True
            )
            lengths.extend(encoded["length"])
        return lengths

    def untruncated_lengths(self, texts: Sequence[str]) -> list[int]:
        encoded = self.tokenizer(list(texts), truncation=False, return_length=True, verbose=False)
        return list(encoded["length"])

    @torch.inference_mode()
    def embed_batch(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[B, D]`` float32 sentence embeddings of one tokenised batch."""
        hidden = self.model(**batch).last_hidden_state
        pooled = pool(hidden, batch["attention_mask"], self.pooling.mode).float()
        if self.pooling.normalize:
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled.cpu()

    def encode(self, texts: Sequence[str], batch_size: int = 32) -> torch.Tensor:
        """``[len(texts), D]`` float32 embeddings, in the order given (batches as they come)."""
        out = [self.embed_batch(self.tokenize(texts[i : i + batch_size])) for i in range(0, len(texts), batch_size)]
        return torch.cat(out) if out else torch.empty(0, self.dimension)

    @property
    def dimension(self) -> int:
        return int(self.model.config.hidden_size)


@dataclass(frozen=True)
class EncoderPlan:
    """What an encoder will be run with, known before its weights load: ``config`` (its
    ``AutoConfig``), ``pooling`` and ``max_length`` (tokens per text, special ones included)."""

    name: str
    config: object
    pooling: PoolingConfig
    max_length: int

    @property
    def dimension(self) -> int:
        return int(self.config.hidden_size)


def plan_encoder(
    name_or_path: str | Path, *, pooling: str = AUTO, normalize: bool | None = None, max_length: int | None = None
) -> EncoderPlan:
    """The config, pooling and length of an encoder (``max_length`` None: the directory's
    ``max_seq_length``, else :data:`DEFAULT_MAX_LENGTH`; never above the model's positions)."""
    from transformers import AutoConfig

    from mta.models.hub import load_pretrained

    settings = resolve_pooling(name_or_path, pooling, normalize)
    config = load_pretrained(
        AutoConfig.from_pretrained,
        name_or_path,
        what="encoder",
        otherwise=f"cannot read an encoder config from '{name_or_path}' ({ENCODER_SOURCES})",
    )
    limit = max_length or settings.max_seq_length or DEFAULT_MAX_LENGTH
    positions = getattr(config, "max_position_embeddings", None)
    if positions:
        # RoBERTa-style models (mpnet) number positions from padding_idx + 1.
        offset = 2 if getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "mpnet") else 0
        limit = min(limit, positions - offset)
    return EncoderPlan(str(name_or_path), config, settings, int(limit))


def load_encoder(
    name_or_path: str | Path,
    *,
    pooling: str = AUTO,
    normalize: bool | None = None,
    max_length: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    plan: EncoderPlan | None = None,
) -> SentenceEncoder:
    """Load an encoder with ``AutoModel`` (a local directory, or a hub name through
    :mod:`mta.models.hub`) and its fast tokenizer, in eval mode on ``device``; pooling and
    length as :func:`plan_encoder` decides them (or as ``plan`` already did)."""
    from transformers import AutoModel

    from mta.models.hub import load_pretrained
    from mta.models.tokenizers import load_tokenizer

    plan = plan or plan_encoder(name_or_path, pooling=pooling, normalize=normalize, max_length=max_length)
    tokenizer = load_tokenizer(name_or_path)
    model = load_pretrained(
        AutoModel.from_pretrained,
        name_or_path,
        what="encoder",
        dtype=dtype,
        otherwise=f"cannot load an encoder from '{name_or_path}' with AutoModel ({ENCODER_SOURCES})",
    )
    device = torch.device(device)
    model.to(device).eval()
    return SentenceEncoder(model, tokenizer, plan.pooling, plan.max_length, device)
