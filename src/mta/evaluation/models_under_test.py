"""Checkpoints to evaluate: their labels, an up-front check, and clean load / teardown.

A checkpoint is any Hugging Face causal-LM directory with its tokenizer, or a hub name. Every
checkpoint is checked before the first one is loaded (config, tokenizer, and that the weight
files are there and whole, see ``model_files``), so a typo or a truncated copy in the fifth path
does not surface after four hours of generation.
"""

from __future__ import annotations

import gc
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from mta.errors import MtaError
from mta.evaluation.model_files import check_weights
from mta.models.tokenizers import load_tokenizer

_UNSAFE = re.compile(r"[^A-Za-z0-9._+=@-]+")


def checkpoint_label(checkpoint: str) -> str:
    """A directory-safe label from the whole path, so ``a/final`` and ``b/final`` differ:
    relative to the working directory when inside it, ``/`` written as ``--`` (the hub cache's
    convention: ``runs/mta/final`` -> ``runs--mta--final``, ``org/model`` -> ``org--model``)."""
    path = Path(checkpoint)
    if path.exists():
        resolved = path.resolve()
        try:
            path = resolved.relative_to(Path.cwd().resolve())
        except ValueError:
            path = resolved
    parts = [_UNSAFE.sub("_", part) for part in path.parts if part not in ("/", "", ".")]
    return "--".join(parts) or "checkpoint"


def checkpoint_names(checkpoints: Sequence[str], names: Sequence[str] | None = None) -> list[str]:
    """The label of every checkpoint: ``names`` when given (validated), else derived."""
    if names is None:
        labels = [checkpoint_label(c) for c in checkpoints]
    else:
        if len(names) != len(checkpoints):
            raise MtaError(f"--names gives {len(names)} labels for {len(checkpoints)} checkpoints; give one per checkpoint")
        bad = [n for n in names if not n or _UNSAFE.search(n) or n in (".", "..")]
        if bad:
            raise MtaError(
                f"label(s) {', '.join(repr(b) for b in bad)} cannot name a directory; use letters, "
                "digits and . _ + = @ -"
            )
        labels = list(names)
    duplicates = sorted({l for l in labels if labels.count(l) > 1})
    if duplicates:
        raise MtaError(f"two checkpoints share the label(s) {', '.join(duplicates)}; give distinct --names")
    return labels


def check_checkpoint(checkpoint: str) -> None:
    """Fail with a fix when ``checkpoint`` is not a causal LM with whole weights and a tokenizer
    (reads the weights' headers only; a hub name's weights are not looked at before loading)."""
    path = Path(checkpoint)
    if path.is_dir() and not (path / "config.json").is_file():
        raise MtaError(
            f"{path} is not a model directory (no config.json). Give the directory that "
            "save_pretrained wrote, e.g. the final/ folder of an `mta distill` run."
        )
    looks_local = path.exists() or checkpoint.startswith((".", "/", "~")) or checkpoint.count("/") > 1
    if looks_local and not path.exists():
        raise MtaError(f"checkpoint {checkpoint} does not exist")
    try:
        config = AutoConfig.from_pretrained(checkpoint)
    except Exception as error:  # OSError, ValueError, hub errors: all mean "not loadable"
        raise MtaError(
            f"cannot read a model config from '{checkpoint}': {error}. Give a local model "
            "directory, or a Hugging Face model name when the hub is reachable."
        ) from error
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise MtaError(f"{checkpoint} is a {config.model_type} model, not a causal LM")
    if path.is_dir():
        check_weights(path)
    if path.is_dir() and not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise MtaError(
            f"{path} has no tokenizer (tokenizer.json / tokenizer_config.json). Save the "
            "tokenizer beside the weights: AutoTokenizer.from_pretrained(<base model>)"
            f".save_pretrained('{path}')"
        )
    load_tokenizer(checkpoint)


@contextmanager
def loaded_checkpoint(
    checkpoint: str, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[PreTrainedModel, PreTrainedTokenizerBase]]:
    """The model in eval mode on ``device`` and its tokenizer; memory is released on exit so the
    next checkpoint of a multi-model run starts from an empty device."""
    tokenizer = load_tokenizer(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    try:
        yield model, tokenizer
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
