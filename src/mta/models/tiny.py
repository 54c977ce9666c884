"""Tiny random causal LMs and tokenizers, built offline, for the tiny recipe and the tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from mta.files import atomic_directory
from mta.hashing import json_sha256
from mta.models.tokenizers import load_tokenizer, train_byte_level_tokenizer

KEY_LENGTH = 12  # hex digits of the content key in a built model's directory name


def keyed_directory(directory: str | Path, description: dict) -> Path:
    """``<directory>-<key>``: where a model built from ``description`` (a JSON-able dict naming
    everything it is built from) lives, the key ``KEY_LENGTH`` hex digits of its sha256, so a
    changed description builds a new directory instead of reusing or overwriting the old."""
    directory = Path(directory)
    return directory.with_name(f"{directory.name}-{json_sha256(description)[:KEY_LENGTH]}")


def corpus_texts(jsonl_path: str | Path) -> list[str]:
    """Every string field of every row of a JSONL file: enough text to train a small BPE."""
    texts: list[str] = []
    with open(jsonl_path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                texts.extend(v for v in json.loads(line).values() if isinstance(v, str))
    return texts


def build_tiny_tokenizer(corpus_jsonl: str | Path, out_dir: str | Path, vocab_size: int = 512):
    """Train (once) a byte-level BPE on a JSONL corpus; reuse the directory when it exists."""
    out_dir = Path(out_dir)
    if (out_dir / "tokenizer.json").exists():
        return load_tokenizer(out_dir)
    return train_byte_level_tokenizer(corpus_texts(corpus_jsonl), vocab_size, out_dir)


def tiny_config(
    model_type: str, vocab_size: int, *, num_layers: int, hidden_size: int, num_heads: int
) -> PretrainedConfig:
    """The architecture of a tiny ``model_type`` (llama, gpt2 or qwen2) causal LM."""
    if model_type == "gpt2":
        sizes = dict(n_embd=hidden_size, n_layer=num_layers, n_head=num_heads, n_positions=1024)
    else:
        sizes = dict(
            hidden_size=hidden_size,
            intermediate_size=hidden_size * 2,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            max_position_embeddings=1024,
        )
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, **sizes)


def build_tiny_model(
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    *,
    model_type: str = "llama",
    num_layers: int = 4,
    hidden_size: int = 32,
    num_heads: int = 4,
    seed: int = 0,
) -> Path:
    """Save a random ``model_type`` causal LM sized to the tokenizer, with the tokenizer beside it."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    tokenizer = load_tokenizer(tokenizer_dir)
    config = tiny_config(
        model_type, len(tokenizer), num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads
    )
    config.eos_token_id = config.bos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Built beside its final place and renamed, so an interrupted build leaves no half model.
    with atomic_directory(out_dir) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return out_dir
