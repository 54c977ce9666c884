"""What a teacher cache holds for a recipe, how its manifest names it, and how large it is.

:func:`teacher_reads` gives the teacher quantities the recipe's objective reads (the same
layer maps as ``mta.training.llm.build``); :func:`describe` the manifest's description of a split's
cache, whose :data:`CONTENT_KEYS` decide its content (their hash is the run key, and training
compares them one by one, so a mismatch is refused naming the key); :func:`estimate_bytes` the
artefact's size from the rows' token counts, before anything runs.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mta.data.artefact_schema import INPUT_IDS, PROMPT_LEN
from mta.errors import MtaError
from mta.hashing import arrays_sha256, file_sha256, json_sha256
from mta.models.tokenizers import tokenizer_fingerprint
from mta.models.weights import CONFIG_PATTERNS, WEIGHT_PATTERNS, checkpoint_fingerprint, holds_weights
from mta.training.config.layers import resolve_layer_map, resolve_sra_layers
from mta.training.config.schema import Recipe
from mta.training.model_loading import hidden_size
from mta.training.teacher_cache.compact import id_bits, packed_bytes, state_bytes
from mta.versions import MTA_VERSION, package_versions

ARTEFACT = "teacher-outputs"  # the manifest's ``artefact``
# The manifest's ``teacher_cache_version``: the columns and keys of this package. 3: ids packed in
# ``id_bits`` bits, sampled logits, 8-bit states (issue 53). 2: the ``teacher_weights`` key of every
# model file by content and a Hub teacher's commit (issue 51). 1 (mta 0.2.0): that key of the
# weight and config files alone, a Hub teacher's name alone. Every version is read (:func:`upgraded`):
# 1 and 2 hold int32 ids, top-k logits, states in the storage's precision.
CACHE_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
# What a manifest of version 1 or 2, which predate these keys, holds.
LAYOUT_DEFAULTS = {"sampling": None, "states": "storage"}
SPLITS = ("train", "dev")
# The description's keys that decide the stored values; each names the recipe key to change.
CONTENT_KEYS = {
    "teacher_cache_version": "mta teacher (rebuild the cache with this mta)",
    "teacher_weights": "teacher.path (another teacher: its weight, adapter, config or tokenizer files, or Hub commit)",
    "teacher_tokenizer": "teacher.tokenizer",
    "teacher_tokens": "data.train / data.dev (rows whose teacher tokens differ)",
    "max_length": "data.max_length",
    "layers": "loss.layers / loss.sra_layers (a teacher layer the cache does not hold)",
    "logits": "loss.base / loss.base_weight (a logit loss, and the cache holds no logits)",
    "top_k": "teacher_cache.top_k",
    "sampling": "teacher_cache.logits / teacher_cache.samples / teacher_cache.seed",
    "states": "teacher_cache.states",
    "temperature": "loss.temperature",
    "storage": "teacher_cache.storage",
    "precision": "train.precision / teacher.dtype (the teacher's compute precision)",
}
BYTES = {"compact": 2, "fp32": 4}  # per stored hidden value and log-probability
ROW_GROUP_BYTES = 5_000  # Parquet's per-row-group overhead, measured on the tiny models' caches


@dataclass(frozen=True)
class TeacherReads:
    """What the objective reads from the teacher: ``hidden_states`` indices and whether logits."""

    layers: tuple[int, ...]
    logits: bool


def teacher_reads(recipe: Recipe, student_layers: int, teacher_layers: int) -> TeacherReads:
    """The teacher layers (MTA's pairs, SRA's) and logits the recipe's losses read, from the two
    models' depths; FDD and SRA's attention and logit terms are refused by the schema."""
    loss = recipe.loss
    layers: set[int] = set()
    if loss.trajectory_terms:
        layers |= {pair.teacher for pair in resolve_layer_map(loss.layers, student_layers, teacher_layers)}
    if loss.sra_weight:
        layers |= {pair.teacher for pair in resolve_sra_layers(loss.sra_layers, student_layers, teacher_layers)}
    return TeacherReads(tuple(sorted(layers)), bool(loss.base_weight) and loss.base != "ce")


def teacher_tokens_fingerprint(table: pa.Table) -> str:
    """``sha256:`` of what the teacher reads of annotated rows: their ids, teacher token ids and
    teacher prompt lengths (the spans and the student's side are not in it, so annotations of
    another span rule share the cache)."""
    arrays = []
    for name in ("id", INPUT_IDS["teacher"], PROMPT_LEN["teacher"]):
        column = table.column(name).combine_chunks()
        if pa.types.is_list(column.type):
            arrays.append(pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64))
            column = pc.list_flatten(column)
        arrays.append(column.to_numpy(zero_copy_only=False).astype(np.int64))
    return "sha256:" + arrays_sha256(arrays)


def teacher_weights(path: str) -> str | None:
    """The teacher's fingerprint by the rule evaluation keys predictions on
    (:func:`mta.models.weights.checkpoint_fingerprint`): every file transformers and peft read from
    a directory (weights, adapter, config, tokenizer), by content; a Hub name with the commit its
    snapshot resolves to (``hub:<name>@<commit>``). None for a directory without weight files
    (deleted: the cache's record then stands for them)."""
    directory = Path(path).expanduser()
    if directory.is_dir() and not holds_weights(directory):
        return None
    return checkpoint_fingerprint(directory if directory.is_dir() else path)[0]


def teacher_precision(training_precision: str, recipe: Recipe) -> str:
    """The ``precision`` content key: the training precision the teacher runs under (its autocast)
    and the teacher's own dtype, e.g. ``bf16/teacher fp32``."""
    return f"{training_precision}/teacher {recipe.teacher.dtype if recipe.teacher else None}"


@dataclass(frozen=True)
class TeacherIdentity:
    """What decides a teacher's outputs, as both the stage and a cached run record it (each
    computed once per process): where it loads from, its weights fingerprint (None: no weight
    files there), its tokenizer's fingerprint and vocabulary, its width, the precision it runs in."""

    path: str
    weights: str | None
    tokenizer_fingerprint: str
    vocab_size: int
    hidden_size: int
    precision: str

    @classmethod
    def of(cls, path: str, tokenizer: Any, config: Any, precision: str) -> TeacherIdentity:
        return cls(
            path,
            teacher_weights(path),
            tokenizer_fingerprint(tokenizer),
            len(tokenizer),
            hidden_size(config),
            precision,
        )


def describe(
    recipe: Recipe, split: str, *, reads: TeacherReads, teacher: TeacherIdentity, rows: pa.Table, annotations_dir: Path
) -> dict[str, Any]:
    """The manifest's description of ``split``'s cache (everything but the counts and parts)."""
    spec = recipe.teacher_cache
    return {
        "artefact": ARTEFACT,
        "teacher_cache_version": CACHE_VERSION,
        "mta_version": MTA_VERSION,
        "split": split,
        "teacher": {"path": teacher.path, "hidden_size": teacher.hidden_size, "vocab_size": teacher.vocab_size},
        "teacher_weights": teacher.weights,
        "teacher_tokenizer": teacher.tokenizer_fingerprint,
        "teacher_tokens": teacher_tokens_fingerprint(rows),
        "annotations_dir": str(annotations_dir),
        "max_length": recipe.data.max_length,
        "layers": list(reads.layers),
        "logits": reads.logits,
        "top_k": min(spec.head, teacher.vocab_size) if reads.logits else None,
        "sampling": {"samples": spec.samples, "seed": spec.seed} if reads.logits and spec.logits == "sampled" else None,
        "temperature": recipe.loss.temperature if reads.logits else None,
        "storage": spec.storage,
        "states": spec.states,
        "id_bits": id_bits(teacher.vocab_size),
        "precision": teacher.precision,
        "versions": package_versions(),
    }


def upgraded(manifest: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """A manifest of any :data:`READABLE_VERSIONS` with today's keys, in memory (the files are
    never rewritten): versions 1 and 2 take :data:`LAYOUT_DEFAULTS` (their columns are read by type).
    Version 1's ``teacher_weights`` hashed the teacher directory's weight and config files; where the teacher's
    directory still hashes to it by that rule, the cache was built by this teacher (a version-1 cache
    holds the token ids it was computed on, keyed by ``teacher_tokens``, and the schema refuses a LoRA
    teacher, so the files version 2 adds decide nothing more), and it takes version 2's key. A Hub
    teacher's version-1 key is its name without a commit: refused, since the snapshot may have moved."""
    if manifest.get("teacher_cache_version") in (1, 2):
        manifest = LAYOUT_DEFAULTS | manifest
    if manifest.get("teacher_cache_version") != 1:
        return manifest
    stored, path = manifest.get("teacher_weights"), str(expected.get("teacher", {}).get("path", ""))
    if isinstance(stored, str) and stored.startswith("hub:"):
        raise MtaError(
            f"this teacher cache was built by mta 0.2.0 for the Hub teacher {stored[4:]}, keyed by its name without "
            "the commit it loaded (version 1): it cannot tell whether the snapshot moved since. Rebuild it: "
            "`mta teacher --recipe RECIPE -o DIR --force`"
        )
    weights = expected.get("teacher_weights")
    same = weights is None or (Path(path).is_dir() and _version_1_weights(Path(path)) == stored)
    return manifest | {"teacher_weights": weights if same else stored}  # its version stays as stored


def _version_1_weights(directory: Path) -> str:
    """Version 1's ``teacher_weights``: ``sha256:`` of the top-level weight and config files."""
    names = sorted(
        path.name
        for path in directory.iterdir()
        if path.is_file() and any(fnmatch.fnmatch(path.name, p) for p in (*WEIGHT_PATTERNS, *CONFIG_PATTERNS))
    )
    return "sha256:" + json_sha256({name: file_sha256(directory / name) for name in names})


def content_key(description: dict[str, Any]) -> str:
    """The run key: a hash of the description's :data:`CONTENT_KEYS` and its split."""
    return "sha256:" + json_sha256({key: description.get(key) for key in (*CONTENT_KEYS, "split")})


def mismatches(stored: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """The content keys on which a stored cache does not serve the recipe, each as ``key: stored,
    expected (what to change)``. A cache serves a recipe that reads less of it: ``layers`` may be
    a superset of the recipe's, a cache with logits serves a recipe without a logit loss (its
    ``top_k`` and ``temperature`` are then not compared), and states in the storage's precision
    serve a recipe asking for 8 bits (they are what 8 bits approximate). A stored ``teacher_weights`` is
    compared only when the teacher's weights are there to fingerprint (``expected`` not None)."""
    found = []
    stored = upgraded(stored, expected)
    for key, fix in CONTENT_KEYS.items():
        if key == "teacher_weights" and expected.get(key) is None:
            continue
        if key == "teacher_cache_version" and stored.get(key) in READABLE_VERSIONS:
            continue
        if key == "layers" and set(expected.get(key) or ()) <= set(stored.get(key) or ()):
            continue
        if key == "states" and stored.get(key) == "storage":
            continue
        if (
            key == "logits"
            and stored.get(key)
            or key in ("top_k", "sampling", "temperature")
            and not expected.get("logits")
        ):
            continue
        if stored.get(key) != expected.get(key):
            found.append(f"{key}: {stored.get(key)!r} in the cache, {expected.get(key)!r} for the recipe ({fix})")
    return found


def schema(storage: str, states: str = "storage") -> pa.Schema:
    """The columns of a cache part (the package docstring), values in ``storage``'s precision,
    hidden states in ``states``' (int8 with fp32 scales, or the storage's precision)."""
    value = pa.float16() if storage == "compact" else pa.float32()
    return pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            pa.field("tokens", pa.int32(), nullable=False),
            pa.field("positions", pa.list_(pa.int32()), nullable=False),
            pa.field("top_ids", pa.binary(), nullable=False),
            pa.field("top_log_probs", pa.list_(value), nullable=False),
            pa.field("tail", pa.list_(pa.float32()), nullable=False),
            pa.field("sample_distinct", pa.list_(pa.uint8()), nullable=False),
            pa.field("sample_ids", pa.binary(), nullable=False),
            pa.field("sample_counts", pa.list_(pa.uint8()), nullable=False),
            pa.field("sample_log_probs", pa.list_(value), nullable=False),
            pa.field("rest_log_mean", pa.list_(pa.float32()), nullable=False),
            pa.field("hidden", pa.list_(value if states == "storage" else pa.int8()), nullable=False),
            pa.field("hidden_scales", pa.list_(pa.float32()), nullable=False),
        ]
    )


LOGIT_COLUMNS = (
    *("positions", "top_ids", "top_log_probs", "tail"),
    *("sample_distinct", "sample_ids", "sample_counts", "sample_log_probs", "rest_log_mean"),
)
STATE_COLUMNS = ("hidden", "hidden_scales")


@dataclass(frozen=True)
class SizeEstimate:
    """Bytes a cache takes: ``logits`` (ids, log-probs, tails, draws) and ``hidden`` (states), over
    ``rows`` rows of ``tokens`` teacher tokens with ``responses`` response positions in all."""

    rows: int
    logits: int
    hidden: int
    tokens: int = 0
    responses: int = 0

    @property
    def total(self) -> int:
        return self.logits + self.hidden

    @property
    def per_row(self) -> float:
        return self.total / max(self.rows, 1)

    def per_token(self) -> dict[str, float]:
        """Bytes a teacher token (states) and a response position (logits) take."""
        return {
            "logits_per_response_position": self.logits / max(self.responses, 1),
            "states_per_token": self.hidden / max(self.tokens, 1),
        }


def estimate_bytes(
    reads: TeacherReads,
    *,
    top_k: int,
    storage: str,
    hidden_size: int,
    tokens: int,
    responses: int,
    rows: int,
    samples: int = 0,
    states: str = "storage",
    vocab_size: int | None = None,
) -> SizeEstimate:
    """At most the cache's size for ``rows`` rows of ``tokens`` teacher tokens and ``responses``
    response positions in all: per position the head's ``top_k`` ids (``id_bits(vocab_size)``
    bits each; 32 without a vocabulary) and log-probabilities, the tail's fp32 and the position's
    int32, and with ``samples`` draws at most that many distinct ids with a count byte and a
    log-probability each, plus a byte for their number; the states in ``states``
    (:func:`~mta.training.teacher_cache.compact.state_bytes`). Draws repeat on a peaked
    distribution, so a sampled cache takes less. Each row's Parquet row group (its metadata, page
    headers and statistics, ``ROW_GROUP_BYTES``) is counted with the logits."""
    value = BYTES[storage]
    bits = id_bits(vocab_size) if vocab_size else 32
    logits = 0
    if reads.logits:
        per_position = top_k * value + 4 + 4 + (samples * (value + 1) + 1 if samples else 0)
        logits = responses * per_position + packed_bytes(responses * (top_k + samples), bits)
    hidden = state_bytes(
        states, value_bytes=value, layers=len(reads.layers), tokens=tokens, hidden_size=hidden_size, rows=rows
    )
    return SizeEstimate(rows, logits + rows * ROW_GROUP_BYTES, hidden, tokens, responses)


def stored_per_token(manifest: dict[str, Any]) -> dict[str, float] | None:
    """Bytes on disk per token of a finished cache, by part, from its manifest's ``bytes`` and
    ``tokens`` counts (None for a version-1 cache, which has none): ``logits`` per response
    position, ``states`` per teacher token, ``total`` (every byte of the parts) per teacher token."""
    stored, tokens = manifest.get("bytes"), manifest.get("tokens")
    if not stored or not tokens:
        return None
    teacher, responses = max(tokens["teacher"], 1), max(tokens["responses"], 1)
    return {
        "logits": stored["logits"] / responses,
        "states": stored["states"] / teacher,
        "total": sum(stored.values()) / teacher,
    }


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if count < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


__all__ = [
    "ARTEFACT",
    "CACHE_VERSION",
    "CONTENT_KEYS",
    "LOGIT_COLUMNS",
    "READABLE_VERSIONS",
    "STATE_COLUMNS",
    "SPLITS",
    "SizeEstimate",
    "TeacherIdentity",
    "TeacherReads",
    "teacher_tokens_fingerprint",
    "content_key",
    "describe",
    "estimate_bytes",
    "human_bytes",
    "mismatches",
    "schema",
    "stored_per_token",
    "teacher_precision",
    "teacher_reads",
    "teacher_weights",
    "upgraded",
]
