"""Training from a teacher cache: a split's cache checked against the recipe, and the teacher's
output of a gold micro batch rebuilt from it.

:class:`TeacherCache` opens one split's finished ``mta teacher`` output: the manifest must be a
teacher-outputs artefact of this version whose content keys equal the recipe's (a mismatch is
refused naming each key and what to change), every part must match its sha256, and every row
is found by id. :meth:`TeacherCache.outputs` gives a micro batch's ``TeacherOutput`` at the
batch's width: the stored hidden states at their tokens (zeros on padding), and, with a logit
loss, logits whose softmax at τ is the tail rule's p̃ at the positions that predict a response
token (zeros elsewhere, which no loss reads). A stored row whose token count differs from the
batch's row is refused: the cache was built from other annotations.

:class:`CachedTeacher` holds the caches of train and dev; ``Trainer.teacher_forward`` asks it for
the gold micro batches (``TrainBatch.origin == "gold"``) and the online teacher for the generated
and replayed ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from mta.errors import MtaError
from mta.losses.fused_head import TopKTeacher
from mta.losses.teacher_sampled import SampledTeacher, TailSamples
from mta.losses.teacher_topk import LOG_FLOOR, tail_fill
from mta.store.read import read_stage_manifest, verified_parts
from mta.training.batching import TrainBatch
from mta.training.teacher import TeacherOutput
from mta.training.teacher_cache.compact import dequantize_states, id_bits, unpack_ids
from mta.training.teacher_cache.content import (
    ARTEFACT,
    READABLE_VERSIONS,
    TeacherIdentity,
    describe,
    mismatches,
    upgraded,
)


def _build_hint(directory: Path) -> str:
    return f"build it with `mta teacher --recipe RECIPE -o {directory.parent}`"


def read_cache_manifest(directory: Path, what: str) -> dict[str, Any]:
    """A finished split cache's manifest, as stored (``what``: how the caller's user named it)."""
    return read_stage_manifest(
        directory,
        artefact=ARTEFACT,
        version_key="teacher_cache_version",
        version=READABLE_VERSIONS,
        command="mta teacher",
        build=f"mta teacher --recipe RECIPE -o {directory.parent}",
        what=what,
    )


class TeacherCache:
    """One split's cache (``DIR/<split>``), checked against ``expected`` (the recipe's
    :func:`~mta.training.teacher_cache.content.describe`)."""

    def __init__(self, directory: str | Path, expected: dict[str, Any], *, fused: bool = False):
        self.directory = directory = Path(directory)
        self.fused = fused  # loss.fused_head: hand the loss the top k itself (TopKTeacher), not dense logits
        manifest = upgraded(read_cache_manifest(directory, "teacher_cache.dir: "), expected)
        differ = mismatches(manifest, expected)
        if differ:
            raise MtaError(
                f"teacher_cache.dir: {directory} was built for another run; it is not used. "
                + "; ".join(differ)
                + f". Rebuild it: `mta teacher --recipe RECIPE -o {directory.parent}` (or --force)"
            )
        self.manifest = manifest
        self.stored_layers: list[int] = list(manifest["layers"])
        self.layers: list[int] = list(expected["layers"])  # what this run reads: a subset
        self.logits = bool(expected["logits"])
        self.hidden_size = int(manifest["teacher"]["hidden_size"])
        self.vocab_size = int(manifest["teacher"]["vocab_size"])
        self.temperature = float(manifest["temperature"] or 1.0)
        self.top_k = int(manifest["top_k"] or 0)
        self.sampling: dict[str, int] | None = manifest["sampling"]
        self.states: str = manifest["states"]
        self.id_bits = int(manifest.get("id_bits") or id_bits(self.vocab_size))
        self.files: list[pq.ParquetFile] = []
        self.where: dict[int, tuple[int, int]] = {}  # row id -> (file, row group)
        for number, (path, part) in enumerate(verified_parts(directory, manifest, command="mta teacher")):
            handle = pq.ParquetFile(path, memory_map=True)
            ids = handle.read(columns=["id"]).column("id").to_numpy()
            if handle.metadata.num_row_groups != len(ids) or len(ids) != part["rows"]:
                raise MtaError(f"{path}: {len(ids)} rows in {handle.metadata.num_row_groups} row groups, not one each")
            self.files.append(handle)
            self.where.update({int(row_id): (number, group) for group, row_id in enumerate(ids)})

    def __len__(self) -> int:
        return len(self.where)

    def row(self, row_id: int) -> dict[str, np.ndarray]:
        """The stored columns of one row, as numpy arrays."""
        try:
            number, group = self.where[row_id]
        except KeyError:
            raise MtaError(
                f"teacher_cache.dir: {self.directory} has no row with id {row_id}; it was built from other "
                f"annotations: {_build_hint(self.directory)} --force"
            ) from None
        table = self.files[number].read_row_group(group)
        found: dict[str, np.ndarray] = {}
        for name in table.column_names:
            column = table.column(name).combine_chunks()
            if pa.types.is_binary(column.type):  # packed ids (version 2)
                found[name] = np.frombuffer(column[0].as_py(), dtype=np.uint8)
            else:
                found[name] = (column.flatten() if pa.types.is_list(column.type) else column).to_numpy()
        # Ids: packed in id_bits since version 2, int32 lists in version 1.
        counts = {"top_ids": len(found["positions"]) * self.top_k, "sample_ids": len(found.get("sample_counts", ()))}
        for name, count in counts.items():
            if name in found:
                raw = found[name]
                found[name] = unpack_ids(raw, self.id_bits, count) if raw.dtype == np.uint8 else raw.astype(np.int64)
        return found

    def outputs(self, batch: TrainBatch) -> TeacherOutput:
        """The teacher's output for ``batch`` (a gold micro batch of this split), on its device."""
        side = batch.teacher
        if side is None:
            raise MtaError("a cached teacher reads the batch's teacher tokens, and the batch has none")
        device = side.input_ids.device
        width = side.input_ids.shape[1]
        rows = [self.row(int(row_id)) for row_id in batch.row_ids]
        tokens = side.attention_mask.sum(dim=1).tolist()
        for row_id, row, n in zip(batch.row_ids, rows, tokens, strict=True):
            if int(row["tokens"][0]) != n:
                raise MtaError(
                    f"teacher_cache.dir: row {row_id} has {int(row['tokens'][0])} teacher tokens in "
                    f"{self.directory} and {n} in the batch; the cache was built from other annotations: "
                    f"{_build_hint(self.directory)} --force"
                )
        hidden_states = {}
        if self.layers:
            wanted = [self.stored_layers.index(layer) for layer in self.layers]
            hidden = torch.zeros(len(self.layers), len(rows), width, self.hidden_size)
            for r, (row, n) in enumerate(zip(rows, tokens, strict=True)):
                stored = torch.from_numpy(np.array(row["hidden"])).view(len(self.stored_layers), n, self.hidden_size)
                if self.states != "storage":
                    scales = torch.from_numpy(np.array(row["hidden_scales"], dtype=np.float32))
                    stored = dequantize_states(stored, scales.view(len(self.stored_layers), -1), self.states)
                hidden[:, r, :n] = stored.float()[wanted]
            hidden = hidden.to(device)
            hidden_states = {layer: hidden[i] for i, layer in enumerate(self.layers)}
        logits, top_k = None, None
        if self.logits and self.fused:
            top_k = self._top_k(rows, width, device)
        elif self.logits:
            logits = self._logits(rows, width).to(device)
        return TeacherOutput(hidden_states, logits, side=top_k)

    def _top_k(self, rows: list[dict[str, np.ndarray]], width: int, device: torch.device) -> TopKTeacher:
        """The stored top k at ``[batch, width]`` positions (``ids``, ``log_probs`` ``[batch, width, k]``,
        ``tail`` ``[batch, width]``; ``LOG_FLOOR`` and id 0 where nothing is stored, which no loss
        reads): the fused loss rebuilds p̃ of a chunk of response positions at a time."""
        k = self.top_k
        counts = torch.tensor([len(row["positions"]) for row in rows], dtype=torch.long)
        row_of = torch.repeat_interleave(torch.arange(len(rows)), counts)
        position = torch.from_numpy(np.concatenate([row["positions"] for row in rows]).astype(np.int64))
        ids = torch.zeros(len(rows), width, k, dtype=torch.long)
        log_probs = torch.full((len(rows), width, k), LOG_FLOOR)
        tail = torch.full((len(rows), width), LOG_FLOOR)
        ids[row_of, position] = torch.from_numpy(
            np.concatenate([row["top_ids"] for row in rows]).astype(np.int64)
        ).view(-1, k)
        log_probs[row_of, position] = torch.from_numpy(
            np.concatenate([row["top_log_probs"] for row in rows]).astype(np.float32)
        ).view(-1, k)
        tail[row_of, position] = torch.from_numpy(np.concatenate([row["tail"] for row in rows]).astype(np.float32))
        return TopKTeacher(ids.to(device), log_probs.to(device), tail.to(device), self.vocab_size, self.temperature)

    def _logits(self, rows: list[dict[str, np.ndarray]], width: int) -> torch.Tensor | SampledTeacher:
        """With sampled logits, :meth:`_sampled`; else ``[batch, width, V]`` logits whose softmax
        at τ is p̃ at each stored position (the tail rule of
        :func:`~mta.losses.teacher_topk.dense_log_probs`, written in one pass: every position's tail
        value, then the top k over it), 0 elsewhere."""
        if self.sampling is not None:
            return self._sampled(rows, width)
        k = self.top_k
        counts = torch.tensor([len(row["positions"]) for row in rows], dtype=torch.long)
        row_of = torch.repeat_interleave(torch.arange(len(rows)), counts)
        position = torch.from_numpy(np.concatenate([row["positions"] for row in rows]).astype(np.int64))
        flat = row_of * width + position  # [n] rows of the [batch · width, V] view
        ids = torch.from_numpy(np.concatenate([row["top_ids"] for row in rows]).astype(np.int64)).view(-1, k)
        log_probs = torch.from_numpy(np.concatenate([row["top_log_probs"] for row in rows]).astype(np.float32))
        tail = torch.from_numpy(np.concatenate([row["tail"] for row in rows]).astype(np.float32))
        fill = torch.zeros(len(rows) * width)
        fill[flat] = tail_fill(tail, k, self.vocab_size) * self.temperature
        logits = fill.unsqueeze(-1).expand(-1, self.vocab_size).contiguous()
        logits.view(-1)[(flat.unsqueeze(-1) * self.vocab_size + ids).view(-1)] = log_probs * self.temperature
        return logits.view(len(rows), width, self.vocab_size)

    def _sampled(self, rows: list[dict[str, np.ndarray]], width: int) -> SampledTeacher:
        """The estimator's entries (:class:`~mta.losses.teacher_sampled.SampledTeacher`) ``[batch,
        width, m]`` at each stored position (the head, then the draws), weight 0 elsewhere."""
        assert self.sampling is not None, "a sampled cache"

        def cat(name: str, dtype: Any) -> torch.Tensor:
            return torch.from_numpy(np.concatenate([row[name] for row in rows]).astype(dtype))

        counts = torch.tensor([len(row["positions"]) for row in rows], dtype=torch.long)
        row_of = torch.repeat_interleave(torch.arange(len(rows)), counts)
        flat = row_of * width + cat("positions", np.int64)  # [n] rows of the [batch · width, m] view
        stored = TailSamples(
            cat("top_ids", np.int64).view(-1, self.top_k),
            cat("top_log_probs", np.float32).view(-1, self.top_k),
            cat("tail", np.float32),
            cat("sample_distinct", np.int64),
            cat("sample_ids", np.int64),
            cat("sample_counts", np.int64),
            cat("sample_log_probs", np.float32),
            int(self.sampling["samples"]),
            cat("rest_log_mean", np.float32),
        )
        entries = SampledTeacher.from_samples(stored, self.vocab_size)  # [n, m]
        m = entries.ids.shape[1]
        ids = torch.zeros(len(rows) * width, m, dtype=torch.long)
        log_probs = torch.full((len(rows) * width, m), LOG_FLOOR)
        weights = torch.zeros(len(rows) * width, m)
        ids[flat], log_probs[flat], weights[flat] = entries.ids, entries.log_probs, entries.weights
        rest, log_mean = torch.full((2, len(rows) * width), LOG_FLOOR)
        rest[flat], log_mean[flat] = entries.rest, entries.rest_log_mean
        shape = (len(rows), width, m)
        return SampledTeacher(
            ids.view(shape),
            log_probs.view(shape),
            weights.view(shape),
            self.vocab_size,
            rest.view(shape[:2]),
            log_mean.view(shape[:2]),
        )


class CachedTeacher:
    """The caches of the run's splits (``{"train": TeacherCache, "dev": TeacherCache}``)."""

    def __init__(self, caches: dict[str, TeacherCache]):
        self.caches = caches

    def outputs(self, batch: TrainBatch, split: str) -> TeacherOutput:
        cache = self.caches.get(split)
        if cache is None:
            raise MtaError(f"teacher_cache.dir holds no {split} split; re-run `mta teacher` with data.{split} set")
        return cache.outputs(batch)


def open_teacher_caches(recipe: Any, splits: dict[str, Any], *, reads: Any, teacher: TeacherIdentity) -> CachedTeacher:
    """``recipe.teacher_cache.dir``'s cache of each split the run has (``splits``: the loaded
    ``Annotations`` or None), each checked against what this run's ``teacher`` would compute.

    The teacher's weights are fingerprinted when they are there; without them (deleted, or never
    downloaded) the cache's record stands for them."""
    root = Path(recipe.resolve(recipe.teacher_cache.dir, "teacher_cache.dir"))
    caches = {
        split: TeacherCache(
            root / split,
            describe(recipe, split, reads=reads, teacher=teacher, rows=rows.table, annotations_dir=rows.directory),
            fused=recipe.fused_head_runs,
        )
        for split, rows in splits.items()
        if rows is not None
    }
    return CachedTeacher(caches)


__all__ = ["CachedTeacher", "TeacherCache", "open_teacher_caches", "read_cache_manifest"]
