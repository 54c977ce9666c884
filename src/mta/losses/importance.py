"""Token importance: how much attention each token receives from the rest of its sequence.

docs/method.md §2. The attention is recomputed from one layer's hidden states, bidirectionally and
without any learned projection, because the model's own causal attention over-weights early
tokens. The weights are a constant of the loss (detached) and always computed in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

ImportanceMode = Literal["attention", "uniform"]

STD_EPS = 1e-5


@torch.no_grad()
def token_importance(
    hidden: torch.Tensor, attention_mask: torch.Tensor, *, padding_queries: bool = False
) -> torch.Tensor:
    """Mean bidirectional self-attention each real token receives.

    hidden: ``[batch, seq, dim]`` one layer's hidden states (any float dtype).
    attention_mask: ``[batch, seq]`` 1/True for real tokens, 0/False for padding.
    padding_queries: the authors' code (``loss.reference_code``, docs/method.md §8): every row of
    the padded batch asks, padding rows included with the states the model gave them (a
    non-finite value counts as 0), and the mean runs over all ``seq`` rows; padding is still
    never attended. Their ``compute_token_weights`` in ``span_utils.py``.
    Returns ``[batch, seq]`` fp32, detached: 0 on padding, summing to 1 over the real tokens of
    every sequence with at least one real token (a single real token gets weight 1).
    """
    hidden = hidden.float()
    real = attention_mask.bool()
    queries = real.float()  # [B, T]: 1 on the real tokens, which both ask and are attended
    dim = hidden.shape[-1]
    # Ĥ = H / std(H): H itself is not centred (docs/method.md §2). The unbiased std through a norm of
    # the centred values is several times faster on CPU than torch.std.
    centred_norm = torch.linalg.vector_norm(hidden - hidden.mean(dim=-1, keepdim=True), dim=-1, keepdim=True)
    normed = hidden / (centred_norm / math.sqrt(max(dim - 1, 1)) + STD_EPS)
    if padding_queries:  # padding rows ask; as keys they are masked below
        normed = torch.where(torch.isfinite(normed), normed, 0.0)
    else:  # Padding states may hold anything (even NaN after a fully masked attention row).
        normed = torch.where(real.unsqueeze(-1), normed, 0.0)
    # The 1/sqrt(d) goes on one [B, T, D] operand and the key mask is an in-place additive
    # bias: on CPU a broadcast masked_fill over [B, T, T] costs half as much as the matmul.
    scores = torch.bmm(normed / math.sqrt(dim), normed.transpose(1, 2))  # [B, query, key]
    key_bias = torch.zeros_like(queries).masked_fill_(~real, float("-inf"))
    scores.add_(key_bias.unsqueeze(1))  # padding keys
    scores.diagonal(dim1=1, dim2=2).fill_(float("-inf"))
    # Rows without any allowed key are NaN; they only occur in sequences with at most one
    # real token, whose weights are replaced below.
    attention = torch.softmax(scores, dim=-1)  # [B, query, key]
    num_real = queries.sum(dim=-1, keepdim=True)
    if padding_queries:  # every row has a real key once a sequence has two real tokens
        weights = attention.mean(dim=1)
    else:
        received = torch.bmm(queries.unsqueeze(1), attention).squeeze(1)  # sum over real queries
        weights = received / num_real.clamp(min=1.0)
    # One real token: weight 1 (docs/method.md §2); none: all zeros.
    return torch.where(num_real <= 1, queries, weights)


@torch.no_grad()
def uniform_importance(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The ablation's "uniform weights": every real token weighs 1/n, padding 0.

    hidden: ``[batch, seq, dim]`` (only its shape and device are used).
    attention_mask: ``[batch, seq]``. Returns ``[batch, seq]`` fp32.
    """
    real = attention_mask.to(device=hidden.device, dtype=torch.float32)
    return real / real.sum(dim=-1, keepdim=True).clamp(min=1.0)


IMPORTANCE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "attention": token_importance,
    "uniform": uniform_importance,
}
