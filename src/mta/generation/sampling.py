"""Sampling that depends on the row, not on the batch it was generated in.

``model.generate(do_sample=True)`` draws every token from one global random stream, so a row's
sample changes with the batch size, the sort order, the number of ranks and whatever ran before.
Here every row owns a random stream seeded by ``sampling_seed(seed, purpose, step, row)``, and a
token is drawn with the Gumbel-max trick: the logits are divided by the temperature, tokens
outside the top-k and the top-p nucleus are masked out, the row's Gumbel noise is added and HF's
greedy search takes the argmax. That argmax is an exact sample of the temperature softmax
restricted to the kept tokens and renormalised (the order of HF's warpers: temperature, top_k,
top_p). Temperature 0 is greedy decoding: no mask, no noise.

Reproducible: the noise a row sees at step t is fixed by its seed and t, whatever the batch, its
order, the rank or a resume. Not reproducible bit for bit: the logits themselves, which move in
their last bits with the batch shape, the padding, the device and the dtype; a token whose two
best noisy scores lie within that rounding can flip, after which the row diverges. Same batch
size, device and dtype give identical files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor

SEED_KEY = "{seed}/{purpose}/{step}/{row}"


def sampling_seed(seed: int, purpose: str, step: int, row: int) -> int:
    """The 63-bit seed of one row's random stream; stable across Python runs and machines.

    The first 8 bytes (little-endian) of SHA-256 of ``f"{seed}/{purpose}/{step}/{row}"``, top
    bit cleared. ``purpose`` names the stream's user so no two share noise by accident:
    ``evaluate/<set>`` (step 0), ``dev-samples`` (the training step), ``off-policy``, ... ``step``
    and ``row`` are integers, so the key reads back unambiguously even when ``purpose`` holds
    ``/``.
    """
    key = SEED_KEY.format(seed=seed, purpose=purpose, step=step, row=row)
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def keyed_uniforms(seed: int, purpose: str, rows: Sequence[int], positions: Sequence[int], draws: int) -> torch.Tensor:
    """Uniform numbers in [0, 1) keyed by row: ``[Σ positions, draws]`` fp64 on the CPU, row
    ``rows[i]``'s ``positions[i]`` positions one after another, each ``draws`` wide, from the
    row's stream ``sampling_seed(seed, purpose, 0, rows[i])``. Position p of a row always gets
    the p-th block of its row's stream, whatever the batch, its order or the rank
    (``mta teacher``'s sampled logits: ``purpose`` ``teacher-cache``)."""
    blocks = [
        torch.rand(
            count,
            draws,
            dtype=torch.float64,
            generator=torch.Generator().manual_seed(sampling_seed(seed, purpose, 0, row)),
        )
        for row, count in zip(rows, positions, strict=True)
    ]
    return torch.cat(blocks) if blocks else torch.zeros(0, draws, dtype=torch.float64)


@dataclass(frozen=True)
class SamplingParams:
    """How a completion is drawn.

    temperature: the logits are divided by it; 0 means greedy decoding.
    top_k: only the k most likely tokens can be drawn (0: no limit).
    top_p: only the smallest set of most likely tokens whose probability reaches top_p can be
        drawn, after top_k (1.0: no limit).
    max_new_tokens: the most tokens a completion may have, its stop token included.
    stop_token_ids: ids that end a completion besides the model's and tokenizer's EOS.
    min_new_tokens: no stop token can be drawn before this many tokens (0: none is held back;
        ``max_new_tokens``: every completion has exactly that length, as a benchmark wants).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self, engine: str = "hf") -> str:
        """One line naming the sampler and its parameters, as artefacts record it; ``engine``
        ``vllm``: vLLM's own sampler, the row's seed its per-request seed."""
        if self.greedy:
            text = "greedy decoding"
        elif engine == "vllm":
            text = (
                f"vLLM's sampler, per-request seed from the key {SEED_KEY}: temperature {self.temperature}, "
                f"top_k {self.top_k}, top_p {self.top_p}"
            )
        else:
            text = (
                f"keyed Gumbel-max, seed key {SEED_KEY}: temperature {self.temperature}, "
                f"top_k {self.top_k}, top_p {self.top_p}"
            )
        if self.stop_token_ids:
            text += f", stop ids {list(self.stop_token_ids)}"
        return text


def restricted_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[batch, vocab]`` logits -> float32 ``logits / temperature``, ``-inf`` outside each row's
    top-k and top-p nucleus. A row always keeps its most likely token; ties at the k-th value
    are all kept (as HF's top-k warper does)."""
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < scaled.shape[1]:
        kth = torch.topk(scaled, params.top_k, dim=1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, -torch.inf)
    if params.top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=1, descending=True)
        probs = sorted_logits.softmax(dim=1)
        mass_before = probs.cumsum(dim=1) - probs  # exactly 0 for the most likely token
        outside_sorted = mass_before >= params.top_p
        outside = torch.empty_like(outside_sorted).scatter_(1, order, outside_sorted)
        scaled = scaled.masked_fill(outside, -torch.inf)
    return scaled


class KeyedGumbelSampler(LogitsProcessor):
    """Next-token scores whose argmax is row ``b``'s keyed sample under ``params``.

    Row ``b`` of every batch draws from a ``torch.Generator`` seeded with ``row_seeds[b]``, one
    vocabulary-sized draw per decoding step, so its noise is independent of the other rows.
    """

    def __init__(self, params: SamplingParams, row_seeds: Sequence[int], device: torch.device | str = "cpu"):
        self.params = params
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in row_seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """scores: ``[batch, vocab]`` -> ``[batch, vocab]`` float32 (unchanged when greedy)."""
        batch, vocab = scores.shape
        if batch != len(self.generators):
            raise ValueError(f"KeyedGumbelSampler got {batch} rows for {len(self.generators)} seeds")
        if self.params.greedy:
            return scores
        return restricted_logits(scores, self.params) + self.gumbel_noise(vocab, scores.device)

    def gumbel_noise(self, vocab: int, device: torch.device) -> torch.Tensor:
        """``[batch, vocab]`` standard Gumbel noise, row ``b`` from its own stream."""
        # One call per row (not per token): each row must advance only its own stream.
        uniform = torch.stack([torch.rand(vocab, generator=g, device=device) for g in self.generators])
        tiny = torch.finfo(torch.float32).tiny
        return -torch.log(-torch.log(uniform.clamp_(min=tiny)))
