"""`mta embed`: a teacher's sentence embedding of every training text, computed once, so that
TALAS's distillation never loads the teacher (docs: TALAS.md §1). Input, output and work layout:
ARCHITECTURE.md, "1b. embed"; chunks and reuse through ``mta.store`` (a complete artefact with the
same key is returned as it is unless ``force``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from mta import distributed
from mta.data.rows import INVALID_TEXT, MISSING_FIELD, RowProblem, string_field
from mta.data.sources import InputSource, input_identity, open_source
from mta.dtypes import resolve_dtype
from mta.embedding.encoder import EncoderPlan, SentenceEncoder, load_encoder, plan_encoder
from mta.embedding.pooling import AUTO
from mta.errors import MtaError
from mta.hashing import directory_checksums, json_sha256
from mta.reporting import Reporter, SilentReporter
from mta.store.chunked_work import ChunkedShard
from mta.store.manifests import MAX_SKIPPED_EXAMPLES, read_manifest
from mta.store.publish import commit_shard, writing_shard
from mta.store.read import read_stage_manifest, verified_parts
from mta.store.reuse import reusable_output
from mta.versions import MTA_VERSION, package_versions

log = logging.getLogger(__name__)

ARTEFACT = "teacher-embeddings"  # the manifest's ``artefact``: what this directory is
EMBEDDINGS_VERSION = 1  # the manifest's ``embeddings_version``: this module's columns and keys
CHUNK_ROWS = 2048  # rows per journalled chunk: what a killed run may have to redo
TEXT_RULE = "text|instruction+input+response|prompt+response"
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("embedding", pa.list_(pa.float32()), nullable=False),
    ]
)


# --------------------------------------------------------------------------- the text of a row


class _NoText(ValueError):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


def _string(record: dict, key: str, *, optional: bool = False) -> str | None:
    return string_field(record, key, optional=optional, problem=_NoText)


def embedding_text(record: Any, text_field: str | None = None) -> str:
    """The text ``mta embed`` encodes for one decoded row: ``text_field``, else ``text``, else an
    instruction row's instruction, input/context and response, else prompt + response (or
    completion); raises ``ValueError`` (with ``reason`` and ``message``) when the row has none."""
    if not isinstance(record, dict):
        raise _NoText(MISSING_FIELD, f"expected an object, got {type(record).__name__}")
    if text_field is not None:
        text = _string(record, text_field)
    elif "text" in record:
        text = _string(record, "text")
    elif "instruction" in record and ("output" in record or "response" in record):
        response = _string(record, "output" if "output" in record else "response")
        context = _string(record, "input" if "input" in record else "context", optional=True)
        text = "\n\n".join(part for part in (_string(record, "instruction"), context, response) if part)
    elif "prompt" in record and ("response" in record or "completion" in record):
        response = _string(record, "response" if "response" in record else "completion")
        text = f"{_string(record, 'prompt')}\n\n{response}"
    else:
        keys = ", ".join(sorted(record)) or "none"
        raise _NoText(
            MISSING_FIELD,
            "no text: expected 'text', an instruction row (instruction + output / response) or "
            f"prompt + response; the row has keys: {keys} (name another column with --text-field)",
        )
    if not text.strip():
        raise _NoText(INVALID_TEXT, "the text is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise _NoText(INVALID_TEXT, f"the text holds an unpaired surrogate at character {error.start}") from None
    return text


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class TeacherEmbeddings:
    """A complete ``mta embed`` directory, rows sorted by id.

    ids: ``[n]`` int64 (input row indices); texts: the n texts; embeddings: ``[n, d]`` float32;
    manifest: ``.mta/manifest.json`` as written (``teacher``, ``pooling``, ``max_length``, ...).
    """

    directory: Path
    ids: np.ndarray
    texts: list[str]
    embeddings: torch.Tensor
    manifest: dict[str, Any]

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def dimension(self) -> int:
        return int(self.embeddings.shape[1])

    def positions(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Row positions of the given input ids; ``MtaError`` naming one that is not here."""
        wanted = np.asarray(ids, dtype=np.int64)
        found = np.searchsorted(self.ids, wanted)
        inside = found < len(self.ids)
        bad = ~inside
        bad[inside] = self.ids[found[inside]] != wanted[inside]
        if bad.any():
            raise MtaError(f"{self.directory} has no row with id {int(wanted[bad][0])}")
        return found


def read_teacher_embeddings(directory: str | Path) -> TeacherEmbeddings:
    """Read a complete ``mta embed`` output (every part checked against its sha256 and row
    count); ``MtaError`` naming the fix when it is incomplete, changed or another artefact."""
    directory = Path(directory)
    manifest = read_stage_manifest(
        directory,
        artefact=ARTEFACT,
        version_key="embeddings_version",
        version=EMBEDDINGS_VERSION,
        command="mta embed",
        build=f"mta embed --teacher TEACHER DATA -o {directory}",
    )
    tables = []
    for path, part in verified_parts(directory, manifest, command="mta embed"):
        try:
            table = pq.read_table(path, schema=SCHEMA)
        except (pa.ArrowException, OSError) as error:
            raise MtaError(
                f"{path} is not a readable embeddings part ({error}); re-run `mta embed ... --force`"
            ) from error
        if table.num_rows != part["rows"]:
            raise MtaError(f"{path} has {table.num_rows} rows, the manifest says {part['rows']}")
        tables.append(table)
    table = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
    table = table.sort_by("id")
    dimension = int(manifest.get("dimension") or 0)
    column = table.column("embedding").combine_chunks()
    values = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    if table.num_rows and values.size != table.num_rows * dimension:
        raise MtaError(f"{directory}: the embeddings are not all {dimension} wide; re-run `mta embed ... --force`")
    embeddings = torch.from_numpy(values.reshape(table.num_rows, dimension).copy())
    return TeacherEmbeddings(
        directory=directory,
        ids=table.column("id").to_numpy().astype(np.int64),
        texts=table.column("text").to_pylist(),
        embeddings=embeddings,
        manifest=manifest,
    )


def holds_teacher_embeddings(directory: str | Path) -> bool:
    """Whether ``directory`` holds a finished ``mta embed`` output (manifest only, not verified)."""
    try:
        manifest = read_manifest(directory)
    except MtaError:
        return False
    return manifest is not None and manifest.get("artefact") == ARTEFACT


# --------------------------------------------------------------------------- building


@dataclass(frozen=True)
class EmbedOutcome:
    """What a run did: ``manifest`` None while other shards of the set are missing."""

    directory: Path
    manifest: dict[str, Any] | None
    reused: bool
    rows: int = 0  # rows embedded by this call (resumed chunks not counted)
    resumed_rows: int = 0  # rows a previous, killed run had finished


def build_teacher_embeddings(teacher: str | Path, data: str | Path, output: str | Path, **options: Any) -> Path:
    """Embed every text of ``data`` with ``teacher`` into ``output`` (or reuse it); return ``output``.

    ``options`` are :func:`run_embed`'s (pooling, normalize, max_length, batch_size, dtype,
    device, text_field, on_error, reporter, shard, force).
    """
    return run_embed(teacher, data, output, **options).directory


def run_embed(
    teacher: str | Path,
    data: str | Path,
    output: str | Path,
    *,
    pooling: str = AUTO,
    normalize: bool | None = None,
    max_length: int | None = None,
    batch_size: int = 64,
    dtype: str = "auto",
    device: str = "auto",
    text_field: str | None = None,
    on_error: Literal["fail", "skip"] = "fail",
    reporter: Reporter | None = None,
    shard: tuple[int, int] | None = None,
    force: bool = False,
) -> EmbedOutcome:
    """Embed every text of ``data`` with ``teacher`` into ``output`` (or reuse it); returns what
    the run did (the CLI reports it; :func:`build_teacher_embeddings` returns the directory).

    pooling: ``auto`` (a sentence-transformers directory's own, else mean), ``mean``, ``cls``,
    ``max`` or ``last`` (:mod:`mta.embedding.pooling`); normalize: None follows the config.
    max_length: tokens per text (None: the teacher's ``max_seq_length``, else 256). dtype:
    ``auto`` (bf16 where the device computes it natively, else fp32: ``mta.dtypes``), ``fp32``,
    ``bf16``, ``fp16``. shard: ``(index, count)``, or None for this process's rank in the
    launcher's group. See the module docstring for the text rule, the files and resumption.
    """
    if batch_size < 1:
        raise MtaError(f"--batch-size must be at least 1, got {batch_size}")
    if max_length is not None and max_length < 2:
        raise MtaError(f"--max-length must be at least 2 (room for the special tokens), got {max_length}")
    if on_error not in ("fail", "skip"):
        raise MtaError(f"on_error must be 'fail' or 'skip', got '{on_error}'")
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise MtaError(f"-o {output} is a file; give a directory")
    reporter = reporter or SilentReporter()
    group = distributed.joined_process_group() if shard is None else nullcontext()
    with group:
        index, count = shard if shard is not None else (distributed.rank(), distributed.world_size())
        if not 0 <= index < count:
            raise MtaError(f"--shard {index}/{count}: the index must be in 0..{count - 1}")
        outcome = _run_shard(
            teacher,
            Path(data),
            output,
            pooling=pooling,
            normalize=normalize,
            max_length=max_length,
            batch_size=batch_size,
            dtype=dtype,
            device=device,
            text_field=text_field,
            on_error=on_error,
            reporter=reporter,
            shard=index,
            num_shards=count,
            force=force,
        )
        if shard is None and distributed.is_distributed():
            distributed.barrier()  # the last rank's commit wrote the manifest
            outcome = EmbedOutcome(output, read_manifest(output), outcome.reused, outcome.rows, outcome.resumed_rows)
    return outcome


def teacher_fingerprint(teacher: str | Path) -> str:
    """``sha256:`` of every file of a local teacher directory, or ``hub:<name>``."""
    path = Path(teacher).expanduser()
    if path.is_dir():
        return "sha256:" + json_sha256(directory_checksums(path))
    return f"hub:{teacher}"


def _run_shard(
    teacher,
    data: Path,
    out_dir: Path,
    *,
    pooling,
    normalize,
    max_length,
    batch_size,
    dtype,
    device,
    text_field,
    on_error,
    reporter: Reporter,
    shard: int,
    num_shards: int,
    force: bool,
) -> EmbedOutcome:
    source = open_source(data)
    summary = source.summary()
    torch_device = distributed.resolve_device(device)
    compute_dtype = resolve_dtype(dtype, torch_device)
    plan = plan_encoder(teacher, pooling=pooling, normalize=normalize, max_length=max_length)
    description = _describe(teacher, source, summary, plan, compute_dtype, text_field, on_error)
    run_key = _run_key(description)
    if not force:
        reused = _reusable(out_dir, run_key, shard, num_shards)
        if reused is not None:
            return reused  # the teacher's weights are never loaded
    texts, ids, problems = _shard_texts(source, text_field, on_error, shard, num_shards)
    with writing_shard(
        out_dir, shard, num_shards, command="mta embed", kind=ARTEFACT, warn=reporter.message, force=force
    ):
        if not force:
            reused = _reusable(out_dir, run_key, shard, num_shards)
            if reused is not None:
                return reused
        encoder = load_encoder(teacher, dtype=compute_dtype, device=torch_device, plan=plan)
        shard_manifest, done, resumed, work = _embed_shard(
            encoder,
            texts,
            ids,
            out_dir,
            run_key,
            shard,
            num_shards,
            batch_size,
            reporter,
            label=f"embed {data.name}" + (f" · shard {shard}/{num_shards}" if num_shards > 1 else ""),
        )
        skipped = Counter(problem.reason for problem in problems)
        shard_manifest["counts"]["rows"].update(read=len(ids) + len(problems), skipped=len(problems))
        shard_manifest["counts"]["skipped"] = dict(skipped)
        shard_manifest["skipped_examples"] = [source.describe(problem) for problem in problems[:MAX_SKIPPED_EXAMPLES]]
        shard_manifest.update(run_key=run_key, shard=shard, num_shards=num_shards, description=description)
        manifest = commit_shard(out_dir, shard_manifest)
        work.remove()
    return EmbedOutcome(out_dir, manifest, reused=False, rows=done, resumed_rows=resumed)


def _describe(
    teacher, source: InputSource, summary, plan: EncoderPlan, dtype: torch.dtype, text_field, on_error
) -> dict:
    config = plan.config
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    return {
        "artefact": ARTEFACT,
        "embeddings_version": EMBEDDINGS_VERSION,
        "mta_version": MTA_VERSION,
        "input": {**source.record(summary), "text": text_field or TEXT_RULE},
        "teacher": {
            "name": str(teacher),
            "fingerprint": teacher_fingerprint(teacher),
            "model_type": getattr(config, "model_type", None),
            "num_layers": getattr(config, "num_hidden_layers", None),
            "hidden_size": getattr(config, "hidden_size", None),
        },
        "pooling": plan.pooling.record(),
        "max_length": plan.max_length,
        "precision": precision,
        "dimension": plan.dimension,
        "on_error": on_error,
        "versions": package_versions(),
    }


def _run_key(description: dict) -> str:
    """Hash of what decides the vectors: teacher bytes, input bytes and text rule, pooling,
    length, precision, error policy. Paths, names and versions are left out."""
    identity = {
        "embeddings_version": EMBEDDINGS_VERSION,
        "input": input_identity(description["input"]),
        "text": description["input"]["text"],
        "teacher": description["teacher"]["fingerprint"],
        **{key: description[key] for key in ("pooling", "max_length", "precision", "on_error")},
    }
    return "sha256:" + json_sha256(identity)


def _reusable(out_dir: Path, run_key: str, shard: int, num_shards: int) -> EmbedOutcome | None:
    """The outcome of an earlier run with the same key whose parts are intact (sha256), if any
    (:func:`mta.store.reuse.reusable_output`)."""
    earlier = reusable_output(out_dir, run_key, shard, num_shards, kind=ARTEFACT, command="mta embed")
    return None if earlier is None else EmbedOutcome(out_dir, earlier.manifest, reused=True)


def _shard_texts(source: InputSource, text_field, on_error, shard: int, num_shards: int):
    """The shard's texts and ids, and the problems of the rows that have none."""
    texts: list[str] = []
    ids: list[int] = []
    problems: list[RowProblem] = []
    for row_id, line, record in source.records(shard=shard, num_shards=num_shards):
        problem = record if isinstance(record, RowProblem) else None
        if problem is None:
            try:
                texts.append(embedding_text(record, text_field))
                ids.append(row_id)
                continue
            except _NoText as invalid:
                problem = RowProblem(row_id, line, invalid.reason, invalid.message)
        if on_error == "fail":
            raise MtaError(f"{source.describe(problem)} (fix the row, or pass --on-error skip to skip and count it)")
        problems.append(problem)
    return texts, ids, problems


def plan_batches(lengths: Sequence[int], ids: Sequence[int], batch_size: int) -> list[list[int]]:
    """Positions grouped into batches of ``batch_size``, longest texts first (ties by id), so
    each batch pads to about its own length and an out-of-memory shows in the first batch."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], ids[i]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def _chunks(batches: list[list[int]], chunk_rows: int) -> list[list[list[int]]]:
    chunks: list[list[list[int]]] = []
    for batch in batches:
        if not chunks or sum(map(len, chunks[-1])) >= chunk_rows:
            chunks.append([])
        chunks[-1].append(batch)
    return chunks


def _embed_shard(
    encoder: SentenceEncoder,
    texts: list[str],
    ids: list[int],
    out_dir: Path,
    run_key: str,
    shard: int,
    num_shards: int,
    batch_size: int,
    reporter: Reporter,
    *,
    label: str,
) -> tuple[dict, int, int, ChunkedShard]:
    """Embed the shard chunk by chunk (journalled, :mod:`mta.store.chunked_work`), then stream
    the chunks into its part."""
    lengths = encoder.lengths(texts) if texts else []
    batches = plan_batches(lengths, ids, batch_size)
    chunks = _chunks(batches, CHUNK_ROWS)
    plan_key = json_sha256({"run_key": run_key, "ids": ids, "batch_size": batch_size, "chunk_rows": CHUNK_ROWS})
    work = ChunkedShard(out_dir, shard, num_shards, plan_key, SCHEMA)
    resumed = work.resumed_rows
    truncated = sum(1 for length in lengths if length >= encoder.max_length)
    if truncated:  # at the limit: cut, or exactly as long (told apart without the limit)
        at_limit = [texts[i] for i, length in enumerate(lengths) if length >= encoder.max_length]
        truncated = sum(1 for length in encoder.untruncated_lengths(at_limit) if length > encoder.max_length)
    if resumed:
        reporter.message(f"resuming: {resumed} of {len(texts)} texts were embedded by an earlier run")

    def table_of(chunk: list[list[int]]) -> pa.Table:
        rows_ids: list[int] = []
        rows_texts: list[str] = []
        vectors: list[torch.Tensor] = []
        for batch in chunk:
            batch_texts = [texts[i] for i in batch]
            vectors.append(encoder.embed_batch(encoder.tokenize(batch_texts)))
            rows_ids.extend(ids[i] for i in batch)
            rows_texts.extend(batch_texts)
            reporter.advance(len(batch))
        return _table(rows_ids, rows_texts, torch.cat(vectors))

    reporter.start(label, len(texts), completed=resumed, unit="texts")
    try:
        computed = work.compute(chunks, table_of)
    finally:
        reporter.stop()
    entry = work.part(len(chunks))
    counts = {"rows": {"written": len(texts), "truncated": truncated}}
    return {"counts": counts, "skipped_examples": [], "part": entry}, computed, resumed, work


def _table(ids: list[int], texts: list[str], vectors: torch.Tensor) -> pa.Table:
    rows, width = vectors.shape
    flat = pa.array(vectors.contiguous().view(-1).numpy(), type=pa.float32())
    offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
    return pa.Table.from_arrays(
        [pa.array(ids, type=pa.int64()), pa.array(texts, type=pa.string()), pa.ListArray.from_arrays(offsets, flat)],
        schema=SCHEMA,
    )
