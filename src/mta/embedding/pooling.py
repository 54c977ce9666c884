"""How an encoder's last hidden states become one sentence vector: the modes and their maths.

Pooling modes (:func:`pool`, ``hidden [B, T, D]``, ``mask [B, T]`` 1 on real tokens):

- ``mean``: the mean of the real tokens' states (sentence-transformers' ``pooling_mode_mean_tokens``);
- ``cls``: the first token's state (BGE-M3, as TALAS's teacher code pools it);
- ``max``: the element-wise maximum over real tokens;
- ``last``: the last real token's state (Qwen3-Embedding's, with either padding side).
- ``cls_attention``: attention over the real tokens with the first (CLS) state as the query,
  ``softmax_t(h_0·h_t / sqrt(D)) · h_t`` (TALAS's student pooling, [A] ``trainer.get_embedding``;
  no parameters). A sentence-transformers directory names it with the module
  ``CLS_ATTENTION_MODULE``, whose code file :mod:`mta.embedding.export` writes
  beside the model.

``auto`` (:data:`AUTO`) is not a mode: it asks for the directory's own configuration
(:func:`mta.embedding.encoder.resolve_pooling`). :class:`PoolingConfig` is what is resolved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mta.errors import MtaError

POOLINGS = ("mean", "cls", "max", "last", "cls_attention")
AUTO = "auto"


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """``[B, T, D]`` states, ``[B, T]`` mask (1 = token, 0 = padding) -> ``[B, D]`` in ``hidden``'s
    dtype (mean sums in float32 at least: float64 stays float64). A row with no real token pools to
    zeros (mean), its first position (cls, last) or the dtype's lowest value (max)."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "cls_attention":
        return cls_attention_pool(hidden, mask)
    weights = mask.to(hidden.dtype).unsqueeze(-1)  # [B, T, 1]
    if mode == "mean":
        wide = torch.promote_types(hidden.dtype, torch.float32)
        summed = (hidden * weights).sum(dim=1, dtype=wide)
        return (summed / weights.sum(dim=1, dtype=wide).clamp(min=1.0)).to(hidden.dtype)
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

    Scores and softmax in float32 at least (float64 stays float64), the weighted sum in
    ``hidden``'s dtype. Self-contained (torch only): ``mta.embedding.export`` copies this
    function's source into exported models.
    """
    wide = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
    scores = torch.einsum("bd,btd->bt", wide[:, 0], wide) / hidden.shape[-1] ** 0.5
    scores = scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min)
    weights = scores.softmax(dim=1).to(hidden.dtype)  # over t ([B, T] scores)
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
    max_seq_length: int | None = None

    def record(self) -> dict:
        return {"mode": self.mode, "normalize": self.normalize, "source": self.source}
