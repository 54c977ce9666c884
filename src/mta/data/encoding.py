"""A tokenizer as the annotate stage uses it: ids and character offsets of a text, plus EOS.

The tokenizer is loaded once with ``AutoTokenizer`` (so its configuration is exactly what
``tokenizer(text, add_special_tokens=False)`` applies), then kept as its Rust backend, which
encodes with the same ids and offsets, pickles as JSON to worker processes, and needs neither
transformers nor torch there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mta.errors import MtaError


@dataclass(frozen=True)
class Encoding:
    """ids: ``[tokens]`` int32; offsets: ``[tokens, 2]`` character ranges (no EOS here)."""

    ids: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class TokenizerSide:
    """One model's tokenizer: its name, vocabulary fingerprint, EOS id and Rust backend."""

    name: str
    fingerprint: str
    eos_id: int
    backend_json: str
    _backend: object = field(default=None, repr=False, compare=False)

    @classmethod
    def load(cls, name_or_path: str | Path) -> "TokenizerSide":
        from mta.models.tokenizers import load_tokenizer, tokenizer_fingerprint

        tokenizer = load_tokenizer(name_or_path)
        if tokenizer.eos_token_id is None:
            raise MtaError(
                f"the tokenizer '{name_or_path}' has no EOS token; annotate appends EOS to "
                "complete responses (set eos_token in its tokenizer_config.json)"
            )
        return cls(
            name=str(name_or_path),
            fingerprint=tokenizer_fingerprint(tokenizer),
            eos_id=int(tokenizer.eos_token_id),
            backend_json=tokenizer.backend_tokenizer.to_str(),
        )

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_backend"] = None  # rebuilt from backend_json in the receiving process
        return state

    @property
    def backend(self):
        if self._backend is None:
            from tokenizers import Tokenizer

            self._backend = Tokenizer.from_str(self.backend_json)
        return self._backend

    def encode(self, text: str) -> Encoding:
        encoded = self.backend.encode(text, add_special_tokens=False)
        return Encoding(
            ids=np.asarray(encoded.ids, dtype=np.int32),
            offsets=np.asarray(encoded.offsets, dtype=np.int64).reshape(-1, 2),
        )

    def count(self, text: str) -> int:
        """Number of tokens of ``text`` (no EOS)."""
        return len(self.backend.encode(text, add_special_tokens=False).ids)

    def tokens(self, ids: list[int]) -> list[str]:
        """The vocabulary strings of ``ids`` (e.g. ``Ġword``), for display."""
        return [self.backend.id_to_token(int(i)) or f"<{i}>" for i in ids]
