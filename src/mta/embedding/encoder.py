"""A sentence encoder: an ``AutoModel`` encoder, its tokenizer and how its states become one vector.

Pooling modes (:func:`pool`, ``hidden [B, T, D]``, ``mask [B, T]`` 1 on real tokens):

- ``mean``: the mean of the real tokens' states (sentence-transformers' ``pooling_mode_mean_tokens``);
- ``cls``: the first token's state (BGE-M3, as TALAS's teacher code pools it);
- ``max``: the element-wise maximum over real tokens;
- ``last``: the last real token's state (Qwen3-Embedding's, with either padding side).
- ``cls_attention``: attention over the real tokens with the first (CLS) state as the query,
  ``softmax_t(h_0·h_t / sqrt(D)) · h_t`` (TALAS's student pooling, [A] ``trainer.get_embedding``;
  no parameters). A sentence-transformers directory names it with the module
  ``CLS_ATTENTION_MODULE``, whose code file ``mta.embedding.export`` writes beside the model.

``auto`` (the default of every caller) reads a sentence-transformers directory's own pipeline:
``modules.json`` naming ``Transformer -> Pooling [-> Normalize]``, ``1_Pooling/config.json``'s
mode, the Normalize module, and ``sentence_bert_config.json``'s ``max_seq_length``. A directory
without ``modules.json`` (a plain Hugging Face encoder, a hub name) pools with ``mean`` and does
not normalise. A pipeline with other modules (``Dense``, ``LayerNorm``, ...) or another pooling
mode (weighted mean, sqrt-length mean) is refused naming the module: its vectors would not be the
model's. An explicit mode overrides the configured one (normalisation still follows the config
unless ``normalize`` is given).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from mta.errors import MtaError

POOLINGS = ("mean", "cls", "max", "last", "cls_attention")
AUTO = "auto"
DEFAULT_MAX_LENGTH = 256  # TALAS's teacher and student length ([A] prepare_embedding.py, train_asam.py)

# sentence-transformers Pooling config keys -> mta's modes (the ones that give the same vector).
_ST_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "last",
}
_ST_UNSUPPORTED = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# TALAS students exported by mta (mta.embedding.export): the CLS-query attention pooling, a
# code file in the model directory (SentenceTransformer(dir, trust_remote_code=True) loads it).
CLS_ATTENTION_MODULE = "cls_attention_pooling.CLSAttentionPooling"


# What an encoder may be, for the errors that cannot load one.
ENCODER_SOURCES = ("give a local Hugging Face or sentence-transformers directory, or a hub name in the "
                   "Hugging Face cache")

def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """``[B, T, D]`` states, ``[B, T]`` mask (1 = token, 0 = padding) -> ``[B, D]`` in ``hidden``'s
    dtype. A row with no real token pools to zeros (mean) or its first position (cls, last)."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "cls_attention":
        return cls_attention_pool(hidden, mask)
    weights = mask.to(hidden.dtype).unsqueeze(-1)  # [B, T, 1]
    if mode == "mean":
        summed = (hidden * weights).sum(dim=1, dtype=torch.float32)
        return (summed / weights.sum(dim=1, dtype=torch.float32).clamp(min=1.0)).to(hidden.dtype)
    if mode == "max":
        floor = torch.finfo(hidden.dtype).min
        return hidden.masked_fill(weights == 0, floor).amax(dim=1)
    if mode == "last":
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last = torch.where(mask.bool(), positions, torch.zeros_like(positions)).amax(dim=1)  # [B]
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise MtaError(f"pooling '{mode}': choose one of {', '.join(POOLINGS)} (or {AUTO})")


def cls_attention_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T, D]`` states, ``[B, T]`` mask -> ``[B, D]``: each row's states weighted by the softmax
    over its real tokens (CLS included) of ``h_0 · h_t / sqrt(D)``, the first state as the query.

    Scores and softmax in float32, the weighted sum in ``hidden``'s dtype. Self-contained (torch
    only): ``mta.embedding.export`` copies this function's source into exported models.
    """
    scores = torch.einsum("bd,btd->bt", hidden[:, 0], hidden).float() / hidden.shape[-1] ** 0.5
    scores = scores.masked_fill(mask == 0, torch.finfo(torch.float32).min)
    weights = scores.softmax(dim=-1).to(hidden.dtype)
    return torch.einsum("bt,btd->bd", weights, hidden)


@dataclass(frozen=True)
class PoolingConfig:
    """How an encoder's last hidden states become its sentence embedding.

    ``source``: ``sentence-transformers`` (read from the directory's modules) or ``default`` /
    ``option`` (mean for a plain encoder, or the mode a caller named). ``max_seq_length``: the
    directory's ``sentence_bert_config.json`` limit, None when it has none."""

    mode: str
    normalize: bool
    source: str
    max_seq_length: Optional[int] = None

    def record(self) -> dict:
        return {"mode": self.mode, "normalize": self.normalize, "source": self.source}


def read_sentence_transformers_config(directory: str | Path) -> Optional[PoolingConfig]:
    """The pooling of a sentence-transformers directory (``modules.json``), None for a plain
    Hugging Face directory or a hub name; ``MtaError`` naming the module it cannot reproduce."""
    directory = Path(directory)
    modules_path = directory / "modules.json"
    if not modules_path.is_file():
        return None
    modules = _json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise MtaError(f"{modules_path}: expected a list of module objects; the directory is not a sentence-transformers model")
    kinds = [str(m.get("type", "")) for m in modules]
    normalize = False
    mode = None
    for module, kind in zip(modules, kinds):
        if kind == _ST_TRANSFORMER:
            if module.get("path", "") not in ("", "."):
                raise MtaError(
                    f"{modules_path}: the Transformer module lives in '{module.get('path')}'; mta loads the "
                    "encoder from the directory itself. Give that subdirectory, or re-save the model"
                )
        elif kind == _ST_POOLING:
            config_path = directory / str(module.get("path", "1_Pooling")) / "config.json"
            config = _json(config_path) if config_path.is_file() else {}
            for key in _ST_UNSUPPORTED:
                if config.get(key):
                    raise MtaError(f"{config_path}: {key} is not supported; choose --pooling {'/'.join(POOLINGS)}")
            modes = [name for key, name in _ST_MODES.items() if config.get(key)]
            if len(modes) != 1:
                raise MtaError(
                    f"{config_path}: expected exactly one pooling mode of {', '.join(_ST_MODES)}, found "
                    f"{modes or 'none'}; pass --pooling {'/'.join(POOLINGS)} explicitly"
                )
            mode = modes[0]
        elif kind == CLS_ATTENTION_MODULE:
            mode = "cls_attention"
        elif kind == _ST_NORMALIZE:
            normalize = True
        else:
            raise MtaError(
                f"{modules_path}: module {kind or module!r} is not supported (mta reproduces Transformer -> "
                "Pooling -> Normalize); its vectors would differ from the model's own"
            )
    if mode is None:
        raise MtaError(f"{modules_path}: the pipeline has no Pooling module; pass --pooling {'/'.join(POOLINGS)}")
    limit = None
    bert_config = directory / "sentence_bert_config.json"
    if bert_config.is_file():
        value = _json(bert_config).get("max_seq_length")
        limit = value if type(value) is int and value > 0 else None
    return PoolingConfig(mode=mode, normalize=normalize, source="sentence-transformers", max_seq_length=limit)


def resolve_pooling(model: str | Path, pooling: str = AUTO, normalize: Optional[bool] = None) -> PoolingConfig:
    """The pooling to use for ``model``: its sentence-transformers config under ``auto`` (mean
    for a plain encoder), else the named mode; ``normalize`` None follows the config."""
    configured = read_sentence_transformers_config(model) if Path(model).expanduser().is_dir() else None
    if pooling == AUTO:
        base = configured or PoolingConfig(mode="mean", normalize=False, source="default")
    elif pooling in POOLINGS:
        base = PoolingConfig(
            mode=pooling, normalize=configured.normalize if configured else False, source="option",
            max_seq_length=configured.max_seq_length if configured else None,
        )
    else:
        raise MtaError(f"pooling '{pooling}': choose one of {AUTO}, {', '.join(POOLINGS)}")
    if normalize is not None and normalize != base.normalize:
        base = PoolingConfig(base.mode, normalize, "option" if base.source == "default" else base.source, base.max_seq_length)
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
                list(texts[start:start + 8192]), truncation=True, max_length=self.max_length, return_length=True
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
        out = [self.embed_batch(self.tokenize(texts[i:i + batch_size])) for i in range(0, len(texts), batch_size)]
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
    name_or_path: str | Path, *, pooling: str = AUTO, normalize: Optional[bool] = None, max_length: Optional[int] = None
) -> EncoderPlan:
    """The config, pooling and length of an encoder (``max_length`` None: the directory's
    ``max_seq_length``, else :data:`DEFAULT_MAX_LENGTH`; never above the model's positions)."""
    from transformers import AutoConfig

    from mta.models.hub import load_pretrained

    settings = resolve_pooling(name_or_path, pooling, normalize)
    config = load_pretrained(
        AutoConfig.from_pretrained, name_or_path, what="encoder",
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
    normalize: Optional[bool] = None,
    max_length: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    plan: Optional[EncoderPlan] = None,
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
        AutoModel.from_pretrained, name_or_path, what="encoder", dtype=dtype,
        otherwise=f"cannot load an encoder from '{name_or_path}' with AutoModel ({ENCODER_SOURCES})",
    )
    device = torch.device(device)
    model.to(device).eval()
    return SentenceEncoder(model, tokenizer, plan.pooling, plan.max_length, device)


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise MtaError(f"cannot read {path}: {error}") from error
