"""The data of an embedding recipe: texts with their teacher's stored sentence embeddings.

``data.train`` / ``data.dev`` name either an ``mta embed`` output directory, read as it is, or
rows (a JSONL, Parquet or CSV file, a ``datasets`` save_to_disk directory) that the recipe's
teacher embeds at first use into ``OUTPUT_DIR/embeddings/<split>`` through
``mta.embedding.build_teacher_embeddings`` (the code behind ``mta embed``): a cache, reused while
the input and the teacher's settings are unchanged, rebuilt otherwise. The teacher is loaded
only for that; training reads the stored vectors.

``EmbeddingExamples`` tokenises every text once for the student (``data.max_length`` tokens,
special ones included) into flat numpy arrays, so a batch is a few vectorised gathers, as
``mta.training.batching.AnnotatedExamples`` does for annotate rows; the trainer orders and
shards its rows with the same ``micro_batch_order`` and ``StepSchedule``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mta.embedding import TeacherEmbeddings, build_teacher_embeddings, holds_teacher_embeddings, read_teacher_embeddings
from mta.errors import MtaError
from mta.reporting import Reporter

TOKENIZE_BLOCK = 8192  # texts per tokenizer call while the examples are built
EMBED_BATCH = 64  # texts per teacher forward when embedding at first use


@dataclass
class EmbeddingBatch:
    """input_ids, attention_mask: ``[batch, seq]`` (right-padded student tokens); teacher:
    ``[batch, d_T]`` float32, the stored teacher embedding of each row; row_ids: input row ids."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    teacher: torch.Tensor
    row_ids: list[int]

    def to(self, device: torch.device | str) -> EmbeddingBatch:
        return EmbeddingBatch(
            self.input_ids.to(device), self.attention_mask.to(device), self.teacher.to(device), self.row_ids
        )

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


class EmbeddingExamples:
    """Rows of a teacher-embeddings artefact, tokenised for the student once."""

    pair_ids = None  # no DistiLLM-2 pairs: the sampler orders rows one by one

    def __init__(self, embeddings: TeacherEmbeddings, tokenizer, max_length: int):
        ids: list[list[int]] = []
        for start in range(0, len(embeddings.texts), TOKENIZE_BLOCK):
            block = embeddings.texts[start : start + TOKENIZE_BLOCK]
            ids.extend(tokenizer(block, truncation=True, max_length=max_length)["input_ids"])
        self.student_lengths = np.array([len(row) for row in ids], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.student_lengths)])
        self.values = np.fromiter((token for row in ids for token in row), dtype=np.int64, count=int(self.offsets[-1]))
        self.teacher = embeddings.embeddings
        self.ids = embeddings.ids
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.source = embeddings

    def __len__(self) -> int:
        return len(self.student_lengths)

    def batch(self, rows: np.ndarray) -> EmbeddingBatch:
        """The rows at positions ``rows``, right-padded to the longest of them."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = self.student_lengths[rows]
        width = int(lengths.max())
        positions = np.arange(width)
        real = positions[None, :] < lengths[:, None]
        input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        input_ids[real] = self.values[(self.offsets[rows][:, None] + positions[None, :])[real]]
        return EmbeddingBatch(
            torch.from_numpy(input_ids),
            torch.from_numpy(real.astype(np.int64)),
            self.teacher[torch.from_numpy(rows)],
            self.ids[rows].tolist(),
        )


def load_teacher_embeddings(
    recipe, split: str, *, teacher_model: str | None, reporter: Reporter | None = None
) -> TeacherEmbeddings | None:
    """The teacher embeddings of ``data.<split>`` (None without that split), built at first use
    when the split names rows. teacher_model: the teacher's directory or hub name (its ``tiny``
    model already built), or None when the recipe has no teacher."""
    written = getattr(recipe.data, split)
    if written is None:
        return None
    key = f"data.{split}"
    source = recipe.resolve(written, key)
    from mta.data.sources import is_dataset_directory

    if holds_teacher_embeddings(source):
        directory = source
    elif source.is_file() or is_dataset_directory(source):
        if teacher_model is None:
            raise MtaError(
                f"{key}: {source} holds rows, and the recipe names no teacher to embed them: add "
                f"teacher: {{path: ...}} (embedded at first use), or embed them first with `mta embed "
                f"--teacher TEACHER {written} -o DIR` and set {key} to DIR"
            )
        directory = recipe.resolve(recipe.output_dir, "output_dir") / "embeddings" / split
        build_teacher_embeddings(
            teacher_model,
            source,
            directory,
            pooling=recipe.teacher.pooling,
            max_length=recipe.data.max_length,
            batch_size=EMBED_BATCH,
            dtype=recipe.teacher.dtype,
            text_field=recipe.data.text_field,
            reporter=reporter,
            shard=(0, 1),  # inside main_process_first: rank 0 embeds every row
        )
    elif source.is_dir():
        raise MtaError(f"{key}: {source} is neither an `mta embed` output nor a datasets directory of rows")
    else:
        raise MtaError(
            f"{key}: {source} does not exist: give an `mta embed` output directory, or rows (a JSONL, "
            "Parquet or CSV file, or a datasets save_to_disk directory) the teacher embeds at first use"
        )
    embeddings = read_teacher_embeddings(directory)
    if len(embeddings) == 0:
        raise MtaError(f"{key}: {directory} holds no rows")
    return embeddings


def describe_embeddings(split: str, embeddings: TeacherEmbeddings) -> str:
    """One line for the run's summary: rows, width and how the vectors were made."""
    manifest = embeddings.manifest
    teacher = (manifest.get("teacher") or {}).get("name", "?")
    pooling = (manifest.get("pooling") or {}).get("mode", "?")
    return (
        f"{split}: {len(embeddings)} texts with teacher embeddings of width {embeddings.dimension} "
        f"({Path(str(teacher)).name}, pooling {pooling}, max length {manifest.get('max_length', '?')}, "
        f"{manifest.get('precision', '?')}) from {embeddings.directory}"
    )
