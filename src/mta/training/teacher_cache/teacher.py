"""`mta teacher`: the recipe's teacher run once over the annotated rows of train and dev.

The rows are the ones ``mta distill`` would train on, and the teacher is loaded and run as
``FrozenTeacher`` runs it (truncation, dtype, autocast), asked for what the recipe's losses read
(``content.teacher_reads``): per row the hidden states of those layers at every real token (token
importance needs every token to recompute exactly) and, with a logit loss, the top k at τ and the
tail's mass at every position predicting a response token. Work in journalled chunks
(:mod:`mta.store.chunked_work`), shards and reuse as ``mta embed``'s: ARCHITECTURE.md, "2b. teacher".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from mta import distributed
from mta.data.annotations import Annotations
from mta.data.artefact_schema import INPUT_IDS, PROMPT_LEN, reannotate_command
from mta.errors import MtaError
from mta.generation.sampling import keyed_uniforms
from mta.hashing import json_sha256
from mta.losses.fused_head import HeadTeacher, OutputHead
from mta.losses.teacher_sampled import TailSamples, draw_tail_samples
from mta.losses.teacher_topk import CHUNK_POSITIONS, top_k_log_probs
from mta.models.tokenizers import tokenizer_fingerprint
from mta.reporting import Reporter, SilentReporter
from mta.store.chunked_work import ChunkedShard
from mta.store.layout import staging_directory
from mta.store.manifests import read_manifest
from mta.store.publish import commit_shard, writing_shard
from mta.store.reuse import reusable_output
from mta.training.batching import AnnotatedExamples
from mta.training.config.schema import Recipe, teacher_cache_problem
from mta.training.model_loading import (
    LoadedConfig,
    load_causal_lm,
    load_config_and_tokenizer,
    num_layers,
)
from mta.training.teacher import FrozenTeacher
from mta.training.teacher_cache.compact import pack_ids, quantize_states
from mta.training.teacher_cache.content import (
    ARTEFACT,
    LOGIT_COLUMNS,
    SPLITS,
    STATE_COLUMNS,
    TeacherIdentity,
    TeacherReads,
    content_key,
    describe,
    estimate_bytes,
    schema,
    teacher_precision,
    teacher_reads,
)

CHUNK_BYTES = 256 * 1024 * 1024  # values per journalled chunk: what a killed run may redo


@dataclass(frozen=True)
class SplitOutcome:
    """What one split's run did: ``manifest`` None while other shards of the set are missing."""

    split: str
    directory: Path
    manifest: dict[str, Any] | None
    reused: bool
    rows: int = 0  # rows computed by this call
    resumed_rows: int = 0  # rows a previous, killed run had finished


def cache_directory(recipe: Recipe, out_dir: str | Path | None) -> Path:
    """``-o`` when given, else ``teacher_cache.dir``; ``MtaError`` naming both when neither is set."""
    if out_dir is not None:
        return Path(out_dir)
    if recipe.teacher_cache.dir is None:
        raise MtaError("where should the teacher's outputs go? pass -o DIR, or set teacher_cache.dir in the recipe")
    return recipe.resolve(recipe.teacher_cache.dir, "teacher_cache.dir")


def run_teacher_stage(
    recipe: Recipe,
    *,
    out_dir: str | Path | None = None,
    shard: tuple[int, int] | None = None,
    batch_size: int | None = None,
    reporter: Reporter | None = None,
    force: bool = False,
) -> list[SplitOutcome]:
    """Store the teacher's side of ``recipe`` for its train and dev rows (module docstring)."""
    from mta.training.engine import resolve_training_precision
    from mta.training.train_data import load_split

    reporter = reporter or SilentReporter()
    root = cache_directory(recipe, out_dir)
    spec = recipe.teacher_cache.model_copy(update={"dir": str(root)})
    problem = teacher_cache_problem(recipe.model_copy(update={"teacher_cache": spec}))
    if problem is not None:
        raise MtaError(f"{'.'.join(problem[0])}: {problem[1]}")
    if recipe.teacher is None:  # teacher_cache_problem refused it; for the type checker
        raise MtaError("the recipe has no teacher")
    size = batch_size or recipe.train.micro_batch_size
    if size < 1:
        raise MtaError(f"--batch-size must be at least 1, got {size}")
    group = distributed.joined_process_group() if shard is None else nullcontext()
    with group:
        index, count = shard if shard is not None else (distributed.rank(), distributed.world_size())
        if not 0 <= index < count:
            raise MtaError(f"--shard {index}/{count}: the index must be in 0..{count - 1}")
        device = distributed.local_device()
        precision = resolve_training_precision(recipe.train, device)
        with distributed.main_process_first():
            student = load_config_and_tokenizer(recipe.student, recipe, "student")
            teacher = load_config_and_tokenizer(recipe.teacher, recipe, "teacher")
            fingerprints = {"student": tokenizer_fingerprint(student.tokenizer)}
            fingerprints["teacher"] = tokenizer_fingerprint(teacher.tokenizer)
            splits = {
                split: load_split(
                    recipe,
                    split,
                    teacher_tokenizer=teacher.tokenizer_source,
                    student_tokenizer=student.tokenizer_source,
                    fingerprints=fingerprints,
                    reporter=reporter if distributed.is_main() else None,
                )
                for split in SPLITS
            }
        reads = teacher_reads(recipe, num_layers(student.config), num_layers(teacher.config))
        identity = TeacherIdentity.of(
            teacher.path, teacher.tokenizer, teacher.config, teacher_precision(precision.name, recipe)
        )
        if identity.weights is None:
            raise MtaError(f"teacher.path: {teacher.path} holds no weight file (*.safetensors, *.bin)")
        stage = TeacherStage(recipe, teacher, identity, reads, precision, device, size, reporter, student.tokenizer)
        outcomes = []
        for split, annotations in splits.items():
            if annotations is not None:
                outcomes.append(stage.split(split, annotations, root / split, index, count, force=force))
        if shard is None and distributed.is_distributed():
            distributed.barrier()  # the last rank's commit wrote each manifest
            outcomes = [replace(o, manifest=read_manifest(o.directory)) for o in outcomes]
    return outcomes


class TeacherStage:
    """The teacher and what it is asked for, loaded at the first split that is not reused."""

    def __init__(
        self,
        recipe: Recipe,
        teacher: LoadedConfig,
        identity: TeacherIdentity,
        reads: TeacherReads,
        precision: Any,
        device: torch.device,
        batch_size: int,
        reporter: Reporter,
        student_tokenizer: Any,
    ):
        self.recipe, self.teacher, self.identity, self.reads = recipe, teacher, identity, reads
        self.precision, self.device, self.batch_size, self.reporter = precision, device, batch_size, reporter
        self.student_tokenizer = student_tokenizer
        self.model: FrozenTeacher | None = None

    def describe(self, split: str, annotations: Annotations) -> dict[str, Any]:
        return describe(
            self.recipe,
            split,
            reads=self.reads,
            teacher=self.identity,
            rows=annotations.table,
            annotations_dir=annotations.directory,
        )

    def frozen_teacher(self) -> FrozenTeacher:
        if self.model is None:
            assert self.recipe.teacher is not None, "run_teacher_stage checked the recipe's teacher"
            loaded = load_causal_lm(self.recipe.teacher, self.recipe, "teacher")
            model = loaded.model
            frozen = self.precision.frozen_dtype
            if frozen is not None and model.dtype == torch.float32:
                model.to(frozen)  # as mta.training.llm.build holds it
            # The head applied to the response positions a chunk at a time (never whole logits);
            # a head that transforms its logits (OutputHead.of refuses it) gives the model's.
            fused = self.reads.logits
            try:
                OutputHead.of(model)
            except MtaError:
                fused = False
            self.model = FrozenTeacher(model, list(self.reads.layers), self.reads.logits, fused=fused)
            self.model.to(self.device)
        return self.model

    def split(
        self, split: str, annotations: Annotations, out_dir: Path, shard: int, num_shards: int, *, force: bool
    ) -> SplitOutcome:
        description = self.describe(split, annotations)
        run_key = content_key(description)
        if not force:
            earlier = reusable_output(out_dir, run_key, shard, num_shards, kind=ARTEFACT, command="mta teacher")
            if earlier is not None:
                return SplitOutcome(split, out_dir, earlier.manifest, reused=True)
        with writing_shard(
            out_dir, shard, num_shards, command="mta teacher", kind=ARTEFACT, warn=self.reporter.message, force=force
        ):
            examples = AnnotatedExamples(
                annotations.table,
                student_pad_id=self.student_tokenizer.pad_token_id,
                teacher_pad_id=self.teacher.tokenizer.pad_token_id,
                with_teacher=True,
                granularities=(),
                rebuild=reannotate_command(annotations.manifest, annotations.directory),
            )
            lengths = pc.list_value_length(annotations.table.column(INPUT_IDS["teacher"])).to_numpy()
            positions = np.arange(shard, len(examples), num_shards)
            chunks = self._chunks(positions, lengths, description)
            plan_key = json_sha256(
                {
                    "run_key": run_key,
                    "rows": positions.tolist(),
                    "chunks": [[b.tolist() for b in c] for c in chunks],
                }
            )
            work = ChunkedShard(
                out_dir, shard, num_shards, plan_key, schema(description["storage"], description["states"])
            )
            label = f"teacher {split}" + (f" · shard {shard}/{num_shards}" if num_shards > 1 else "")
            resumed = work.resumed_rows
            if resumed:
                self.reporter.message(f"resuming: {resumed} of {len(positions)} rows were done")
            self.reporter.start(label, len(positions), completed=resumed, unit="rows")
            try:
                computed = work.compute(
                    chunks,
                    lambda chunk: self.chunk_table(examples, annotations, chunk, description),
                )
            finally:
                self.reporter.stop()
            entry = work.part(len(chunks), row_group_rows=1)  # zstd: 8-bit states take 0.6 of their bytes
            shard_manifest = {
                "counts": {
                    "rows": {"written": len(positions)},
                    "bytes": stored_bytes(staging_directory(out_dir) / entry["file"]),
                    "tokens": _token_counts(annotations, positions, lengths),
                },
                "skipped_examples": [],
                "part": entry,
                "run_key": run_key,
                "shard": shard,
                "num_shards": num_shards,
                "description": description,
            }
            manifest = commit_shard(out_dir, shard_manifest)
            work.remove()
        return SplitOutcome(split, out_dir, manifest, reused=False, rows=computed, resumed_rows=resumed)

    def _chunks(self, positions: np.ndarray, lengths: np.ndarray, description: dict) -> list[list[np.ndarray]]:
        """Batches of ``batch_size`` rows, longest first, grouped into chunks of about CHUNK_BYTES."""
        order = positions[np.argsort(-lengths[positions], kind="stable")]
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        chunks: list[list[np.ndarray]] = []
        held = CHUNK_BYTES
        for batch in batches:
            if held >= CHUNK_BYTES:
                chunks.append([])
                held = 0
            chunks[-1].append(batch)
            tokens = int(lengths[batch].sum())  # every token counted as a response position: an upper bound
            held += estimate_bytes(
                self.reads,
                top_k=description["top_k"] or 0,
                storage=description["storage"],
                hidden_size=self.identity.hidden_size,
                tokens=tokens,
                responses=tokens,
                rows=len(batch),
                samples=(description["sampling"] or {}).get("samples", 0),
                states=description["states"],
                vocab_size=self.identity.vocab_size,
            ).total
        return chunks

    @torch.no_grad()
    def chunk_table(
        self, examples: AnnotatedExamples, annotations: Annotations, chunk: Sequence[np.ndarray], description: dict
    ) -> pa.Table:
        teacher = self.frozen_teacher()
        storage = torch.float16 if description["storage"] == "compact" else torch.float32
        states, bits = description["states"], description["id_bits"]
        table_schema = schema(description["storage"], states)
        ids_column = annotations.table.column("id")
        columns: dict[str, list[Any]] = {name: [] for name in table_schema.names}
        for rows in chunk:
            batch = examples.batch(rows).to(self.device)
            side = batch.teacher
            assert side is not None, "AnnotatedExamples(with_teacher=True) gives the teacher's side"
            with self.precision.context():
                out = teacher(side.input_ids, side.attention_mask)
            tokens = side.attention_mask.sum(dim=1)
            row_ids = [int(ids_column[int(row)].as_py()) for row in rows]
            logits = self._logit_columns(out, side.labels, row_ids, description) if self.reads.logits else None
            for r, row_id in enumerate(row_ids):
                n = int(tokens[r])
                columns["id"].append(np.asarray([row_id], dtype=np.int64))
                columns["tokens"].append(np.asarray([n], dtype=np.int32))
                hidden = (
                    torch.stack([out.hidden_states[layer][r, :n] for layer in self.reads.layers]).float()
                    if self.reads.layers
                    else torch.zeros(0, n, 0)
                )
                scales = torch.zeros(0)
                if states != "storage":
                    hidden, scales = quantize_states(hidden, states)
                else:
                    hidden = hidden.to(storage)
                    if not torch.isfinite(hidden).all():
                        raise MtaError(
                            f"row {row_id}: the teacher's hidden states exceed float16's range "
                            "(|x| > 65504); set teacher_cache.storage=fp32 or teacher_cache.states=int8_token"
                        )
                columns["hidden"].append(hidden.reshape(-1).cpu().numpy())
                columns["hidden_scales"].append(scales.reshape(-1).cpu().numpy())
                for name in LOGIT_COLUMNS:
                    value = logits[name][r] if logits is not None else np.zeros(0)
                    columns[name].append(pack_ids(value, bits) if name in PACKED else value)
            self.reporter.advance(len(rows))
        return _arrow_table(columns, table_schema)

    def _logit_columns(
        self, out: Any, labels: torch.Tensor, row_ids: list[int], description: dict
    ) -> dict[str, list[np.ndarray]]:
        """Each row's logit columns (ids not packed yet): the head (top k) and tail at every position
        that predicts a response token, and with sampled logits the draws beyond the head."""
        assert out.logits is not None or out.side is not None, "FrozenTeacher(need_logits=True) gives them"
        storage = np.float16 if description["storage"] == "compact" else np.float32
        vocab, k, temperature = description["teacher"]["vocab_size"], description["top_k"], description["temperature"]
        predicts = labels[:, 1:] != -100  # position t predicts response token t + 1
        row_of, position = predicts.nonzero(as_tuple=True)
        per_row = predicts.sum(dim=1).tolist()
        found: dict[str, list[np.ndarray]] = {}
        sampling = description["sampling"]
        chunks = position_logits(out, row_of, position, vocab)  # one chunk alive at a time
        draw = {"top_k": k, "temperature": temperature, "vocab_size": vocab}
        if sampling is None:
            parts = [top_k_log_probs(logits, k, temperature=temperature, vocab_size=vocab) for _, logits in chunks]
            head_ids, head_log_probs, tail = (torch.cat(column) for column in zip(*parts, strict=True))
            empty = [np.zeros(0)] * len(per_row)
            found |= {name: empty for name in LOGIT_COLUMNS if name.startswith(("sample_", "rest_"))}
        else:
            purpose = f"teacher-cache/{description['split']}"
            uniforms = keyed_uniforms(sampling["seed"], purpose, row_ids, per_row, sampling["samples"])
            drawn = concatenated(
                [draw_tail_samples(logits, uniforms[begin : begin + len(logits)], **draw) for begin, logits in chunks]
            )
            head_ids, head_log_probs, tail = drawn.head_ids, drawn.head_log_probs, drawn.tail
            distinct = drawn.distinct.cpu()
            per_row_draws = [int(part.sum()) for part in distinct.split(per_row)]
            found["sample_distinct"] = _numpy(distinct.split(per_row), np.uint8)
            found["sample_ids"] = _numpy(drawn.ids.split(per_row_draws), np.int64)
            found["sample_counts"] = _numpy(drawn.counts.split(per_row_draws), np.uint8)
            found["sample_log_probs"] = _numpy(drawn.log_probs.split(per_row_draws), storage)
            assert drawn.rest_log_mean is not None, "draw_tail_samples gives it"
            found["rest_log_mean"] = _numpy(drawn.rest_log_mean.split(per_row), np.float32)
        found["positions"] = _numpy(position.split(per_row), np.int32)
        found["top_ids"] = _numpy(head_ids.split(per_row), np.int64)
        found["top_log_probs"] = _numpy(head_log_probs.split(per_row), storage)
        found["tail"] = _numpy(tail.split(per_row), np.float32)
        return found


def _token_counts(annotations: Annotations, positions: np.ndarray, lengths: np.ndarray) -> dict[str, int]:
    """The shard's teacher tokens and response tokens (the positions the logits are stored at)."""
    prompts = annotations.table.column(PROMPT_LEN["teacher"]).to_numpy()[positions]
    tokens = int(lengths[positions].sum())
    return {"teacher": tokens, "responses": tokens - int(prompts.sum())}


def _numpy(parts: Sequence[torch.Tensor], dtype: Any) -> list[np.ndarray]:
    return [part.reshape(-1).cpu().numpy().astype(dtype) for part in parts]


PACKED = ("top_ids", "sample_ids")  # id columns, packed in the cache's id_bits


def stored_bytes(path: Path) -> dict[str, int]:
    """Bytes of a written part on disk by what they hold: ``logits`` (the logit columns),
    ``states`` (hidden states and their scales), ``other`` (ids, counts, Parquet's footer)."""
    metadata = pq.ParquetFile(path).metadata
    found = {"logits": 0, "states": 0}
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for column in range(row_group.num_columns):
            chunk = row_group.column(column)
            name = chunk.path_in_schema.split(".")[0]
            part = "logits" if name in LOGIT_COLUMNS else "states" if name in STATE_COLUMNS else None
            if part is not None:
                found[part] += chunk.total_compressed_size
    found["other"] = path.stat().st_size - found["logits"] - found["states"]
    return found


def position_logits(
    out: Any, rows: torch.Tensor, columns: torch.Tensor, vocab_size: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(begin, logits [c, vocab_size])`` at the positions ``(rows[i], columns[i])``,
    ``CHUNK_POSITIONS`` at a time: from the final hidden states and the head when the teacher ran
    fused (the whole ``[batch, seq, vocab]`` logits never exist), else from its logits."""
    side = out.side.select(rows, columns) if isinstance(out.side, HeadTeacher) else None
    for begin in range(0, max(len(rows), 1), CHUNK_POSITIONS):  # no position: one empty chunk
        end = min(begin + CHUNK_POSITIONS, len(rows))
        if side is not None:
            yield begin, side.chunk_logits(begin, end, vocab_size)
        else:
            yield begin, out.logits[rows[begin:end], columns[begin:end]]


def concatenated(parts: list[TailSamples]) -> TailSamples:
    """One ``TailSamples`` of consecutive positions' parts."""

    def joined(name: str) -> torch.Tensor:
        return torch.cat([getattr(part, name) for part in parts])

    first = parts[0]
    return TailSamples(
        head_ids=joined("head_ids"),
        head_log_probs=joined("head_log_probs"),
        tail=joined("tail"),
        distinct=joined("distinct"),
        ids=joined("ids"),
        counts=joined("counts"),
        log_probs=joined("log_probs"),
        samples=first.samples,
        rest_log_mean=None if first.rest_log_mean is None else joined("rest_log_mean"),
    )


def _arrow_table(columns: dict[str, list[np.ndarray]], table_schema: pa.Schema) -> pa.Table:
    arrays = []
    for field in table_schema:
        values = columns[field.name]
        if pa.types.is_binary(field.type):
            arrays.append(pa.array(values, type=field.type))
            continue
        if not pa.types.is_list(field.type):
            arrays.append(pa.array(np.concatenate(values), type=field.type))
            continue
        element = field.type.value_type
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum([len(v) for v in values], out=offsets[1:])
        flat = np.concatenate(values).astype(element.to_pandas_dtype(), copy=False) if values else np.zeros(0)
        arrays.append(pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat, type=element)))
    return pa.Table.from_arrays(arrays, schema=table_schema)


__all__ = ["SplitOutcome", "cache_directory", "run_teacher_stage"]
