"""The files of a model directory, their one home: which files decide what a model computes
(``MODEL_FILE_PATTERNS``), whether its weights are whole (``check_weights``: headers only, no
tensor loads), whether they match its checksum list, and its fingerprint
(``checkpoint_fingerprint``), which keys predictions, teacher caches and ``mta push --results``.
The rules: ARCHITECTURE.md, "One home per mechanism".
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
from pathlib import Path

from mta.errors import MtaError
from mta.hashing import CHECKSUMS, file_sha256, json_sha256, read_checksums

# The weight and config files transformers reads from a model directory (MODEL_FILE_PATTERNS adds
# the adapter's and the tokenizer's).
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json")
CONFIG_PATTERNS = ("config.json", "generation_config.json")
# The one list of what transformers and peft read from a model directory (names relative to it;
# a pattern matches names as deep as itself). tests/test_model_directory.py checks it against
# transformers' own names and changes each file in turn.
ADAPTER_CONFIG = "adapter_config.json"  # peft's; transformers' ADAPTER_CONFIG_NAME
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME
ADAPTER_PATTERNS = (ADAPTER_CONFIG, *ADAPTER_WEIGHTS)
TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "vocab-*.json",
    "*_vocab.json",
    "merges.txt",
    "bpe.codes",
    "dict.txt",
    "*.tiktoken",
    "*.model",  # sentencepiece: tokenizer.model, spiece.model, sentencepiece.bpe.model, spm.model ...
    "*.spm",
    "*.tokenizer",
    "emoji.json",
    "normalizer.json",
    "byte_maps.json",
    "word_shape.json",
    "word_pronunciation.json",
    "chat_template.*",
    "additional_chat_templates/*.jinja",
)
MODEL_FILE_PATTERNS = WEIGHT_PATTERNS + ADAPTER_PATTERNS + CONFIG_PATTERNS + TOKENIZER_PATTERNS

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH = "pytorch_model.bin"
PYTORCH_INDEX = "pytorch_model.bin.index.json"

_RESAVE = (
    "The copy, download or save was interrupted: copy or save the checkpoint again "
    "(an `mta distill` output: re-run it, or evaluate one of its checkpoints/step-N)."
)


def is_model_file(name: str) -> bool:
    """Whether the file ``name`` of a checkpoint (relative, ``/``-separated) decides what the
    model generates."""
    if any(part.startswith(".") for part in name.split("/")):
        return False
    depth = name.count("/")
    return any(p.count("/") == depth and fnmatch.fnmatch(name, p) for p in MODEL_FILE_PATTERNS)


def model_files(directory: Path) -> list[str]:
    """The model files present in ``directory`` (top level and the folders the list names), sorted."""
    directory = Path(directory)
    found = [p.name for p in directory.iterdir() if p.is_file() and is_model_file(p.name)]
    for folder in sorted({p.split("/")[0] for p in MODEL_FILE_PATTERNS if "/" in p}):
        if (directory / folder).is_dir():
            names = (f"{folder}/{p.name}" for p in (directory / folder).iterdir() if p.is_file())
            found += [name for name in names if is_model_file(name)]
    return sorted(found)


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


def verified_model_digests(directory: str | Path) -> dict[str, str]:
    """``{model file: sha256}`` of ``directory``, each model file listed in its checksum list
    (when it has one) verified against it."""
    directory = Path(directory)
    digests = {name: file_sha256(directory / name) for name in model_files(directory)}
    listed = read_checksums(directory)
    if listed is None:
        return digests
    listed = {name.removeprefix("./"): digest for name, digest in listed.items()}  # `find .` style names
    listed = {name: digest for name, digest in listed.items() if is_model_file(name)}
    missing = sorted(name for name in listed if name not in digests)
    differ = sorted(name for name, digest in listed.items() if name in digests and digests[name] != digest)
    if missing or differ:
        problems = []
        if differ:
            problems.append(f"{', '.join(differ)} {'does' if len(differ) == 1 else 'do'} not match its {CHECKSUMS}")
        if missing:
            problems.append(
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} listed in its {CHECKSUMS} but missing"
            )
        raise MtaError(
            f"checkpoint {directory}: {'; '.join(problems)} (the bytes changed since "
            "the list was written: a corrupted copy or disk, or the model was re-saved in place without "
            f"updating the list). Restore the file(s) from a good copy; if the change is intended, delete "
            f"{directory / CHECKSUMS} or rewrite it (`sha256sum` format) and re-run."
        )
    return digests


def hub_revision(name: str) -> str | None:
    """The commit the hub cache resolves ``name``'s config to, when it can tell (no download:
    the config was fetched by the up-front check)."""
    try:
        from transformers.utils.hub import cached_file, extract_commit_hash

        return extract_commit_hash(cached_file(name, "config.json"), None)
    except Exception:  # offline without a snapshot, a local mirror: the name alone keys it
        return None


def checkpoint_fingerprint(checkpoint: str | Path) -> tuple[str, dict[str, str]]:
    """The fingerprint of ``checkpoint`` (a directory or a Hub name) and the per-file digests behind
    it ({} for a Hub name): the one rule every artefact keyed on a model follows (``mta evaluate``'s
    predictions, ``mta teacher``'s content key, ``mta push --results``)."""
    path = Path(checkpoint)
    if path.is_dir():
        digests = verified_model_digests(path)
        return f"sha256:{json_sha256(digests)}", digests
    revision = hub_revision(str(checkpoint))
    return (f"hub:{checkpoint}@{revision}" if revision else f"hub:{checkpoint}"), {}


def describe_changes(before: dict[str, str], after: dict[str, str]) -> str:
    """Which model files differ between two digest maps, in words."""
    changed = sorted(n for n in before.keys() & after.keys() if before[n] != after[n])
    added = sorted(after.keys() - before.keys())
    removed = sorted(before.keys() - after.keys())
    parts = [f"{n} changed (sha256 {before[n][:12]}… -> {after[n][:12]}…)" for n in changed]
    parts += [f"{n} added" for n in added] + [f"{n} removed" for n in removed]
    return ", ".join(parts)


# --------------------------------------------------------------------------- weights fingerprint, parameters


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


def holds_weights(directory: str | Path) -> bool:
    """Whether a model directory holds a weight file at its top level (not deleted, downloaded)."""
    return any(
        path.is_file() and any(fnmatch.fnmatch(path.name, p) for p in WEIGHT_PATTERNS)
        for path in Path(directory).iterdir()
    )


def stored_parameters(path: str | Path) -> int:
    """Parameters (elements of every tensor) stored in one safetensors file."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():
            count = 1
            for size in handle.get_slice(name).get_shape():
                count *= int(size)
            total += count
    return total


def parameter_count(model_dir: str | Path) -> int:
    """Parameters stored in a checkpoint's (top-level) safetensors files."""
    return sum(stored_parameters(shard) for shard in sorted(Path(model_dir).glob("*.safetensors")))


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "CONFIG_PATTERNS",
    "MODEL_FILE_PATTERNS",
    "WEIGHT_PATTERNS",
    "adapter_files",
    "check_safetensors",
    "check_weights",
    "checkpoint_fingerprint",
    "describe_adapter",
    "describe_changes",
    "is_model_file",
    "model_files",
    "parameter_count",
    "stored_parameters",
    "holds_weights",
    "require_unchanged",
    "verified_model_digests",
]
