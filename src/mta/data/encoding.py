"""A tokenizer as the annotate stage uses it: ids and character offsets of a text, plus EOS.

The tokenizer is loaded once with ``AutoTokenizer`` (so its configuration is exactly what
``tokenizer(text, add_special_tokens=False)`` applies), then kept as its Rust backend, which
encodes with the same ids and offsets, pickles as JSON to worker processes, and needs neither
transformers nor torch there.

The other direction, for ids a model generated (:meth:`TokenizerSide.decode_with_offsets`):
the ids are kept as they are and their text and offsets are derived from the ids themselves,
because decoding and encoding again does not always give the same ids. Rule (byte-level BPE):

- ``text`` is the tokenizer's own ``decode(ids, skip_special_tokens=False)``: the tokens' bytes
  joined and read as UTF-8, each maximal invalid byte sequence becoming one U+FFFD, including an
  incomplete character at the very end (a generation that stopped inside a character).
- A token's character range covers every character (or U+FFFD) one of whose bytes it holds:
  tokens that split a character each get that whole character, so their ranges overlap on it,
  and a token holding only bytes of a character another token began starts on that character.
  This is the rule of the tokenizer's own encode offsets, so ids that *are* the encoding of
  their text get exactly the offsets ``encode`` gives. A token without bytes (an id outside the
  vocabulary, which decode skips) gets an empty range where it stands.
"""

from __future__ import annotations

import codecs
import json
import threading
from collections.abc import Sequence
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
    _token_bytes: object = field(default=None, repr=False, compare=False)
    _special_ids: object = field(default=None, repr=False, compare=False)

    @classmethod
    def load(cls, name_or_path: str | Path) -> TokenizerSide:
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
        state["_token_bytes"] = None
        state["_special_ids"] = None
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

    def decode_with_offsets(self, ids: Sequence[int] | np.ndarray) -> tuple[str, Encoding]:
        """The text of ``ids`` and an :class:`Encoding` holding exactly those ids with their
        character ranges into it, by the rule of the module docstring (no Python loop over ids).

        ids: ``[tokens]``. Returns ``(text, Encoding(ids [tokens] int32, offsets [tokens, 2]))``.
        Byte-level BPE tokenizers only (GPT-2, Llama 3, Qwen, SmolLM2, mta's tiny ones): for
        another decoder an ``MtaError`` names it.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and ids.min() < 0:
            raise ValueError(f"token ids must be non-negative, got {int(ids.min())}")
        table = self.token_bytes
        known = ids < len(table.lengths)
        safe = np.where(known, ids, 0)
        lengths = np.where(known, table.lengths[safe], 0)  # [tokens] bytes of each token
        ends = np.cumsum(lengths)
        starts = ends - lengths
        total = int(ends[-1]) if len(ends) else 0
        # [bytes] where each byte of the joined tokens lies in the vocabulary's byte table
        source = np.repeat(table.starts[safe] - starts, lengths) + np.arange(total)
        text, is_start = utf8_characters(table.data[source].tobytes())
        chars_before = np.concatenate([[0], np.cumsum(is_start)])  # [bytes + 1]
        first = chars_before[np.minimum(starts + 1, total)] - 1  # the character of a first byte
        offsets = np.stack([np.where(lengths > 0, first, chars_before[starts]), chars_before[ends]], axis=1)
        return text, Encoding(ids=ids.astype(np.int32), offsets=offsets.astype(np.int64).reshape(-1, 2))

    @property
    def special_ids(self) -> np.ndarray:
        """The ids of the tokenizer's special tokens (its EOS among them), sorted int64."""
        if self._special_ids is None:
            added = self.backend.get_added_tokens_decoder()
            special = {int(index) for index, token in added.items() if token.special} | {self.eos_id}
            self._special_ids = np.asarray(sorted(special), dtype=np.int64)
        return self._special_ids  # type: ignore[return-value]

    @property
    def token_bytes(self) -> TokenBytes:
        """The vocabulary's bytes, built on first use (once per process; a forked worker
        inherits it)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes.of(self.backend, self.backend_json, self.name)
        return self._token_bytes


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte <-> printable character table (``bytes_to_unicode``), as char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    chars = {chr(byte): byte for byte in printable}
    chars.update({chr(256 + index): byte for index, byte in enumerate(others)})
    return chars


BYTE_LEVEL_CHARS = _byte_level_alphabet()


@dataclass(frozen=True)
class TokenBytes:
    """Every id's bytes as a byte-level decoder produces them, flattened.

    data: ``[all bytes]`` uint8; starts, lengths: ``[vocabulary]`` int64 (id -> its bytes are
    ``data[starts[id] : starts[id] + lengths[id]]``; an id the tokenizer lacks has none).
    """

    data: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, backend, backend_json: str, name: str) -> TokenBytes:
        decoder = (json.loads(backend_json).get("decoder") or {}).get("type")
        if decoder != "ByteLevel":
            raise MtaError(
                f"the tokenizer '{name}' has a {decoder or 'missing'} decoder; the text of "
                "generated ids is derived for byte-level BPE tokenizers only (GPT-2, Llama 3, "
                "Qwen, SmolLM2)"
            )
        pieces = []
        for index in range(backend.get_vocab_size(with_added_tokens=True)):
            token = backend.id_to_token(index)
            pieces.append(b"" if token is None else token_bytes(token))
        lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        return cls(
            data=np.frombuffer(b"".join(pieces), dtype=np.uint8),
            starts=np.cumsum(lengths) - lengths,
            lengths=lengths,
        )


def token_bytes(token: str) -> bytes:
    """The bytes the ByteLevel decoder makes of one vocabulary string: each character mapped
    back to its byte, or, for a token with a character outside that table (an added token whose
    text holds a space or a non-Latin-1 character), the token's own UTF-8."""
    try:
        return bytes(BYTE_LEVEL_CHARS[char] for char in token)
    except KeyError:
        return token.encode("utf-8")


_REPLACED = threading.local()


def _record_replacement(error: UnicodeDecodeError):
    _REPLACED.ranges.append((error.start, error.end))
    return "\ufffd", error.end


codecs.register_error("mta.record_replacement", _record_replacement)


def utf8_characters(data: bytes) -> tuple[str, np.ndarray]:
    """``data`` read as UTF-8, each maximal invalid byte sequence replaced by one U+FFFD (what
    Python's ``"replace"`` and Rust's ``from_utf8_lossy`` both do), and ``[bytes]`` bool: whether
    each byte begins a character of that text (so ``text`` has ``sum`` characters)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    is_start = (raw & 0xC0) != 0x80  # not a continuation byte
    try:
        return data.decode("utf-8"), is_start
    except UnicodeDecodeError:
        pass
    _REPLACED.ranges = []
    text = data.decode("utf-8", "mta.record_replacement")
    ranges = np.asarray(_REPLACED.ranges, dtype=np.int64).reshape(-1, 2)
    # A replaced sequence is one character: its first byte begins it, the rest do not.
    inside = np.zeros(len(raw) + 1, dtype=np.int64)
    np.add.at(inside, ranges[:, 0] + 1, 1)
    np.add.at(inside, ranges[:, 1], -1)
    is_start = is_start & (np.cumsum(inside)[:-1] == 0)
    is_start[ranges[:, 0]] = True
    return text, is_start
