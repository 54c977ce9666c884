"""Sampling that depends on the row, not on the batch it was generated in.

``model.generate(do_sample=True)`` draws every token from one global random stream, so a row's
sample changes with the batch size, the sort order, the number of ranks and whatever ran before.
Here every row owns a random stream seeded from (seed, set, row index), and a token is drawn
with the Gumbel-max trick: ``argmax(logits + Gumbel noise)`` is an exact sample of
``softmax(logits)``, i.e. top_k 0, top_p 1.0, temperature 1.0 as the protocol asks. HF's greedy
search takes the argmax after this processor has added the noise.

Reproducible: the noise a row sees at step t is fixed by (seed, set, index, t), whatever the
batch, its order, the rank or a resume. Not reproducible bit for bit: the logits themselves,
which move in their last bits with the batch shape, the padding, the device and the dtype; a
token whose two best noisy scores lie within that rounding can flip, after which the row
diverges. Same batch size, device and dtype give identical files.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch
from transformers import LogitsProcessor


def row_seed(seed: int, set_name: str, index: int) -> int:
    """A 63-bit seed for one row's random stream; stable across Python runs and machines."""
    digest = hashlib.sha256(f"{seed}/{set_name}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class KeyedGumbelNoise(LogitsProcessor):
    """Adds per-row Gumbel noise to the next-token scores; greedy decoding then samples.

    Row ``b`` of every batch draws from ``torch.Generator`` seeded with ``row_seeds[b]``, one
    vocabulary-sized draw per decoding step, so its noise is independent of the other rows.
    """

    def __init__(self, row_seeds: Sequence[int], device: torch.device | str = "cpu"):
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in row_seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """scores: [batch, vocab] -> scores + Gumbel noise, [batch, vocab] in float32."""
        batch, vocab = scores.shape
        if batch != len(self.generators):
            raise ValueError(f"KeyedGumbelNoise got {batch} rows for {len(self.generators)} seeds")
        # One call per row (not per token): each row must advance only its own stream.
        uniform = torch.stack(
            [torch.rand(vocab, generator=g, device=scores.device) for g in self.generators]
        )
        tiny = torch.finfo(torch.float32).tiny
        gumbel = -torch.log(-torch.log(uniform.clamp_(min=tiny)))
        return scores.float() + gumbel
