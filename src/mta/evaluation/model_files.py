"""The files that make a checkpoint under test: are its weights whole, do they match its checksum
list, and the fingerprint that keys its predictions.

**Model files** are the files of a checkpoint directory that decide what it generates: every file
transformers (``AutoConfig``, ``AutoModelForCausalLM``, ``AutoTokenizer``, ``GenerationConfig``)
and peft read from it, in one list (``MODEL_FILE_PATTERNS``): weights (``*.safetensors``,
``pytorch_model*.bin`` and their ``.index.json``), a peft adapter (``adapter_config.json``,
``adapter_model.safetensors`` / ``.bin``: with peft installed, ``from_pretrained`` applies it on
top of the weights), config (``config.json``, ``generation_config.json``) and tokenizer
(``tokenizer*``, ``special_tokens_map.json``, ``added_tokens.json``, the vocabulary files of
every tokenizer class transformers ships, ``chat_template.*``,
``additional_chat_templates/*.jinja``). Code files are not among them: mta never passes
``trust_remote_code``, so transformers runs none. Training records beside them
(``recipe.yaml``, ``trainer_state.json``, ``deepspeed/``, ``adapter/`` ...) are not model files.

**Whole weights** (``check_weights``, cheap, no tensor is read): a safetensors file's 8-byte header
length and JSON header parse, and the file is exactly as long as the header's largest data offset
says; a sharded checkpoint's index names shards that are all there and whole; a
``pytorch_model.bin`` exists and is not empty (it is not unpickled).

**Fingerprint** (``checkpoint_fingerprint``): ``sha256:`` of ``{model file: its sha256}`` as
canonical JSON (``mta.hashing.json_sha256``), so it changes whenever any weight, adapter,
tokenizer or config byte does. Where the directory has a ``checksums.sha256`` (``mta distill`` writes one into
every checkpoint and ``final/``), every model file it lists is verified against it first and a
mismatch is refused naming the file; the digests are the file's bytes either way, so the
fingerprint is the same with or without the list. The files are hashed on every run, reuse
included: ``file_sha256`` reads about 1.6 GB/s on one core of the development machine
(``bench/fingerprint.py``: 0.31 s for 500 MB from the page cache), so a 7B model in bf16
(~14 GB) costs ~9 s, or the disk's read time when it is not cached.

A hub name is fingerprinted as ``hub:<name>@<commit>``, the commit its config resolved to in the
local hub cache (the one ``from_pretrained`` loads), or ``hub:<name>`` where none can be told
(e.g. a local hub mirror without snapshots): predictions of a hub name are then keyed on the name.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from mta.errors import MtaError
from mta.models.fingerprint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MODEL_FILE_PATTERNS,
    is_model_file,
    model_files,
    model_fingerprint,
    verified_model_digests,
)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH = "pytorch_model.bin"
PYTORCH_INDEX = "pytorch_model.bin.index.json"

_RESAVE = (
    "The copy, download or save was interrupted: copy or save the checkpoint again "
    "(an `mta distill` output: re-run it, or evaluate one of its checkpoints/step-N)."
)


def adapter_files(directory: str | Path) -> list[str]:
    """The peft adapter files of a local model directory (``[]``: it carries none), or an
    ``MtaError`` when it has ``adapter_config.json`` but no adapter weights: with peft installed,
    ``from_pretrained`` would fail on the missing file after loading the model."""
    directory = Path(directory)
    if not (directory / ADAPTER_CONFIG).is_file():
        return []
    weights = [name for name in ADAPTER_WEIGHTS if (directory / name).is_file()]
    if not weights and importlib.util.find_spec("peft") is not None:
        raise MtaError(
            f"{directory} has an {ADAPTER_CONFIG} but no adapter weights ({' or '.join(ADAPTER_WEIGHTS)}), so "
            "transformers cannot apply the peft adapter it names when it loads the directory. Copy the "
            f"adapter's weights beside it, or remove {directory / ADAPTER_CONFIG} to use the model without "
            "the adapter (an `mta distill` output never has one: final/ holds merged weights)."
        )
    return [ADAPTER_CONFIG, *weights]


def describe_adapter(directory: str | Path) -> str:
    """What ``adapter_config.json`` says the adapter is, in a few words (for the log)."""
    try:
        config = json.loads((Path(directory) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"an unreadable {ADAPTER_CONFIG} ({type(error).__name__})"
    if not isinstance(config, dict):
        return f"an {ADAPTER_CONFIG} that is not an object"
    said = [str(config.get("peft_type") or "peft")]
    said += [f"{key} {config[key]}" for key in ("r", "lora_alpha", "target_modules") if config.get(key) is not None]
    if config.get("base_model_name_or_path"):
        said.append(f"base {config['base_model_name_or_path']}")
    return ", ".join(said)


# --------------------------------------------------------------------------- whole weights


def check_safetensors(path: Path) -> None:
    """Refuse a safetensors file whose header does not parse or whose length is not the one its
    header describes (reads the header only)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        length_bytes = handle.read(8)
        if len(length_bytes) < 8:
            raise MtaError(
                f"{path} is truncated: {size} bytes, not even the 8-byte safetensors header length. {_RESAVE}"
            )
        header_length = int.from_bytes(length_bytes, "little")
        if 8 + header_length > size:
            raise MtaError(
                f"{path} is truncated or not a safetensors file: its header should take {header_length} bytes "
                f"but the file holds {size}. {_RESAVE}"
            )
        try:
            header = json.loads(handle.read(header_length))
            ends = [int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
            raise MtaError(f"{path} has a corrupt safetensors header ({type(error).__name__}). {_RESAVE}") from error
    expected = 8 + header_length + max(ends, default=0)
    if size < expected:
        raise MtaError(
            f"{path} is truncated: its header describes {expected} bytes but the file holds {size}. {_RESAVE}"
        )
    if size > expected:
        raise MtaError(f"{path} is corrupt: it holds {size} bytes but its header describes {expected}. {_RESAVE}")


def _shards(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise MtaError(f"{index} is not a shard index (no readable 'weight_map'). {_RESAVE}") from error
    if not shards or not all(isinstance(s, str) for s in shards):
        raise MtaError(f"{index} names no shard files. {_RESAVE}")
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise MtaError(
            f"{index} names shard(s) {', '.join(missing)} that are not in {index.parent}. "
            "Copy the missing files beside it, or save the checkpoint again."
        )
    return shards


def _check_pytorch(path: Path) -> None:
    if path.stat().st_size == 0:
        raise MtaError(f"{path} is empty. {_RESAVE}")


def check_weights(directory: str | Path) -> None:
    """Refuse a model directory whose weights are missing, truncated or corrupt, by file, in the
    order ``from_pretrained`` looks for them (safetensors first)."""
    directory = Path(directory)
    if (directory / SAFETENSORS).is_file():
        check_safetensors(directory / SAFETENSORS)
    elif (directory / SAFETENSORS_INDEX).is_file():
        for shard in _shards(directory / SAFETENSORS_INDEX):
            check_safetensors(directory / shard)
    elif (directory / PYTORCH).is_file():
        _check_pytorch(directory / PYTORCH)
    elif (directory / PYTORCH_INDEX).is_file():
        for shard in _shards(directory / PYTORCH_INDEX):
            _check_pytorch(directory / shard)
    else:
        raise MtaError(
            f"{directory} has no weights ({SAFETENSORS}, {SAFETENSORS_INDEX}, {PYTORCH} or {PYTORCH_INDEX}). "
            "Give the directory that save_pretrained wrote, with its weight files; a copy that "
            "left them behind must be redone."
        )


# --------------------------------------------------------------------------- fingerprint


def checkpoint_fingerprint(checkpoint: str) -> tuple[str, dict[str, str]]:
    """The fingerprint of ``checkpoint`` and the per-file digests behind it ({} for a hub name):
    :func:`mta.models.fingerprint.model_fingerprint`, the one rule every artefact keyed on a model
    follows."""
    return model_fingerprint(checkpoint)


def require_unchanged(checkpoint: str, fingerprint: str) -> None:
    """Refuse a model that changed between its fingerprint and its load: called once the model is
    loaded (in this process or a vLLM worker) and before anything is generated from it, so every
    prediction comes from the model its ``generation.json`` names (evaluating ``best/`` while a
    run still trains into it is the common way to get here)."""
    now = checkpoint_fingerprint(checkpoint)[0]
    if now != fingerprint:
        raise MtaError(
            f"checkpoint {checkpoint} changed while it was being loaded (fingerprint {fingerprint} when "
            f"checked, {now} after loading): is a run still writing it? Nothing was generated from it. "
            "Evaluate it when it no longer changes (or a copy of it)"
        )


def describe_changes(before: dict[str, str], after: dict[str, str]) -> str:
    """Which model files differ between two digest maps, in words."""
    changed = sorted(n for n in before.keys() & after.keys() if before[n] != after[n])
    added = sorted(after.keys() - before.keys())
    removed = sorted(before.keys() - after.keys())
    parts = [f"{n} changed (sha256 {before[n][:12]}… -> {after[n][:12]}…)" for n in changed]
    parts += [f"{n} added" for n in added] + [f"{n} removed" for n in removed]
    return ", ".join(parts)


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "MODEL_FILE_PATTERNS",
    "adapter_files",
    "check_safetensors",
    "check_weights",
    "checkpoint_fingerprint",
    "describe_adapter",
    "describe_changes",
    "is_model_file",
    "model_files",
    "require_unchanged",
    "verified_model_digests",
]
