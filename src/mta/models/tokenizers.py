"""Loading, fingerprinting and training tokenizers.

Every artefact names the tokenizers it was built for by a fingerprint of the vocabulary, so a
later stage can refuse an artefact built for another tokenizer instead of training on garbage.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from mta.errors import MtaError
from mta.models.hub import TOKENIZER_FILE, load_pretrained

# The files a tokenizer directory holds, one of them at least (a fast tokenizer's, or the config
# that names a slow one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """Load a fast tokenizer from a local directory or a hub name (``mta.models.hub``: a hub
    name needs the Hub or the Hugging Face cache, and fails fast naming it without either).

    A local directory without tokenizer files (a checkpoint saved without its tokenizer) is
    refused first, naming the fix, instead of transformers' guess at a missing package; every
    command loads tokenizers here, so each says the same."""
    path = Path(name_or_path)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise MtaError(
            f"{path} has no tokenizer ({' / '.join(TOKENIZER_FILES)}). Save the tokenizer beside the "
            f"weights: AutoTokenizer.from_pretrained(<base model>).save_pretrained('{path}')"
        )
    try:
        tokenizer = load_pretrained(
            AutoTokenizer.from_pretrained, name_or_path, what="tokenizer", filename=TOKENIZER_FILE
        )
    except MtaError:
        raise
    except Exception as error:  # transformers raises OSError, ValueError, HF errors...
        raise MtaError(
            f"cannot load a tokenizer from '{name_or_path}': {error}. "
            "Give a local directory that holds tokenizer.json / tokenizer_config.json, "
            "or a Hugging Face model name when the hub is reachable."
        ) from error
    if not tokenizer.is_fast:
        raise MtaError(
            f"the tokenizer of '{name_or_path}' is a slow (Python) tokenizer; mta needs "
            "character offsets, which only fast tokenizers provide"
        )
    return tokenizer


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 over the vocabulary (token -> id) and the special tokens, in a stable order."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    payload = {
        "vocab": vocab,
        "eos": tokenizer.eos_token,
        "special": sorted(tokenizer.all_special_tokens),
    }
    digest = hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode("utf-8"))
    return "sha256:" + digest.hexdigest()


def train_byte_level_tokenizer(
    texts: Iterable[str], vocab_size: int, out_dir: str | Path, eos_token: str = "<|endoftext|>"
) -> PreTrainedTokenizerFast:
    """Train a GPT-2-style byte-level BPE on ``texts`` and save it as a loadable directory.

    Used by the tiny recipe and the tests: a real tokenizer, built offline in a second.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=eos_token, bos_token=eos_token, pad_token=eos_token
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return AutoTokenizer.from_pretrained(str(out_dir))
