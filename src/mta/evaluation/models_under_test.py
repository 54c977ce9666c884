"""Checkpoints to evaluate: their labels, an up-front check, and clean load / teardown.

A checkpoint is any Hugging Face causal-LM directory with its tokenizer, or a hub name. Every
checkpoint is checked before the first one is loaded (config, tokenizer, and that the weight
files are there and whole, see ``mta.models.weights``), so a typo or a truncated copy in the fifth path
does not surface after four hours of generation.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from mta.errors import MtaError
from mta.models.hub import load_pretrained
from mta.models.tokenizers import load_tokenizer
from mta.models.weights import adapter_files, check_weights, describe_adapter

_UNSAFE = re.compile(r"[^A-Za-z0-9._+=@-]+")
RUN_OUTPUTS = ("final", "best")  # what `mta distill` writes inside a run directory
_STEP = re.compile(r"^step-\d+$")
log = logging.getLogger(__name__)


def _path_parts(checkpoint: str) -> list[str]:
    """The path's directory-safe parts, relative to the working directory when inside it (a hub
    name's are its org and name)."""
    path = Path(checkpoint).expanduser()
    if path.exists():
        resolved = path.resolve()
        try:
            path = resolved.relative_to(Path.cwd().resolve())
        except ValueError:
            path = resolved
    return [_UNSAFE.sub("_", part) for part in path.parts if part not in ("/", "", ".", "..")] or ["checkpoint"]


def _candidates(checkpoint: str) -> list[str]:
    """Labels of ``checkpoint`` from the shortest to the whole path (parts joined by ``--``):
    a run's ``final/`` or ``best/`` is named by its run directory (``runs/tiny-long/final`` ->
    ``tiny-long``, then ``tiny-long-final``), a ``checkpoints/step-N/`` by the run and step
    (``tiny-long-step-40``), a hub name by its name (``org/model`` -> ``model``), then ever more
    of the path above it."""
    parts = _path_parts(checkpoint)
    names, output = parts, []
    if len(parts) >= 2 and parts[-1] in RUN_OUTPUTS:
        names, output = parts[:-1], [f"{parts[-2]}-{parts[-1]}"]  # a/final, a/best -> a-final, a-best
    elif len(parts) >= 3 and parts[-2] == "checkpoints" and _STEP.match(parts[-1]):
        names = [*parts[:-3], f"{parts[-3]}-{parts[-1]}"]
    candidates = ["--".join(names[-k:]) for k in range(1, len(names) + 1)]
    return list(dict.fromkeys([candidates[0], *output, *candidates[1:], "--".join(parts)]))


def checkpoint_labels(checkpoints: Sequence[str]) -> list[str]:
    """Short, directory-safe labels: each checkpoint's shortest (``runs/a/final`` -> ``a``),
    lengthened with the directories above it only where two would otherwise collide
    (``x/a/final`` and ``y/a/final`` -> ``x--a`` and ``y--a``). The same path twice keeps
    colliding; ``checkpoint_names`` refuses that."""
    candidates = [_candidates(str(c)) for c in checkpoints]
    level = [0] * len(candidates)
    while True:
        labels = [options[min(k, len(options) - 1)] for options, k in zip(candidates, level, strict=True)]
        colliding = {i for i, label in enumerate(labels) if labels.count(label) > 1}
        growing = [i for i in colliding if level[i] < len(candidates[i]) - 1]
        if not growing:
            return labels
        for i in growing:
            level[i] += 1


def checkpoint_names(checkpoints: Sequence[str], names: Sequence[str] | None = None) -> list[str]:
    """The label of every checkpoint: ``names`` when given (validated), else derived."""
    if names is None:
        labels = checkpoint_labels(checkpoints)
    else:
        if len(names) != len(checkpoints):
            raise MtaError(
                f"--names gives {len(names)} labels for {len(checkpoints)} checkpoints; give one per checkpoint"
            )
        bad = [n for n in names if not n or _UNSAFE.search(n) or n in (".", "..")]
        if bad:
            raise MtaError(
                f"label(s) {', '.join(repr(b) for b in bad)} cannot name a directory; use letters, "
                "digits and . _ + = @ -"
            )
        labels = list(names)
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
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
        config = load_pretrained(AutoConfig.from_pretrained, checkpoint, what="checkpoint")
    except MtaError:
        raise
    except Exception as error:  # OSError, ValueError, hub errors: all mean "not loadable"
        raise MtaError(
            f"cannot read a model config from '{checkpoint}': {error}. Give a local model "
            "directory, or a Hugging Face model name when the hub is reachable."
        ) from error
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise MtaError(f"{checkpoint} is a {config.model_type} model, not a causal LM")
    if path.is_dir():
        check_weights(path)
        adapter = adapter_files(path)
        if adapter:
            applied = (
                "transformers applies it on top of the weights when it loads the directory"
                if importlib.util.find_spec("peft") is not None
                else "peft is not installed, so transformers ignores it"
            )
            log.warning(
                "%s carries a peft adapter (%s; %s): %s; its files are part of the checkpoint's fingerprint",
                path,
                ", ".join(adapter),
                describe_adapter(path),
                applied,
            )
    load_tokenizer(checkpoint)  # a directory without a tokenizer is refused there, naming the fix


@contextmanager
def loaded_checkpoint(
    checkpoint: str, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[PreTrainedModel, PreTrainedTokenizerBase]]:
    """The model in eval mode on ``device`` and its tokenizer; memory is released on exit so the
    next checkpoint of a multi-model run starts from an empty device.

    The collection on exit looks only at objects made since the model began to load (what the
    process held before is frozen meanwhile, ``gc.freeze``, unless something else froze objects
    already): everything the model and its generations made is collected as by a full
    ``gc.collect()``, without walking the half million objects torch and transformers hold
    (0.3 s a checkpoint on the development machine)."""
    frozen = gc.get_freeze_count() == 0
    if frozen:
        gc.freeze()
    try:
        tokenizer = load_tokenizer(checkpoint)
        model = load_pretrained(AutoModelForCausalLM.from_pretrained, checkpoint, what="checkpoint", dtype=dtype)
        model = model.to(device).eval()
        try:
            yield model, tokenizer
        finally:
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if frozen:
            gc.unfreeze()  # back into the oldest generation: later collections see them again
