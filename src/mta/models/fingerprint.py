"""What makes a model directory what it is: the one list of the files transformers and peft
read from it (``MODEL_FILE_PATTERNS``), and the fingerprint of a model (``model_fingerprint``):
``sha256:`` of ``{model file: its sha256}`` for a directory, its ``checksums.sha256`` verified
first when it has one; ``hub:<name>@<commit>`` for a Hub name, the commit its config resolves to
in the local Hub cache (``hub:<name>`` where none can be told).

Every artefact keyed on a model uses it: ``mta evaluate``'s predictions
(:mod:`mta.evaluation.model_files`, which documents the list), ``mta teacher``'s content key
(:mod:`mta.training.teacher_cache.content`) and ``mta push --results`` (:mod:`mta.models.push`).
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

from mta.errors import MtaError
from mta.hashing import CHECKSUMS, file_sha256, json_sha256, read_checksums
from mta.models.weights import CONFIG_PATTERNS, WEIGHT_PATTERNS

# The one list of what transformers and peft read from a model directory (names relative to it;
# the weights' and config's patterns live in mta.models.weights, which mta.training reads too;
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


def model_fingerprint(checkpoint: str | Path) -> tuple[str, dict[str, str]]:
    """The fingerprint of ``checkpoint`` (a directory or a Hub name) and the per-file digests
    behind it ({} for a Hub name)."""
    path = Path(checkpoint)
    if path.is_dir():
        digests = verified_model_digests(path)
        return f"sha256:{json_sha256(digests)}", digests
    revision = hub_revision(str(checkpoint))
    return (f"hub:{checkpoint}@{revision}" if revision else f"hub:{checkpoint}"), {}


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_PATTERNS",
    "ADAPTER_WEIGHTS",
    "MODEL_FILE_PATTERNS",
    "TOKENIZER_PATTERNS",
    "hub_revision",
    "is_model_file",
    "model_files",
    "model_fingerprint",
    "verified_model_digests",
]
